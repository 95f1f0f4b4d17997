"""Every Python sample in the README and in docs/ runs.

The ```python blocks of one file run in order, in one module of their own (so a later
sample may use what an earlier one defined, and a task defined in a sample can be
imported by its path). A settings snippet runs against a copy of the real settings.
A block preceded by the line ``<!-- docs-test: skip -->`` is not run: use it, sparingly,
for a sample that cannot run here, and say why in the text.

The README's samples also build a whole site in ``tests/test_readme_site.py``: a block
marked ``<!-- readme-site: TARGET -->`` goes to that site. Those whose target is its
``settings.py`` or a module of its app (``myapp/...``) run here as well; the others (code
run in the site's shell, its ``urls.py``, a server run as a process of its own) run there
only.
"""

import copy
import importlib
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.conf import settings

from durable.core.workflows import registry

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
SKIP = "<!-- docs-test: skip -->"
SITE = re.compile(r"<!-- readme-site: (?P<target>.+?) -->")
HERE_TOO = re.compile(r"settings\.py|myapp/\w+\.py")


@dataclass
class Sample:
    path: Path
    line: int
    code: str
    skip: bool
    site: str = ""  # the README site's target for this block, if it has one

    @property
    def name(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def samples(path):
    """The Python samples of one Markdown file, in order."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        notes = comments_above(text, match.start())
        site = next((m["target"] for note in notes if (m := SITE.fullmatch(note))), "")
        found.append(Sample(
            path=path,
            line=text.count("\n", 0, match.start()) + 1,
            code=match["code"],
            skip=SKIP in notes or bool(site) and not HERE_TOO.fullmatch(site),
            site=site,
        ))
    return found


def comments_above(text, start):
    """The HTML comment lines right above a fence (nearest last)."""
    notes = []
    for line in reversed(text[:start].rstrip().splitlines()):
        if not (line.startswith("<!--") and line.rstrip().endswith("-->")):
            break
        notes.insert(0, line.strip())
    return notes


ALL = [s for path in FILES if path.exists() for s in samples(path)]
# The blocks of the README's own site run there (tests/test_readme_site.py), not here.
HERE = [s for s in ALL if not (s.skip and s.site)]


def module_for(path):
    """A fresh importable module for one file's samples, seeded with a copy of the settings."""
    name = "docs_sample_" + re.sub(r"\W", "_", path.relative_to(ROOT).with_suffix("").as_posix())
    module = types.ModuleType(name)
    module.__file__ = str(path)
    # The names the settings module defines (not Django's defaults, some of which warn
    # when read), as a settings.py snippet sees them.
    defined = importlib.import_module(settings.SETTINGS_MODULE)
    for key in dir(defined):
        if key.isupper():
            setattr(module, key, copy.deepcopy(getattr(defined, key)))
    sys.modules[name] = module
    return module


def run(sample, module):
    code = compile(sample.code, sample.name, "exec")
    exec(code, module.__dict__)  # noqa: S102 - running the docs is the point


def test_the_docs_have_samples_to_run():
    assert any(not s.skip for s in ALL)
    assert {s.path.name for s in ALL} >= {"README.md"}


@pytest.mark.django_db
@pytest.mark.parametrize("sample", HERE, ids=[s.name for s in HERE])
def test_every_python_sample_in_the_docs_runs(sample, capsys):
    if sample.skip:
        pytest.skip(f"{sample.name} is marked {SKIP}")
    module = module_for(sample.path)
    before = set(registry.names())
    try:
        for earlier in samples(sample.path):
            if earlier.line == sample.line:
                break
            if not earlier.skip:
                run(earlier, module)
        run(sample, module)
    finally:
        # Workflows declared by the samples leave with them.
        for name in set(registry.names()) - before:
            registry.unregister(name)
        sys.modules.pop(module.__name__, None)
