"""The README, followed by a new user: a brand-new Django site built from its own text.

A wheel is built from this checkout and installed into a fresh virtualenv (its
dependencies come from the test environment, so nothing is downloaded). Then, in a
temporary directory: ``startproject`` and ``startapp``, and every README block marked
``<!-- readme-site: TARGET -->`` goes where it says: ``settings.py`` and ``urls.py``
blocks are appended to the site's, ``myapp/...`` blocks make the app's modules,
``fake_model.py`` is the model server the README runs as a process of its own,
``shell NAME`` blocks run in ``manage.py shell``, and ``output of COMMAND`` blocks are
compared with what ``manage.py COMMAND`` prints. Besides adding the new app to
``INSTALLED_APPS``, the only edits are addresses: the README's fixed ports become free
ones, and its example document URL one served here.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from durable.testing import ReceiverProcess

from .conftest import ON_POSTGRES
from .test_docs import SITE, comments_above

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```(?P<lang>\w*)[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
DISTRIBUTION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
# A burst drains a few jobs: far longer than this is a burst that does not end.
BURST_SECONDS = 60
PAGE = b"<html><body><h1>Example Domain</h1><p>A page for use in examples.</p></body></html>"


# The commands whose output the README prints; each is compared with the site's own.
GRAPHS = ("durable graph research", "durable graph support-agent")
# Every target a README block may name, besides files of the site's app (myapp/...).
TARGETS = {"settings.py", "urls.py", "fake_model.py", "shell submit", "shell result",
           "shell agent-submit", "shell approve", "shell task", "shell task-result",
           *(f"output of {command}" for command in GRAPHS)}


def site_blocks():
    """``{target: [code, ...]}`` of the README's marked blocks, in the README's order."""
    text = README.read_text(encoding="utf-8")
    found = {}
    for match in FENCE.finditer(text):
        for note in comments_above(text, match.start()):
            if marker := SITE.fullmatch(note):
                found.setdefault(marker["target"], []).append(match["code"])
    return found


def clean_env():
    """This environment without the test run's Django, durable and Python settings."""
    return {key: value for key, value in os.environ.items()
            if not key.startswith(("DJANGO_", "DURABLE_", "OPENAI_", "PYTHON"))}


def run(args, **kwargs):
    """Run a command; fail with its output when it fails."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="session")
def fresh_python(tmp_path_factory):
    """A new virtualenv's python, with durable installed from a wheel built from this checkout."""
    base = tmp_path_factory.mktemp("readme-install")
    # Built from a copy, so the build leaves nothing in the checkout.
    src = base / "src"
    shutil.copytree(ROOT / "durable", src / "durable", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--disable-pip-version-check",
         "-w", base / "dist", src])
    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    # The dependencies are the test environment's: its site-packages is on the new
    # environment's path, after its own (a path line; its .pth files are not run, so
    # the checkout's editable install stays out).
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (purelib / "test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--disable-pip-version-check",
         "--no-index", "--no-deps", "--ignore-installed", "--find-links", base / "dist", DISTRIBUTION])
    where = run([python, "-c", "import durable; print(durable.__file__)"], cwd=base, env=clean_env())
    assert where.startswith(str(purelib)), f"durable is imported from {where}, not from the wheel"
    return python


@pytest.fixture
def document_server():
    """The page the research workflow fetches (the README's example.org, served here)."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(PAGE)))
            self.end_headers()
            self.wfile.write(PAGE)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/a"
    server.shutdown()
    server.server_close()


@pytest.fixture
def fake_model(tmp_path, fresh_python):
    """The README's fake_model.py, run as a process of its own as the README says."""
    (code,) = site_blocks()["fake_model.py"]
    assert "port=8001" in code
    script = tmp_path / "fake_model.py"
    script.write_text(code.replace("port=8001", "port=0"))
    process = subprocess.Popen([fresh_python, script], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                               env=clean_env())
    try:
        line = process.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/v1", line)
        assert url, f"fake_model.py printed {line!r}"
        yield url[0]
    finally:
        process.terminate()
        process.wait(10)
        process.stdout.close()


@pytest.fixture
def payments(tmp_path, fresh_python):
    """The README's ``python -m durable.testing`` receiver, from the installed wheel."""
    with ReceiverProcess(tmp_path / "payments.jsonl", python=fresh_python) as receiver:
        yield receiver


class Site:
    """A new Django site made with ``startproject``, with the README's blocks in it."""

    def __init__(self, root, python, env):
        self.root, self.python, self.env = root, python, env

    def manage(self, *args, env=None):
        return run([self.python, "manage.py", *args], cwd=self.root, env={**self.env, **(env or {})})

    def burst(self, env):
        """``runworkers --burst``, in a process group of its own: a burst that never ends is killed whole."""
        command = [self.python, "manage.py", "runworkers", "--burst"]
        process = subprocess.Popen(command, cwd=self.root, env={**self.env, **env}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            printed, _ = process.communicate(timeout=BURST_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            printed, _ = process.communicate()
            pytest.fail(f"runworkers --burst still ran after {BURST_SECONDS} s:\n{printed}")
        assert process.returncode == 0, f"runworkers --burst exited {process.returncode}:\n{printed}"
        return printed

    def shell(self, *code, env=None):
        """Run code in ``manage.py shell`` (one start-up); return what it printed and the site's state.

        The state is every job's workflow, state, result and last error, the approvals,
        and what the commands run by a ``COMMANDS`` block printed.
        """
        code = "\n".join(code) + "\n" + STATE
        printed = self.manage("shell", "--no-startup", "--verbosity", "0", "-c", code, env=env)
        *lines, last = printed.rstrip("\n").split("\n")
        return "\n".join(lines), json.loads(last)


# Printed last by every shell: what the test checks.
STATE = """
import json as _json
from durable.models import Approval as _Approval, Job as _Job
print(_json.dumps({
    "jobs": {j.pk: [j.workflow, j.state, j.result, j.last_error] for j in _Job.objects.all()},
    "approvals": list(_Approval.objects.values_list("job_id", "status")),
    "outputs": globals().get("outputs", {}),
}, default=str))
"""

# Runs a manage.py command and keeps what it printed, as ``outputs[command]``.
COMMANDS = """
import io
from django.core.management import call_command

outputs = {}
for command in %r:
    printed = io.StringIO()
    call_command(*command.split(), stdout=printed)
    outputs[command] = printed.getvalue()
"""


@pytest.fixture
def site(tmp_path, fresh_python, payments):
    blocks = site_blocks()
    root = tmp_path / "site"
    root.mkdir()
    env = clean_env()
    env.update(PATH=f"{fresh_python.parent}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    run([fresh_python, "-m", "django", "startproject", "mysite", root], env=env)
    run([fresh_python, "manage.py", "startapp", "myapp"], cwd=root, env=env)

    def add(path, blocks):
        with open(path, "a", encoding="utf-8") as file:
            file.write("\n\n" + "\n\n".join(blocks))

    settings = "\n\n".join(blocks["settings.py"]).replace("http://127.0.0.1:8002", payments.url)
    add(root / "mysite" / "settings.py", ['INSTALLED_APPS += ["myapp"]  # the new site\'s own app', settings])
    add(root / "mysite" / "urls.py", blocks["urls.py"])
    for target, code in blocks.items():
        if target.startswith("myapp/"):
            add(root / target, code)
    return Site(root, fresh_python, env)


def same_lines(text):
    return [line.rstrip() for line in text.strip().splitlines()]


@pytest.mark.readme
@pytest.mark.skipif(ON_POSTGRES, reason="the README's site runs on its own SQLite database: the SQLite leg runs it")
def test_a_new_site_built_from_the_readme_runs_every_sample(site, fake_model, payments, document_server):
    blocks = site_blocks()
    workers = {"OPENAI_BASE_URL": fake_model, "OPENAI_API_KEY": "unused"}
    site.manage("migrate", "--verbosity", "0")

    # Submit a document, a support ticket and a task, and run a schedule now; the site
    # has no system check warnings, and the tables the README prints are the examples'.
    (submit,) = blocks["shell submit"]
    assert "https://example.org/a" in submit
    graphs = GRAPHS
    _, state = site.shell(
        submit.replace("https://example.org/a", document_server), *blocks["shell agent-submit"],
        *blocks["shell task"],
        COMMANDS % (("check --fail-level WARNING", *graphs, "durable schedules run heartbeat --reason try"),),
    )
    for command in graphs:
        (printed,) = blocks[f"output of {command}"]
        assert same_lines(state["outputs"][command]) == same_lines(printed), command
    assert state["outputs"]["durable schedules run heartbeat --reason try"].startswith("heartbeat: submitted")

    site.burst(workers)

    printed, state = site.shell(*blocks["shell result"], "print('--')", *blocks["shell task-result"])
    result, task_result = printed.split("\n--\n")
    assert result.splitlines()[0] == "verified {'ok': True}", printed
    assert task_result == "SUCCESSFUL {'sent_to': 42}", printed
    assert state["jobs"]["doc-123"][1:3] == ["verified", {"ok": True}]
    pings = [key for key, job in state["jobs"].items() if job[2] == {"pinged": "ops"}]
    assert len(pings) == 1 and pings[0].startswith("schedule:heartbeat:"), state
    assert state["jobs"]["ticket-1"][1] == "awaiting_approval", state
    assert payments.actions == []

    printed, _ = site.shell(*blocks["shell approve"])
    assert "A-1" in printed and "250" in printed, printed
    site.burst(workers)

    # The metrics view is where the README mounts it, behind the README's token; the
    # console's pages and static files came with the wheel.
    printed, state = site.shell(
        "from django.contrib.auth import get_user_model",
        "from django.contrib.staticfiles import finders",
        "from django.test import Client",
        "reply = Client().get('/metrics', HTTP_HOST='localhost', HTTP_AUTHORIZATION='Bearer s3cret')",
        "print(reply.status_code, b'durable_jobs' in reply.content)",
        "operator = Client()",
        "operator.force_login(get_user_model().objects.create_superuser('ada', 'ada@example.org', 'unused'))",
        "page = operator.get('/admin/durable/dashboard/', HTTP_HOST='localhost')",
        "print(page.status_code, b'ticket-1' in page.content or b'support-agent' in page.content,"
        " bool(finders.find('durable/console.css')))",
        env={"DURABLE_METRICS_TOKEN": "s3cret"},
    )
    assert printed == "200 True\n200 True True", printed
    assert state["jobs"]["ticket-1"][1:3] == ["done", {"answer": "I have refunded EUR 250 for order A-1."}], state
    assert state["approvals"] == [["ticket-1", "approved"]]
    assert [action["body"] for action in payments.actions] == [{"order": "A-1", "amount": 250}]


def test_every_install_hint_names_this_distribution_and_one_of_its_extras():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    files = [README, *(ROOT / "docs").glob("*.md"), *(ROOT / "durable").rglob("*.py"),
             *(ROOT / "durable" / "templates").rglob("*.html")]
    # Every mention but the README's one of the unrelated project that has the short name.
    mention = re.compile(r"django-durable[\w-]*(?:\[(?P<extras>[\w,]+)\])?(?!` on PyPI is an unrelated)")
    hints = [(path.relative_to(ROOT), hint) for path in files for hint in mention.finditer(path.read_text())]
    assert len(hints) > 5
    for path, hint in hints:
        assert hint[0].split("[")[0] == DISTRIBUTION, f"{path}: {hint[0]} is not {DISTRIBUTION}"
        assert set((hint["extras"] or "").split(",")) - {""} <= extras, f"{path}: {hint[0]} names an unknown extra"


def test_the_configuration_table_lists_every_setting_and_the_docs_name_no_other():
    from durable.conf import DEFAULTS

    text = README.read_text()
    table = text[text.index("\n## Configuration\n"):]
    table = table[:table.index("\n## ", 1)]
    listed = {key for row in table.splitlines() if row.startswith("| `")
              for key in re.findall(r"`([A-Z_]+)`", row.split(" | ")[0])}
    assert set(DEFAULTS) - {"FAULT_POINT"} <= listed, "settings missing from the Configuration table"
    assert listed <= set(DEFAULTS)
    docs = "\n".join(path.read_text() for path in [README, *(ROOT / "docs").glob("*.md")])
    named = set(re.findall(r"DURABLE\[[\"']([A-Z_]+)[\"']\]", docs))
    assert named and named <= set(DEFAULTS), f"unknown settings: {named - set(DEFAULTS)}"


def test_the_readme_makes_one_durable_dict_and_later_samples_add_to_it():
    code = "\n".join(match["code"] for match in FENCE.finditer(README.read_text()) if match["lang"] == "python")
    assert len(re.findall(r"^DURABLE = ", code, re.M)) == 1
    assert len(re.findall(r"^DURABLE\[", code, re.M)) >= 5


def test_an_unknown_destination_says_where_destinations_are_named(settings):
    from durable.actions import destinations
    from durable.exceptions import UnknownDestination

    settings.DURABLE = {**settings.DURABLE, "DESTINATIONS": {"crm": {"URL": "http://127.0.0.1:9"}}}
    with pytest.raises(UnknownDestination) as raised:
        destinations.get("payments")
    assert "'payments' (known: crm" in str(raised.value)
    assert 'DURABLE["DESTINATIONS"]' in str(raised.value)


def test_every_block_marked_for_the_site_is_used_by_it():
    """A block whose marker names no target the site reads would be run by no test."""
    unused = [target for target in site_blocks()
              if target not in TARGETS and not target.startswith("myapp/")]
    assert not unused, f"README blocks marked for the site that it does not read: {unused}"
