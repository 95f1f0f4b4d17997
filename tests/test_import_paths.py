"""Every import path the README and the docs name still imports, and names what they say.

The code moved into packages (``durable.core``, ``durable.store``, ...); the paths users
write kept working through faces of a few lines (``tests/test_layout.py`` holds them to
re-exporting). This reads every ``from durable… import …`` line and every backquoted
``durable.x.y`` of the README and ``docs/``, and resolves each one.
"""

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The paths the design names as documented, whatever the texts say today.
DOCUMENTED = [
    "durable.tasks.DurableBackend", "durable.tasks.default_backoff", "durable.tasks.full_jitter",
    "durable.tasks.idempotency_key", "durable.tasks.TaskArgumentsInvalid",
    "durable.testing.Receiver", "durable.testing.ReceiverProcess", "durable.testing.FakeModelServer",
    "durable.testing.ScriptedModel", "durable.testing.Blackhole", "durable.testing.reply",
    "durable.testing.tool_call", "durable.testing.read_store",
    "durable.llm.OpenAIChat", "durable.llm.AnthropicMessages", "durable.llm.ModelReply",
    "durable.agents.AgentWorkflow", "durable.agents.tool", "durable.agents.ToolError",
    "durable.hooks.urls", "durable.metrics.metrics_view",
    "durable.destinations.Destination", "durable.destinations.HttpDestination", "durable.destinations.register",
    "durable.admin.install_console", "durable.approvals.approve", "durable.approvals.reject",
    "durable.agent_actions.grant", "durable.toolschema.schema_for", "durable.cron.tick_of",
    "durable.services.submit", "durable.models.Job", "durable.models.Approval",
]

# Backquoted names that are not import paths: system check ids, permissions, loggers.
NOT_PATHS = re.compile(r"^durable\.([EW]\d+$|view_|change_|add_|delete_|approve_|reconcile_|requeue_|retry_|"
                       r"cancel_|send_|replay_|grant_|pause_|run_schedule$|runworkers$|dispatch$|worker$|"
                       r"supervisor$|schedules$)")


def _statements():
    """``from durable… import …`` statements in the texts' code blocks, as (text, line, module, names)."""
    found = []
    for path in TEXTS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = re.match(r"\s*(from durable[\w.]* import .+)$", line)
            if not match or line.rstrip().endswith(("(", "\\")):
                continue
            node = ast.parse(match.group(1).split("#")[0].strip()).body[0]
            found.append((path.name, number, node.module, [a.name for a in node.names]))
    return found


def _dotted():
    """Backquoted ``durable.x.y`` names in the texts, as (text, line, name)."""
    found = []
    for path in TEXTS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"`(durable(?:\.[A-Za-z_]\w*)+)`", line):
                if not NOT_PATHS.match(name):
                    found.append((path.name, number, name))
    return found


def resolve(dotted):
    """Import the longest module prefix of ``dotted`` and get the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr)
        return value
    raise ModuleNotFoundError(dotted)


def test_the_texts_name_import_paths_to_check():
    assert len(_statements()) > 20
    assert len(_dotted()) > 20


@pytest.mark.parametrize("where, line, module, names", _statements(),
                         ids=[f"{t}:{n}" for t, n, _, _ in _statements()])
def test_every_import_the_texts_show_imports(where, line, module, names):
    imported = importlib.import_module(module)
    for name in names:
        assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), (
            f"{where}:{line}: {module} has no {name}")


@pytest.mark.parametrize("where, line, name", _dotted(), ids=[f"{t}:{n}:{d}" for t, n, d in _dotted()])
def test_every_dotted_name_the_texts_show_resolves(where, line, name):
    resolve(name)


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_documented_path_resolves(name):
    resolve(name)


def test_a_name_that_does_not_exist_does_not_resolve():
    with pytest.raises((ModuleNotFoundError, AttributeError)):
        resolve("durable.approvals.no_such_verb")
    with pytest.raises((ModuleNotFoundError, AttributeError)):
        resolve("durable.locking.transition")  # an internal path that moved: no shim


def test_a_destination_setting_naming_the_class_path_of_an_earlier_release_still_builds(settings):
    from durable.actions.destinations import HttpDestination, Registry

    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "DESTINATIONS": {
        "old": {"CLASS": "durable.dispatch.HttpDestination", "URL": "http://127.0.0.1:9/"},
        "new": {"CLASS": "durable.destinations.HttpDestination", "URL": "http://127.0.0.1:9/"},
    }}
    registry = Registry()
    assert type(registry.get("old")) is HttpDestination
    assert type(registry.get("new")) is HttpDestination


def test_the_testing_helpers_and_model_adapters_import_without_django_settings(tmp_path):
    """A receiver or a fake model server runs in a process of its own, with no settings."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    code = ("import durable.testing, durable.llm, durable.agents.llm, durable.engine.supervisor; "
            "from durable.testing import FakeModelServer, Receiver, ScriptedModel; print('imported')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "imported", done.stderr[-2000:]
