"""The system packages some tests need: ``scripts/system.sh`` installs them, the tests say so.

A fake ``apt-get`` on PATH stands for Debian's, and the script looks for the tools
under a directory of the test's own (``DURABLE_SYSTEM_PREFIX``): nothing is installed
on, or removed from, the machine. The last tests check what a test that needs a
missing tool reports: a skip saying how to get it, or a failure with ``CI=true``.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests import browser, pgbouncer
from tests.conftest import ROOT
from tests.drills.drills import faketime_library

SCRIPT = ROOT / "scripts" / "system.sh"

FAKE_APT_GET = r"""#!/bin/sh
# Like apt-get: "install" provides the packages under $DURABLE_SYSTEM_PREFIX, once the
# package lists exist ("update"), or at once with FAKE_APT_LISTS=1.
while [ "$1" = "-o" ] || [ "$1" = "-q" ] || [ "$1" = "-y" ]; do
    [ "$1" = "-o" ] && shift; shift
done
echo "$*" >> "$FAKE_APT_LOG"
echo "Reading package lists... (apt-get's chatter)"
case "$1" in
    update) [ "$FAKE_APT_BROKEN" = 1 ] || touch "$FAKE_APT_LOG.lists"; exit 0 ;;
esac
if [ "$FAKE_APT_LISTS" != 1 ] && [ ! -e "$FAKE_APT_LOG.lists" ]; then
    echo "E: Unable to locate package $2" >&2
    exit 100
fi
shift
for package do
    case $package in
        chromium) mkdir -p "$DURABLE_SYSTEM_PREFIX/usr/bin"
                  printf '#!/bin/sh\n' > "$DURABLE_SYSTEM_PREFIX/usr/bin/chromium"
                  chmod +x "$DURABLE_SYSTEM_PREFIX/usr/bin/chromium" ;;
        faketime) mkdir -p "$DURABLE_SYSTEM_PREFIX/usr/lib/x86_64-linux-gnu/faketime"
                  touch "$DURABLE_SYSTEM_PREFIX/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1" ;;
        pgbouncer) mkdir -p "$DURABLE_SYSTEM_PREFIX/usr/sbin"
                   printf '#!/bin/sh\n' > "$DURABLE_SYSTEM_PREFIX/usr/sbin/pgbouncer"
                   chmod +x "$DURABLE_SYSTEM_PREFIX/usr/sbin/pgbouncer" ;;
    esac
done
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="installing is tried as root only")


def system_sh(tmp_path, *args, **env):
    """Run scripts/system.sh against a fake apt-get and an empty system; (status, out, apt calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "apt-get").write_text(FAKE_APT_GET)
    (bin_dir / "apt-get").chmod(0o755)
    log = tmp_path / "apt.log"
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_APT_LOG": str(log),
               "DURABLE_SYSTEM_PREFIX": str(tmp_path / "root"), **env}
    done = subprocess.run(["sh", str(SCRIPT), *args], env=environ, capture_output=True,
                          text=True, timeout=60, check=False)
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, done.stdout + done.stderr, calls


def test_the_check_sees_the_tools_where_the_tests_look_for_them():
    done = subprocess.run(["sh", str(SCRIPT), "--check"], capture_output=True, text=True,
                          timeout=60, check=False)
    have_chromium = os.access(browser.CHROMIUM, os.X_OK)
    have_faketime = faketime_library() is not None
    have_pgbouncer = os.access(pgbouncer.BINARY, os.X_OK)
    assert f"chromium: {'installed' if have_chromium else 'missing'}" in done.stdout
    assert f"faketime: {'installed' if have_faketime else 'missing'}" in done.stdout
    assert f"pgbouncer: {'installed' if have_pgbouncer else 'missing'}" in done.stdout
    assert done.returncode == (0 if have_chromium and have_faketime and have_pgbouncer else 1)


def test_the_check_installs_nothing_and_says_how_to_get_what_is_missing(tmp_path):
    status, out, calls = system_sh(tmp_path, "--check")
    assert status == 1 and calls == []
    assert "chromium: missing" in out and "faketime: missing" in out and "pgbouncer: missing" in out
    assert "sh scripts/system.sh (as root), or: apt-get install -y chromium faketime pgbouncer" in out


@needs_root
def test_missing_tools_are_installed_in_one_quiet_apt_get_without_an_update(tmp_path):
    status, out, calls = system_sh(tmp_path, FAKE_APT_LISTS="1")
    assert status == 0, out
    assert calls == ["install chromium faketime pgbouncer"]
    assert "chromium: installed" in out and "faketime: installed" in out and "pgbouncer: installed" in out
    assert "chatter" not in out  # apt-get's output is kept out of the test run's
    status, out, calls = system_sh(tmp_path)  # a second run finds them all
    assert status == 0 and calls == ["install chromium faketime pgbouncer"]


@needs_root
def test_a_fresh_machine_without_package_lists_gets_them_once(tmp_path):
    status, out, calls = system_sh(tmp_path, "faketime")
    assert status == 0, out
    assert calls == ["install faketime", "update", "install faketime"]
    assert "chromium" not in out  # only the tool asked for


@needs_root
def test_an_install_that_fails_says_why_and_how_and_exits_non_zero(tmp_path):
    status, out, calls = system_sh(tmp_path, FAKE_APT_BROKEN="1")
    assert status == 1
    assert calls == ["install chromium faketime pgbouncer", "update", "install chromium faketime pgbouncer"]
    assert "Could not install chromium faketime pgbouncer: apt-get failed" in out
    assert "Unable to locate package chromium" in out  # apt-get's own last lines
    assert "apt-get install -y chromium faketime pgbouncer" in out


def test_an_unknown_tool_is_refused_naming_the_known_ones(tmp_path):
    status, out, calls = system_sh(tmp_path, "chrome")
    assert status == 2 and calls == []
    assert "unknown tool 'chrome' (known: chromium faketime pgbouncer)" in out


# What a test that needs a missing tool reports.
ASK = textwrap.dedent("""
    import os
    import pytest
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    from tests import browser, conftest, pgbouncer

    browser.CHROMIUM = "/nonexistent/chromium"
    pgbouncer.BINARY = "/nonexistent/pgbouncer"
    for name, ask in [("chromium", browser.chromium_executable),
                      ("faketime", lambda: conftest.missing_tool("libfaketime", "faketime")),
                      ("pgbouncer", pgbouncer.installed_binary)]:
        try:
            print(name, "ok", ask())
        except pytest.skip.Exception as exc:
            print(name, "skipped", exc)
        except pytest.fail.Exception as exc:
            print(name, "failed", exc)
""")


def ask(ci):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CI": ci}
    done = subprocess.run([sys.executable, "-c", ASK], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())


def test_a_missing_tool_skips_its_tests_saying_how_to_get_it_and_fails_them_on_ci():
    local, ci = ask("false"), ask("true")
    assert local["chromium"] == ("skipped Chromium is not installed at /nonexistent/chromium: run"
                                 " `sh scripts/system.sh` as root, or `apt-get install chromium`")
    assert local["faketime"] == ("skipped libfaketime is not installed: run `sh scripts/system.sh`"
                                 " as root, or `apt-get install faketime`")
    assert local["pgbouncer"] == ("skipped PgBouncer (/nonexistent/pgbouncer) is not installed: run"
                                  " `sh scripts/system.sh` as root, or `apt-get install pgbouncer`")
    for name in ("chromium", "faketime", "pgbouncer"):
        assert ci[name].startswith("failed ") and "CI=true" in ci[name]
        assert "sh scripts/system.sh" in ci[name]
