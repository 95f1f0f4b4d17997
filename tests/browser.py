"""Pytest plugin: a real headless Chromium, driven by Playwright's sync API.

Fixtures: ``browser`` (one per session) and ``page`` (a fresh context per test).
Tests that use them are marked ``browser`` (added automatically if forgotten), so
``-m "not browser"`` leaves them out.

The browser is the system's Chromium (Debian package ``chromium``), never one
downloaded by Playwright: the tests must run offline and on the browser the
machine actually has. ``sh scripts/test.sh`` installs it first when it is missing
and it can (``scripts/system.sh``). Without it, browser tests are skipped saying
how to get it, except on CI (``CI=true``) where a missing browser is a failure,
not a reason to go green.
"""

import os

import pytest

CHROMIUM = "/usr/bin/chromium"

CHROMIUM_ARGS = [
    # Containers and CI runners usually lack the namespaces the sandbox needs.
    "--no-sandbox",
    "--disable-gpu",
    # Keep the browser from talking to anything but the server under test: no
    # QUIC, no update checks, no sync, no background fetches.
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Long enough for a loaded CI machine, short enough that a wrong selector fails
# the test in seconds rather than at the suite's timeout.
DEFAULT_TIMEOUT_MS = 10_000

BROWSER_FIXTURES = {"browser", "page"}


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated here so the plugin stands alone.
    config.addinivalue_line(
        "markers", "browser: drives a real headless Chromium through Playwright"
    )


def _uses_browser(item):
    return bool(BROWSER_FIXTURES.intersection(getattr(item, "fixturenames", ())))


def pytest_itemcollected(item):
    # Marked as each test is collected, before -m selects, so a test that forgot
    # @pytest.mark.browser is still left out by -m "not browser".
    if _uses_browser(item):
        item.add_marker(pytest.mark.browser)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    # While Playwright's sync API is running, the main thread looks like it is
    # inside an asyncio event loop, and Django refuses ORM calls there
    # (SynchronousOnlyOperation). The browser fixture therefore allows them, and
    # browser tests run last (after pytest-django's own ordering), so every other
    # test still runs with Django's check intact.
    items.sort(key=_uses_browser)


def _give_up(reason):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: browser tests must run on CI)", pytrace=False)
    pytest.skip(reason)


def chromium_executable():
    """Return the path of the system Chromium, or skip (fail on CI) saying how to get it."""
    if not os.access(CHROMIUM, os.X_OK):
        _give_up(f"Chromium is not installed at {CHROMIUM}: run `sh scripts/system.sh` as root,"
                 " or `apt-get install chromium`")
    return CHROMIUM


@pytest.fixture(scope="session")
def browser():
    """Start one headless Chromium for the whole session."""
    executable = chromium_executable()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _give_up("Playwright is not installed: pip install -e '.[test]'")

    with pytest.MonkeyPatch.context() as patch:
        # See pytest_collection_modifyitems: the test body, pytest-django's
        # database teardown and the test's own queries run on the main thread,
        # which Playwright has made look asynchronous.
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as playwright:
            # executable_path means Playwright never looks for, or fetches, a
            # browser of its own.
            chromium = playwright.chromium.launch(
                executable_path=executable, headless=True, args=CHROMIUM_ARGS
            )
            yield chromium
            chromium.close()


@pytest.fixture
def page(browser):
    """Open a page in a fresh browser context: no cookies or storage from other tests."""
    context = browser.new_context()
    context.set_default_timeout(DEFAULT_TIMEOUT_MS)
    yield context.new_page()
    context.close()
