"""The architecture, executable: durable's parts are its folders, and the arrows allowed between them.

A module's part is the folder it is in (``durable/store/locking.py`` is in ``store``); the
few modules at the package root are named in ``ROOT``. Every module is read with ``ast``
(imports inside functions count, as they run just the same) and the rules are checked:

- a part imports only the parts below it in ``RANK``, so no two parts import each other;
  an import pointing up is reported, except the lazy imports Django or an optional
  dependency needs (``LAZY``, each with its reason; they must stay inside a function);
- the arrows the design names as never (``NEVER``) are reported by name, whatever ``RANK`` says;
- no import cycle between modules of one part (the lazy import is blamed);
- a face (a documented import path whose code moved, ``FACES``) only re-exports its module;
- no private name (``_x``) of one module used by another;
- no module over ``MAX_LINES`` lines;
- no ``except ImportError`` around an import of durable's own modules;
- optional dependencies never imported at module level;
- one spelling per notion (``SPELLINGS``): unsettled actions, stuck jobs, the kind of a
  state, a duration as text, the states of a step, and "is this an agent?";
- no database vendor test (``vendor ==``) outside the store.

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

# The modules at the package root, by part: Django's fixed places and what every part shares.
ROOT = {
    # The public API: ``import durable`` loads no models.
    "durable": "face",
    # What every part may import: settings, errors, Django signals, crash-drill points.
    "durable.conf": "base", "durable.exceptions": "base", "durable.signals": "base",
    "durable.faults": "base",
    # Django's hooks into the app: the AppConfig and the system checks.
    "durable.apps": "app", "durable.checks": "app",
    # The admin is the console's front door (``install_console``).
    "durable.admin": "views",
}

# Documented import paths whose code moved: each re-exports one module, nothing more.
FACES = {
    "durable.agent_actions": "durable.agents.tools",
    "durable.approvals": "durable.actions.approvals",
    "durable.cron": "durable.schedules.cron",
    "durable.destinations": "durable.actions.destinations",
    "durable.llm": "durable.agents.llm",
    "durable.metrics": "durable.reads.metrics",
    "durable.services": "durable.verbs.jobs",
    "durable.toolschema": "durable.agents.toolschema",
}

# The parts from the bottom up; a part imports only parts before it.
RANK = [
    "base",          # settings, errors, signals, fault points
    "core",          # pure rules: workflows, states, retry, identity, formats, outcomes
    "models",        # the rows (Django's models package)
    "store",         # every write on the rows, each a named move; the statements per database
    "steps",         # what a running step sees: ctx, signals, child jobs, waits
    "tasks",         # django.tasks: the backend, a job read back as a TaskResult
    "actions",       # effects that leave the system: outbox, kinds, approvals, destinations
    "schedules",     # declared schedules and their firing
    "verbs",         # operator verbs for code, console and CLI
    "engine",        # the processes: supervisor, worker, runner, dispatcher
    "agents",        # agent workflows: the run, its tools, the model adapters
    "reads",         # the operators' questions as data
    "hooks",         # the signal webhook
    "templatetags",  # the console's template filters
    "views",         # the console
    "management",    # the commands
    "testing",       # for users' tests and the demo
    "app",           # the AppConfig and the checks
    "face",          # ``durable`` and the documented faces
]

# Arrows the design rules out by name (each also points up RANK, or sideways).
NEVER = {
    ("store", "steps"), ("store", "actions"), ("store", "engine"), ("store", "agents"),
    ("store", "verbs"), ("store", "views"),
    ("actions", "engine"), ("actions", "agents"),
    ("engine", "agents"), ("engine", "views"),
    ("agents", "engine"), ("agents", "views"),
    ("reads", "verbs"),
}

# Imports that stay inside a function on purpose; they never count as closing a cycle.
LAZY = {
    ("durable", "durable.verbs.jobs"): "durable.submit: importing durable loads no models",
    ("durable", "durable.tasks.backend"): "durable.enqueue: importing durable loads no models",
    ("durable", "durable.steps.inbox"): "durable.signal: importing durable loads no models",
    ("durable.apps", "durable.checks"): "AppConfig.ready(): checks register once apps are loaded",
    ("durable.apps", "durable.tasks.backend"): "AppConfig.ready(): the task workflow registers once apps are loaded",
    ("durable.tasks.backend", "durable.models"): "Django imports durable.tasks while apps load (@task)",
    ("durable.tasks.backend", "durable.store.submission"): "Django imports durable.tasks while apps load (@task)",
    ("durable.tasks.results", "durable.models"): "imported by durable.tasks while apps load",
}
# Optional dependencies: imported only where they are used, inside a function.
OPTIONAL = {
    "prometheus_client": "the metrics extra (durable.reads.metrics)",
    "psycopg": "PostgreSQL only",
    "openai": "the openai extra (durable.agents.llm, by importlib)",
    "anthropic": "the anthropic extra (durable.agents.llm, by importlib)",
}

# One spelling per notion: where it is defined, and what another spelling looks like.
SPELLINGS = {
    "unsettled": ("durable.models.jobs", "a collection naming OutboxStatus.ATTEMPTED and UNKNOWN: use "
                  "models.UNSETTLED/IN_DOUBT or Outbox.objects.unsettled()/in_doubt()"),
    "stuck": ("durable.models.jobs", "a filter on lease_until__lt: use Job.objects.stuck(now=)"),
    "kind of a state": ("durable.core.workflows", "registry.get(w).table.kinds.get(s): use "
                        "registry.kind_of(w, s)"),
    "duration as text": ("durable.core.formats", "django.utils.timesince: use formats.age/duration"),
    "the states of a step": ("durable.core.states", "next(s for s in table.steps if s.step == name): use "
                             "table.states_for(name)"),
    "a lease ended by hand": ("durable.store.moves", "a write of lease_until/lease_owner: name the move "
                              "(durable.store.moves: hand_over, run_again, ...) and let it end the lease"),
    "is this an agent": ("durable.core.workflows", "getattr(x, 'runs_itself', ...): every workflow says "
                         "(workflow.runs_itself); an action's kind answers for it (actions.kinds.of)"),
}
# The columns of a worker's hold on a row: only the store (and the rows' own methods) write them.
LEASE = ("lease_until", "lease_owner")
# Where a database vendor may be named: the store, which has a class per database.
VENDOR_ALLOWED = "durable.store"

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
    """``{module: part}``: a root module's part from ``ROOT`` or ``FACES``, else its folder."""
    parts = {}
    for module, path in modules.items():
        dotted = module.split(".")
        if module in ROOT:
            parts[module] = ROOT[module]
        elif module in FACES:
            parts[module] = "face"
        elif len(dotted) > 2 or path.name == "__init__.py":
            parts[module] = dotted[1]
    return parts


def rule_parts(modules, imports, trees):
    """Every module in a part that ``RANK`` knows; every name in ``ROOT`` and ``FACES`` present."""
    found = {}
    parts = part_of(modules)
    for module in modules:
        if module not in parts:
            found[f"part: {module} is in no part"] = "move it into a folder, or name it in ROOT or FACES"
        elif parts[module] not in RANK:
            found[f"part: {module} is in {parts[module]}, which RANK does not place"] = "add the part to RANK"
    for module in [*ROOT, *FACES]:
        if module not in modules:
            found[f"part: {module} is named but not in the package"] = "remove it from ROOT or FACES"
    return found


def rule_faces(modules, imports, trees):
    """A face holds a docstring, imports from the module it faces, and ``__all__``; nothing else."""
    found = {}
    for face, target in FACES.items():
        if face not in trees:
            continue
        for node in trees[face].body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            exports = isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"]
            if docstring or exports:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 1 and f"durable.{node.module}" == target:
                continue
            found[f"face: {face} does more than re-export {target}"] = f"line {node.lineno}"
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
    """An import from a part to one above it in ``RANK`` (lazy ones in ``LAZY`` aside), or a NEVER arrow."""
    parts = part_of(modules)
    rank = {part: index for index, part in enumerate(RANK)}
    found = {}
    for imp in imports:
        src, dst = parts.get(imp.source), parts.get(imp.target)
        if not (src and dst) or src == dst or (imp.source, imp.target) in LAZY:
            continue
        if (src, dst) in NEVER:
            found[f"never: {src} -> {dst}: {imp.source} imports {imp.target}"] = f"line {imp.line}"
        elif rank.get(src, len(RANK)) < rank.get(dst, len(RANK)):
            found[f"arrow: {src} -> {dst} points up: {imp.source} imports {imp.target}"] = f"line {imp.line}"
    return found


def rule_vendor(modules, imports, trees):
    """A test of the database vendor outside the store, which has one class per database."""
    found = {}
    for name, tree in trees.items():
        if name == VENDOR_ALLOWED or name.startswith(VENDOR_ALLOWED + "."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(side, ast.Attribute) and side.attr == "vendor"
                    for side in [node.left, *node.comparators]):
                found[f"vendor: {name} tests the database vendor"] = f"line {node.lineno}: ask the store"
    return found


def rule_size(modules, imports, trees):
    found = {}
    for name, path in modules.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
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
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
            and node.args[1].value == "runs_itself":
        return "is this an agent"
    if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in LEASE for k in node.keys):
        return "a lease ended by hand"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("update", "create", "filter_update") \
            and any(k.arg in LEASE for k in node.keywords):
        return "a lease ended by hand"
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
            if notion == "a lease ended by hand" and name.startswith(("durable.store.", "durable.models.")):
                continue  # the store and its rows are where the lease is written
            if notion and SPELLINGS[notion][0] != name:
                found[f"spelling: {name} spells {notion} again"] = SPELLINGS[notion][1]
    return found


RULES = [rule_parts, rule_faces, rule_cycles, rule_private, rule_arrows, rule_vendor, rule_size, rule_guards,
         rule_lazy, rule_spellings]


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


def test_every_part_is_a_folder_or_a_root_module_and_rank_names_each_once():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and p.name != "migrations"}
    named = set(ROOT.values()) | {"face"}
    assert folders | named == set(RANK)
    assert len(RANK) == len(set(RANK))
    assert {part for pair in NEVER for part in pair} <= set(RANK)


def test_no_two_parts_import_each_other():
    modules, imports, _ = read_imports(PACKAGE)
    parts = part_of(modules)
    arrows = {(parts[i.source], parts[i.target]) for i in imports
              if i.target in parts and i.source in parts and parts[i.source] != parts[i.target]}
    assert not {(a, b) for a, b in arrows if (b, a) in arrows}


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
    _append(copy, "core/states.py", "def planted():\n    from .workflows import registry\n    return registry")
    assert "cycle: durable.core.states -> durable.core.workflows" in _planted(copy)


def test_a_planted_private_import_is_reported(copy):
    _append(copy, "core/formats.py",
            "def planted():\n    from .identity import _sorted_json\n    return _sorted_json")
    _append(copy, "verbs/purge.py", "def planted():\n    return locking._seconds(1)")
    found = _planted(copy)
    assert "private: durable.core.formats imports durable.core.identity._sorted_json" in found
    assert "private: durable.verbs.purge uses durable.store.locking._seconds" in found


@pytest.mark.parametrize("module, target, message", [
    ("store/ledger.py", "..engine.worker",
     "never: store -> engine: durable.store.ledger imports durable.engine.worker"),
    ("store/locking.py", "..actions.outbox",
     "never: store -> actions: durable.store.locking imports durable.actions.outbox"),
    ("actions/destinations.py", "..engine.runner",
     "never: actions -> engine: durable.actions.destinations imports durable.engine.runner"),
    ("actions/outbox.py", "..agents.outbox",
     "never: actions -> agents: durable.actions.outbox imports durable.agents.outbox"),
    ("engine/runner.py", "..agents.run", "never: engine -> agents: durable.engine.runner imports durable.agents.run"),
    ("engine/supervisor.py", "..views", "never: engine -> views: durable.engine.supervisor imports durable.views"),
    ("core/retry.py", "..models", "arrow: core -> models points up: durable.core.retry imports durable.models"),
    ("steps/inbox.py", "..verbs.jobs",
     "arrow: steps -> verbs points up: durable.steps.inbox imports durable.verbs.jobs"),
])
def test_a_planted_arrow_against_the_layout_is_reported(copy, module, target, message):
    _append(copy, module, f"def planted():\n    from {target} import planted\n    return planted")
    assert message in _planted(copy)


def test_a_planted_vendor_branch_outside_the_store_is_reported(copy):
    _append(copy, "actions/outbox.py",
            "def planted():\n    from django.db import connection\n    return connection.vendor == 'sqlite'")
    _append(copy, "store/locking.py",
            "def planted():\n    from django.db import connection\n    return connection.vendor == 'sqlite'")
    found = _planted(copy)
    assert "vendor: durable.actions.outbox tests the database vendor" in found
    assert not [v for v in found if v.startswith("vendor: durable.store")]


def test_a_face_that_does_more_than_re_export_is_reported(copy):
    _append(copy, "approvals.py", "def planted():\n    return 1")
    _append(copy, "llm.py", "from .agents.run import AgentRun")
    found = _planted(copy)
    assert "face: durable.approvals does more than re-export durable.actions.approvals" in found
    assert "face: durable.llm does more than re-export durable.agents.llm" in found


def test_a_planted_long_module_is_reported(copy):
    _append(copy, "core/formats.py", "\n".join(f"# {n}" for n in range(MAX_LINES)))
    assert "size: durable.core.formats is over 600 lines" in _planted(copy)


def test_a_planted_import_error_guard_is_reported(copy):
    _append(copy, "core/formats.py", "try:\n    from . import identity\nexcept ImportError:\n    identity = None")
    assert ("guard: durable.core.formats guards its import of durable.core.identity with except ImportError"
            in _planted(copy))


def test_a_planted_module_at_the_root_or_in_an_unranked_folder_is_reported(copy):
    (copy / "planted.py").write_text('"""A module nobody placed."""\n')
    (copy / "annex").mkdir()
    (copy / "annex" / "__init__.py").write_text('"""A part nobody ranked."""\n')
    found = _planted(copy)
    assert "part: durable.planted is in no part" in found
    assert "part: durable.annex is in annex, which RANK does not place" in found


def test_a_lazy_import_made_eager_or_an_optional_dependency_at_module_level_is_reported(copy):
    path = copy / "tasks" / "backend.py"
    path.write_text("from ..models import Job  # noqa\n" + path.read_text())
    _append(copy, "core/formats.py", "import prometheus_client")
    found = _planted(copy)
    assert "lazy: durable.tasks.backend imports durable.models at module level" in found
    assert "optional: durable.core.formats imports prometheus_client at module level" in found


def test_a_planted_second_spelling_is_reported(copy):
    _append(copy, "verbs/purge.py", "\n".join([
        "def planted(Job, OutboxStatus, registry, workflow):",
        "    from django.utils.timesince import timesince",
        "    stuck = Job.objects.filter(lease_until__lt=1)",
        "    open_ = (OutboxStatus.PENDING, OutboxStatus.ATTEMPTED, OutboxStatus.UNKNOWN)",
        "    states = next(s for s in registry.get('w').table.steps if s.step == 'x')",
        "    agent = getattr(workflow, 'runs_itself', False)",
        "    Job.objects.filter(pk=1).update(lease_until=None)",
        "    return timesince, stuck, open_, registry.get('w').table.kinds.get('s'), states, agent",
    ]))
    found = _planted(copy)
    for notion in SPELLINGS:
        assert f"spelling: durable.verbs.purge spells {notion} again" in found
