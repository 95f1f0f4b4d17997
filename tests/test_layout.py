"""The architecture, executable: durable's parts and the arrows allowed between them.

Every module of ``durable/`` is read with ``ast`` (imports inside functions count, as
they run just the same) and the layout rules are checked:

- no import cycle, except through the lazy imports Django or an optional dependency
  needs (``LAZY``, each with its reason; they must stay inside a function);
- no private name (``_x``) of one module used by another;
- no forbidden arrow between parts (``FORBIDDEN``): the store imports no engine, action,
  verb or console; the engine no console; the actions no engine; the policy nothing
  but the policy and the base;
- no module over ``MAX_LINES`` lines (``sql.py``, statement text only, excepted);
- no ``except ImportError`` around an import of durable's own modules;
- optional dependencies never imported at module level;
- one spelling per notion (``SPELLINGS``): unsettled actions, stuck jobs, the kind of a
  state, a duration as text;
- every module in exactly one part (``PARTS``), and every part's module present.

``KNOWN`` lists the violations still there, each with the change that removes it; the
test fails on a violation not in it and on an entry that no longer occurs, so the list
only shrinks. The last tests plant each kind of violation in a copy of the package and
check that its rule reports it.
"""

import ast
import collections
import functools
import pathlib
import shutil

import pytest

import durable

PACKAGE = pathlib.Path(durable.__file__).parent
MAX_LINES = 600
SIZE_EXCEPTED = {"durable.sql": "the statement text of both dialects, one named constant each"}

# Every module, by part. A module's part says what it may import (FORBIDDEN).
PARTS = {
    # The public API: ``import durable`` loads no models.
    "face": ["durable"],
    # What every part may import: settings, errors, Django signals, crash-drill points.
    "base": ["durable.conf", "durable.exceptions", "durable.signals", "durable.faults"],
    # Django's hooks into the app: the AppConfig and the system checks.
    "app": ["durable.apps", "durable.checks"],
    # Pure rules, no database: workflows and their tables, retry, identity, text forms.
    "policy": ["durable.workflows", "durable.states", "durable.retry", "durable.identity",
               "durable.formats", "durable.aio"],
    # The rows and every statement and lease write on them; the cost roll-ups.
    "store": ["durable.models", "durable.schedule_models", "durable.worker_models",
              "durable.approval_models", "durable.locking", "durable.sql",
              "durable.memos", "durable.wakeups", "durable.rollups", "durable.action_rows"],
    # Submitting a job: below all that submits (verbs, waits, schedules, tasks).
    "submit": ["durable.submission"],
    # What the worker and the dispatcher loops share: drains, waiter, connections.
    "process": ["durable.process", "durable.presence"],
    # The processes that claim and run jobs.
    "engine": ["durable.runner", "durable.worker", "durable.supervisor"],
    # Effects that leave the system: the outbox, its dispatcher, destinations, decisions.
    "actions": ["durable.outbox", "durable.dispatch", "durable.sender", "durable.slots", "durable.approvals",
                "durable.reconcile", "durable.destinations", "durable.reprepare"],
    # One implementation of every verb for code, console and CLI.
    "verbs": ["durable.services", "durable.purge", "durable.audit", "durable.answers"],
    # The operators' questions as plain data.
    "reads": ["durable.reports", "durable.scopes", "durable.failures", "durable.alerts",
              "durable.metrics"],
    # The admin, its pages and their template filters.
    "console": ["durable.admin", "durable.views", "durable.views.approvals", "durable.views.base",
                "durable.views.bulk", "durable.views.charts", "durable.views.costs",
                "durable.views.dashboard", "durable.views.jobs", "durable.views.reconcile",
                "durable.views.schedules", "durable.views.workers", "durable.views.answers",
                "durable.views.waits", "durable.templatetags",
                "durable.templatetags.durable_console"],
    "commands": ["durable.management", "durable.management.commands",
                 "durable.management.commands.durable", "durable.management.commands.runworkers"],
    # What a step sees (ctx) and its waits: signals, child jobs, the webhook that signals.
    "waits": ["durable.context", "durable.waits", "durable.inbox", "durable.children",
              "durable.hooks", "durable.hooks.urls", "durable.hooks.views"],
    "schedules": ["durable.cron", "durable.schedules"],
    # django.tasks: the backend and a job read back as a TaskResult.
    "integrations": ["durable.tasks", "durable.task_results"],
    "agents": ["durable.agents", "durable.agent_run", "durable.agent_actions", "durable.agent_outbox",
               "durable.agent_pages",
               "durable.llm", "durable.toolschema"],
    # For users' tests and the demo: the receiver, the fake model server, scripted models.
    "testing": ["durable.testing", "durable.receiver", "durable.testing_models", "durable.fake_openai",
                "durable.testing_blackhole"],
}

# The parts from the bottom up. An import cycle is blamed on its arrows that point up
# this list (or, within one part, on the import that is done lazily to get round it).
RANK = ["base", "policy", "store", "submit", "process", "waits", "verbs", "integrations",
        "schedules", "actions", "engine", "agents", "reads", "console", "commands", "app", "face",
        "testing"]

_ALL_PARTS = set(PARTS)
FORBIDDEN = {
    "base": _ALL_PARTS - {"base"},
    "policy": _ALL_PARTS - {"base", "policy"},
    "store": _ALL_PARTS - {"base", "policy", "store"},
    "submit": _ALL_PARTS - {"base", "policy", "store", "submit"},
    "process": _ALL_PARTS - {"base", "policy", "store", "process"},
    "engine": {"console", "commands", "face"},
    "actions": {"engine", "console", "commands", "face"},
    "verbs": {"engine", "console", "commands", "face"},
    "reads": {"engine", "console", "commands", "face", "verbs"},
}

# Imports that stay inside a function on purpose; they never count as closing a cycle.
LAZY = {
    ("durable", "durable.services"): "durable.submit: importing durable loads no models",
    ("durable", "durable.tasks"): "durable.enqueue: importing durable loads no models",
    ("durable", "durable.inbox"): "durable.signal: importing durable loads no models",
    ("durable.apps", "durable.checks"): "AppConfig.ready(): checks register once apps are loaded",
    ("durable.apps", "durable.tasks"): "AppConfig.ready(): the task workflow registers once apps are loaded",
    ("durable.tasks", "durable.models"): "Django imports durable.tasks while apps load (@task)",
    ("durable.tasks", "durable.submission"): "Django imports durable.tasks while apps load (@task)",
    ("durable.task_results", "durable.models"): "imported by durable.tasks while apps load",
}
# Optional dependencies: imported only where they are used, inside a function.
OPTIONAL = {
    "prometheus_client": "the metrics extra (durable.metrics)",
    "psycopg": "PostgreSQL only",
    "openai": "the openai extra (durable.llm, by importlib)",
    "anthropic": "the anthropic extra (durable.llm, by importlib)",
}

# One spelling per notion: where it is defined, and what another spelling looks like.
SPELLINGS = {
    "unsettled": ("durable.models", "a collection naming OutboxStatus.ATTEMPTED and UNKNOWN: use "
                  "models.UNSETTLED/IN_DOUBT or Outbox.objects.unsettled()/in_doubt()"),
    "stuck": ("durable.models", "a filter on lease_until__lt: use Job.objects.stuck(now=)"),
    "kind of a state": ("durable.workflows", "registry.get(w).table.kinds.get(s): use "
                        "registry.kind_of(w, s)"),
    "duration as text": ("durable.formats", "django.utils.timesince: use formats.age/duration"),
    "the states of a step": ("durable.states", "next(s for s in table.steps if s.step == name): use "
                             "table.states_for(name)"),
}

# Violations still present, each with the change that removes it. Only shrinks.
KNOWN = {
}


# Reading the package -------------------------------------------------------------------


Import = collections.namedtuple("Import", "source target names line lazy guarded")


def module_names(root):
    """``{dotted name: path}`` of every module of the package at ``root`` (migrations aside)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("").parts
        if "migrations" in rel:
            continue
        found[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return found


def _guards_import_error(node):
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError") for k in kinds):
            return True
    return False


def read_imports(root):
    """Every import of every module: (source, target module, names, line, lazy, guarded).

    Returns the modules, the imports and each module's syntax tree.
    """
    modules = module_names(root)
    imports, trees = [], {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"

        def visit(node, lazy, guarded, name=name, is_package=is_package):
            for child in ast.iter_child_nodes(node):
                inner_lazy = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                inner_guarded = guarded or (isinstance(child, ast.Try) and _guards_import_error(child))
                if isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = name.split(".") if is_package else name.split(".")[:-1]
                        base = base[: len(base) - (child.level - 1)]
                        target = ".".join(base + ([child.module] if child.module else []))
                    else:
                        target = child.module or ""
                    for alias in child.names:
                        sub = f"{target}.{alias.name}"
                        if sub in modules:
                            imports.append(Import(name, sub, (), child.lineno, lazy, inner_guarded))
                        else:
                            imports.append(Import(name, target, (alias.name,), child.lineno, lazy,
                                                  inner_guarded))
                elif isinstance(child, ast.Import):
                    for alias in child.names:
                        imports.append(Import(name, alias.name, (), child.lineno, lazy, inner_guarded))
                visit(child, inner_lazy, inner_guarded)

        trees[name] = ast.parse(path.read_text(), str(path))
        visit(trees[name], False, False)
    return modules, imports, trees


def _module_aliases(tree, name, is_package, modules):
    """Names bound to durable modules in ``tree`` (``from . import locking``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
    return aliases


# The rules: each returns {violation: detail} ------------------------------------------


def part_of(modules):
    return {module: part for part, names in PARTS.items() for module in names if module in modules}


def rule_parts(modules, imports, trees):
    found = {}
    placed = collections.Counter(m for names in PARTS.values() for m in names)
    for module in modules:
        if module not in placed:
            found[f"part: {module} is in no part"] = "add it to PARTS"
        elif placed[module] > 1:
            found[f"part: {module} is in {placed[module]} parts"] = "keep it in one"
    for module in placed:
        if module not in modules:
            found[f"part: {module} is in PARTS but not in the package"] = "remove it from PARTS"
    return found


def _internal_edges(modules, imports):
    edges = collections.defaultdict(dict)
    for imp in imports:
        if imp.target in modules and imp.target != imp.source and (imp.source, imp.target) not in LAZY:
            edges[imp.source].setdefault(imp.target, imp.lazy)
            edges[imp.source][imp.target] = edges[imp.source][imp.target] and imp.lazy
    return edges


def _path(edges, start, goal):
    """The shortest import path from ``start`` to ``goal`` (breadth first, by name)."""
    previous, queue = {start: None}, collections.deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = previous[node]
            return path[::-1]
        for nxt in sorted(edges.get(node, ())):
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return None


def rule_cycles(modules, imports, trees):
    """Each import that closes a cycle: one pointing up RANK, or within a part the lazy one."""
    edges = _internal_edges(modules, imports)
    parts = part_of(modules)
    rank = {m: RANK.index(p) if p in RANK else len(RANK) for m, p in parts.items()}
    found = {}
    for source in sorted(edges):
        for target in sorted(edges[source]):
            back = _path(edges, target, source)
            if back is None:
                continue
            cycle = [source, *back]
            if rank.get(source, -1) < rank.get(target, -1):
                blamed = True
            elif rank.get(source, -1) == rank.get(target, -1):
                steps = list(zip(cycle, cycle[1:], strict=False))
                blamed = edges[source][target] or not any(edges[a][b] for a, b in steps)
            else:
                blamed = False
            if blamed:
                found[f"cycle: {source} -> {target}"] = " -> ".join(cycle)
    return found


def rule_private(modules, imports, trees):
    found = {}
    for imp in imports:
        if imp.target in modules and imp.target != imp.source:
            for name in imp.names:
                if name.startswith("_") and not name.startswith("__"):
                    found[f"private: {imp.source} imports {imp.target}.{name}"] = f"line {imp.line}"
    for name, path in modules.items():
        tree = trees[name]
        aliases = _module_aliases(tree, name, path.name == "__init__.py", modules)
        for node in ast.walk(tree) if aliases else ():
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != name
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found[f"private: {name} uses {aliases[node.value.id]}.{node.attr}"] = f"line {node.lineno}"
    return found


def rule_arrows(modules, imports, trees):
    parts = part_of(modules)
    found = {}
    for imp in imports:
        src, dst = parts.get(imp.source), parts.get(imp.target)
        if src and dst and src != dst and dst in FORBIDDEN.get(src, ()):
            found[f"arrow: {src} -> {dst}: {imp.source} imports {imp.target}"] = f"line {imp.line}"
    return found


def rule_size(modules, imports, trees):
    found = {}
    for name, path in modules.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and name not in SIZE_EXCEPTED:
            found[f"size: {name} is over {MAX_LINES} lines"] = f"{lines} lines"
    return found


def rule_guards(modules, imports, trees):
    return {f"guard: {imp.source} guards its import of {imp.target} with except ImportError":
            f"line {imp.line}" for imp in imports if imp.guarded and imp.target in modules}


def rule_lazy(modules, imports, trees):
    found = {}
    for imp in imports:
        if (imp.source, imp.target) in LAZY and not imp.lazy:
            found[f"lazy: {imp.source} imports {imp.target} at module level"] = LAZY[imp.source, imp.target]
        root = imp.target.split(".")[0]
        if root in OPTIONAL and not imp.lazy:
            found[f"optional: {imp.source} imports {root} at module level"] = OPTIONAL[root]
    present = {(imp.source, imp.target) for imp in imports}
    for pair, reason in LAZY.items():
        if pair not in present:
            found[f"lazy: {pair[0]} no longer imports {pair[1]}"] = f"remove it from LAZY ({reason})"
    return found


def _spelled(node):
    """Which notion ``node`` spells (see SPELLINGS), or None."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        members = {e.attr for e in node.elts if isinstance(e, ast.Attribute)
                   and isinstance(e.value, ast.Name) and e.value.id == "OutboxStatus"}
        if {"ATTEMPTED", "UNKNOWN"} <= members:
            return "unsettled"
    if isinstance(node, ast.keyword) and node.arg == "lease_until__lt":
        return "stuck"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        kinds = node.func.value
        if isinstance(kinds, ast.Attribute) and kinds.attr == "kinds" and isinstance(kinds.value, ast.Attribute) \
                and kinds.value.attr == "table" and isinstance(kinds.value.value, ast.Call):
            lookup = kinds.value.value.func
            if isinstance(lookup, ast.Attribute) and lookup.attr == "get" and isinstance(lookup.value, ast.Name) \
                    and lookup.value.id == "registry":
                return "kind of a state"
    if isinstance(node, ast.ImportFrom) and node.module == "django.utils.timesince":
        return "duration as text"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next" \
            and node.args and isinstance(node.args[0], ast.GeneratorExp):
        loop = node.args[0].generators[0]
        if isinstance(loop.iter, ast.Attribute) and loop.iter.attr == "steps" and any(
                isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute)
                and test.left.attr == "step" for test in loop.ifs):
            return "the states of a step"
    return None


def rule_spellings(modules, imports, trees):
    found = {}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            notion = _spelled(node)
            if notion and SPELLINGS[notion][0] != name:
                found[f"spelling: {name} spells {notion} again"] = SPELLINGS[notion][1]
    return found


RULES = [rule_parts, rule_cycles, rule_private, rule_arrows, rule_size, rule_guards, rule_lazy,
         rule_spellings]


def violations(root=PACKAGE):
    """``{violation: detail}`` of every rule for the package at ``root``."""
    modules, imports, trees = read_imports(root)
    found = {}
    for rule in RULES:
        found.update(rule(modules, imports, trees))
    return found


@functools.cache
def violations_now():
    return violations()


# The package as it is ------------------------------------------------------------------


def test_the_package_keeps_its_layout():
    found = violations_now()
    new = {v: d for v, d in found.items() if v not in KNOWN}
    gone = [v for v in KNOWN if v not in found]
    assert not new, "layout violations:\n" + "\n".join(f"  {v}  ({d})" for v, d in sorted(new.items()))
    assert not gone, "no longer violated, remove from KNOWN:\n" + "\n".join(f"  {v}" for v in gone)


def test_every_forbidden_arrow_and_rank_names_parts_that_exist():
    for source, targets in FORBIDDEN.items():
        assert source in PARTS
        assert targets <= set(PARTS)
    assert sorted(RANK) == sorted(PARTS)


# Each rule reports what is planted in a copy of the package ------------------------------


@pytest.fixture
def copy(tmp_path):
    root = tmp_path / "durable"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns(
        "__pycache__", "migrations", "templates", "static"))
    return root


def _append(root, module, text):
    path = root / module
    path.write_text(path.read_text() + "\n\n" + text + "\n")


def _planted(root):
    before = set(violations_now())
    return {v: d for v, d in violations(root).items() if v not in before}


def test_a_planted_cycle_is_reported(copy):
    _append(copy, "states.py", "def planted():\n    from .workflows import registry\n    return registry")
    assert "cycle: durable.states -> durable.workflows" in _planted(copy)


def test_a_planted_private_import_is_reported(copy):
    _append(copy, "formats.py", "def planted():\n    from .identity import _sorted_json\n    return _sorted_json")
    _append(copy, "purge.py", "def planted():\n    return locking._seconds(1)")
    found = _planted(copy)
    assert "private: durable.formats imports durable.identity._sorted_json" in found
    assert "private: durable.purge uses durable.locking._seconds" in found


def test_a_planted_store_to_engine_arrow_is_reported(copy):
    _append(copy, "memos.py", "def planted():\n    from .worker import Worker\n    return Worker")
    assert "arrow: store -> engine: durable.memos imports durable.worker" in _planted(copy)


def test_a_planted_engine_to_console_arrow_is_reported(copy):
    _append(copy, "supervisor.py", "def planted():\n    from . import admin\n    return admin")
    assert "arrow: engine -> console: durable.supervisor imports durable.admin" in _planted(copy)


def test_a_planted_actions_to_engine_arrow_is_reported(copy):
    _append(copy, "destinations.py", "def planted():\n    from .runner import Runner\n    return Runner")
    assert "arrow: actions -> engine: durable.destinations imports durable.runner" in _planted(copy)


def test_a_planted_policy_to_store_arrow_is_reported(copy):
    _append(copy, "retry.py", "def planted():\n    from .models import Job\n    return Job")
    assert "arrow: policy -> store: durable.retry imports durable.models" in _planted(copy)


def test_a_planted_long_module_is_reported_except_sql(copy):
    _append(copy, "formats.py", "\n".join(f"# {n}" for n in range(MAX_LINES)))
    (copy / "sql.py").write_text("\n".join(f"# {n}" for n in range(MAX_LINES + 50)) + "\n")
    found = _planted(copy)
    assert "size: durable.formats is over 600 lines" in found
    assert not [v for v in found if v.startswith("size: durable.sql")]


def test_a_planted_import_error_guard_is_reported(copy):
    _append(copy, "formats.py", "try:\n    from . import identity\nexcept ImportError:\n    identity = None")
    assert ("guard: durable.formats guards its import of durable.identity with except ImportError"
            in _planted(copy))


def test_a_planted_module_in_no_part_is_reported(copy):
    (copy / "planted.py").write_text('"""A module nobody placed."""\n')
    assert "part: durable.planted is in no part" in _planted(copy)


def test_a_lazy_import_made_eager_or_an_optional_dependency_at_module_level_is_reported(copy):
    path = copy / "tasks.py"
    path.write_text("from .models import Job  # noqa\n" + path.read_text())
    _append(copy, "formats.py", "import prometheus_client")
    found = _planted(copy)
    assert "lazy: durable.tasks imports durable.models at module level" in found
    assert "optional: durable.formats imports prometheus_client at module level" in found


def test_a_planted_second_spelling_is_reported(copy):
    _append(copy, "purge.py", "\n".join([
        "def planted(Job, OutboxStatus, registry):",
        "    from django.utils.timesince import timesince",
        "    stuck = Job.objects.filter(lease_until__lt=1)",
        "    open_ = (OutboxStatus.PENDING, OutboxStatus.ATTEMPTED, OutboxStatus.UNKNOWN)",
        "    states = next(s for s in registry.get('w').table.steps if s.step == 'x')",
        "    return timesince, stuck, open_, registry.get('w').table.kinds.get('s'), states",
    ]))
    found = _planted(copy)
    for notion in SPELLINGS:
        assert f"spelling: durable.purge spells {notion} again" in found
