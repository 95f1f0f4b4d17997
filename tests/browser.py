"""Pytest plugin: a real headless Chromium, driven by Playwright's sync API.

Fixtures: ``browser`` (one per session) and ``page`` (a fresh context per test).
Tests that use them are marked ``browser`` (added automatically if forgotten), so
``-m "not browser"`` leaves them out.

The browser is the system's Chromium (Debian package ``chromium``), never one
downloaded by Playwright: the tests must run offline and on the browser the
machine actually has. If it is missing, it is installed with apt-get when
possible, once: pytest-xdist's processes take turns under a file lock, so the
first installs and the others find it installed (apt-get also waits for a dpkg
lock held by anything else). Otherwise browser tests are skipped, except on CI
(``CI=true``) where a missing browser is a failure, not a reason to go green.
"""

import os
import shutil
import subprocess
import tempfile

import pytest

CHROMIUM = "/usr/bin/chromium"

# Held while one test process checks for and installs Chromium.
INSTALL_LOCK = os.path.join(tempfile.gettempdir(), "durable-chromium-install.lock")

# apt-get waits this long for the dpkg lock instead of failing at once.
DPKG_LOCK_WAIT = 600

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


def _apt_get(*args):
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        ["apt-get", "-o", f"DPkg::Lock::Timeout={DPKG_LOCK_WAIT}", *args], env=env,
        capture_output=True, text=True, timeout=DPKG_LOCK_WAIT + 900, check=False
    )


def _install_chromium():
    """Install Debian's chromium package; return None, or why it could not be done."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "installing it needs root"
    import fcntl  # apt-get means a Unix

    with open(INSTALL_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.access(CHROMIUM, os.X_OK):
                return None  # another test process installed it while this one waited
            return _apt_install_chromium()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _apt_install_chromium():
    result = _apt_get("install", "-y", "chromium")
    if result.returncode != 0:
        # A fresh container has no package lists yet; refresh them once and retry.
        _apt_get("update")
        result = _apt_get("install", "-y", "chromium")
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        return "apt-get install chromium failed: " + " / ".join(tail)
    return None


def chromium_executable():
    """Return the path of the system Chromium, installing it if needed and possible."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    problem = _install_chromium()
    if problem is None and os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    _give_up(
        f"Chromium is not installed at {CHROMIUM} and could not be installed "
        f"({problem or 'the package did not provide it'}). "
        "Install it with: apt-get install chromium"
    )


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
