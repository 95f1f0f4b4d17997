import os

import pytest

from .drills import SIZES
from .lab import Lab


@pytest.fixture
def lab(tmp_path):
    """A drill bench on the test database; every process it started is killed afterwards."""
    bench = Lab(tmp_path / "lab", seed=int(os.environ.get("DURABLE_DRILL_SEED", 0)))
    yield bench
    bench.close()


@pytest.fixture
def size():
    """The drill size CI runs."""
    return SIZES["small"]


def assert_targets(row, **allowed):
    """Fail with the whole row (and its notes) when it misses a target."""
    problems = row.problems(parked_ok=allowed.get("parked_ok", False))
    assert not problems, f"{row.drill}: {'; '.join(problems)}\n{row}\n" + "\n".join(row.notes)
