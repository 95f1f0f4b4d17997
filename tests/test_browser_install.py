"""Installing Chromium for the browser tests: once, however many test processes ask at once.

A fake ``apt-get`` on PATH behaves like the real one under contention: a second
install while one runs fails on the dpkg lock. No browser is needed or installed.
"""

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

FAKE_APT_GET = r"""#!/bin/sh
# Like apt-get: one dpkg at a time; "install chromium" provides $FAKE_CHROMIUM.
while [ "$1" = "-o" ]; do shift 2; done
echo "$*" >> "$FAKE_APT_LOG"
case "$1" in
    update) exit 0 ;;
esac
if [ "$FAKE_APT_BROKEN" = 1 ]; then
    echo "E: Unable to locate package chromium" >&2
    exit 100
fi
if ! mkdir "$FAKE_APT_LOG.dpkg-lock" 2>/dev/null; then
    echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 1 (apt-get)" >&2
    exit 100
fi
sleep 2
printf '#!/bin/sh\n' > "$FAKE_CHROMIUM"
chmod +x "$FAKE_CHROMIUM"
rmdir "$FAKE_APT_LOG.dpkg-lock"
"""

# One pytest process asking for the browser: what chromium_executable() did.
ASK = textwrap.dedent("""
    import os, sys
    import pytest
    from tests import browser

    browser.CHROMIUM = os.environ["FAKE_CHROMIUM"]
    browser.INSTALL_LOCK = os.environ["FAKE_APT_LOG"] + ".install-lock"
    os.geteuid = lambda: 0  # installing is tried as root only
    try:
        print("ok", browser.chromium_executable())
    except pytest.skip.Exception as exc:
        print("skipped", exc)
    except pytest.fail.Exception as exc:
        print("failed", exc)
""")


def ask_at_once(tmp_path, n, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "apt-get").write_text(FAKE_APT_GET)
    (bin_dir / "apt-get").chmod(0o755)
    environ = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT),
        "FAKE_CHROMIUM": str(tmp_path / "chromium"), "FAKE_APT_LOG": str(tmp_path / "apt.log"),
        "CI": "false", **env,
    }
    procs = [subprocess.Popen([sys.executable, "-c", ASK], cwd=ROOT, env=environ,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    outcomes = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outcomes.append(out.strip())
    log = tmp_path / "apt.log"
    return outcomes, log.read_text().splitlines() if log.exists() else []


def test_four_test_processes_asking_at_once_install_chromium_once_and_all_get_it(tmp_path):
    outcomes, apt_calls = ask_at_once(tmp_path, 4)

    assert outcomes == [f"ok {tmp_path / 'chromium'}"] * 4
    assert apt_calls == ["install -y chromium"]


def test_a_browser_that_cannot_be_installed_skips_locally_and_fails_on_ci(tmp_path):
    local, _ = ask_at_once(tmp_path / "local", 1, FAKE_APT_BROKEN="1")
    ci, _ = ask_at_once(tmp_path / "ci", 1, FAKE_APT_BROKEN="1", CI="true")

    assert local[0].startswith("skipped Chromium is not installed")
    assert "Unable to locate package chromium" in local[0]
    assert ci[0].startswith("failed Chromium is not installed") and "CI=true" in ci[0]
