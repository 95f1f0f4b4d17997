import os

import pytest

from . import netlab
from .drills import SIZES
from .lab import Lab

# Drills that run twice: one job per worker process, and 8 steps in flight per process
# (``@pytest.mark.parametrize("lab", THREADS, indirect=True)``).
THREADS = [pytest.param(1, id="1-thread"), pytest.param(8, id="8-threads")]
# And the drills the crash guarantees rest on, once more with many runs in flight per
# process sharing few database connections (DURABLE["CONNECTIONS"]).
IN_FLIGHT = [*THREADS, pytest.param((64, 4), id="64-threads-4-connections")]
# On PostgreSQL, the same once more behind PgBouncer in transaction pooling: every worker
# connection goes through it, LISTEN goes to the server directly (``tests/pgbouncer.py``).
BEHIND_PGBOUNCER = pytest.param((64, 4, "pgbouncer"), id="64-threads-4-connections-pgbouncer")
IN_FLIGHT_AND_POOLED = [*IN_FLIGHT, BEHIND_PGBOUNCER]


@pytest.fixture
def lab(tmp_path, request):
    """A drill bench on the test database; every process it started is killed afterwards.

    Parametrised indirectly, the parameter is the threads per worker process, or
    (threads, connections), or (threads, connections, "pgbouncer"): the lab's workers then
    reach the database through a PgBouncer the test starts (skipped on SQLite).
    """
    threads = getattr(request, "param", None)
    through, bouncer = {}, None
    if isinstance(threads, tuple) and threads[2:] == ("pgbouncer",):
        from tests.pgbouncer import through as pooled

        threads = threads[:2]
        bouncer = request.getfixturevalue("pgbouncer")
        through = pooled(bouncer)
        before = bouncer.transactions(bouncer.name)
    bench = Lab(tmp_path / "lab", seed=int(os.environ.get("DURABLE_DRILL_SEED", 0)),
                threads=threads, env=through)
    yield bench
    bench.close()
    if bouncer is not None:
        # The drill's workers really went through it: their claims and commits at least.
        assert bouncer.transactions(bouncer.name) - before >= len(bench.submitted), (
            "the drill's work did not go through PgBouncer")


@pytest.fixture
def size():
    """The drill size CI runs."""
    return SIZES["small"]


def assert_targets(row, **allowed):
    """Fail with the whole row (and its notes) when it misses a target."""
    problems = row.problems(parked_ok=allowed.get("parked_ok", False))
    assert not problems, f"{row.drill}: {'; '.join(problems)}\n{row}\n" + "\n".join(row.notes)


@pytest.fixture
def lab_available():
    reason = netlab.unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the partition lab cannot run: {reason}")
        pytest.skip(reason)
