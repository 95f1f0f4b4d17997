"""What ``runworkers`` says, as real processes print it: a start-up line, how to stop it,
the drain, the burst's summary; ``-v 0`` quiet, ``-v 2`` every process and job."""

import os
import re
import signal

import pytest

import durable
from tests.conftest import ON_POSTGRES, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.crash]

# A site whose LOGGING names no durable logger: runworkers prints on its own.
FRESH_SETTINGS = """\
from tests.settings import *  # noqa: F403

LOGGING = {"version": 1, "disable_existing_loggers": False}
"""


@pytest.fixture
def fresh(tmp_path):
    """Environment of a runworkers process on a site that left durable's logging alone."""
    (tmp_path / "fresh_settings.py").write_text(FRESH_SETTINGS)
    return {"DJANGO_SETTINGS_MODULE": "fresh_settings", "PYTHONPATH": str(tmp_path)}


def ours(output):
    """The lines runworkers and its processes logged (not the system checks' warnings)."""
    return [line for line in output.splitlines() if re.match(r"\d\d:\d\d:\d\d ", line)]


def test_runworkers_says_what_it_started_and_how_to_stop_it_and_that_it_drained(workers, fresh):
    proc = workers.start("--queue", "emails", "--threads", "3", processes=2, env=fresh)
    wait_for(lambda: "Quit with CONTROL-C." in workers.output(proc), message="the start-up lines")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    assert proc.wait(30) == 0
    lines = ours(workers.output(proc))
    vendor = "postgresql" if ON_POSTGRES else "sqlite"
    assert re.search(r"Starting durable workers: 2 worker processes × 3 threads, 1 outbox"
                     rf" dispatcher; database {vendor} \S+.*; queues: emails, workflows: all\.$",
                     lines[0]), lines
    assert lines[1].endswith("Quit with CONTROL-C.")
    assert re.search(r"Received Interrupt: draining 3 processes \(the steps in flight finish;"
                     r" CONTROL-C again stops now\)$", lines[2]), lines
    assert lines[-1].endswith("Stopped.")
    # -v 1 shows runworkers' own lines, not each process's.
    assert not any("started worker0" in line for line in lines)


def test_a_burst_ends_with_its_summary_and_v2_shows_each_process_and_job(workers, fresh):
    durable.submit("test_pipeline", "a", {})
    durable.submit("test_pipeline", "b", {})
    proc = workers.start("--burst", "-v", "2", env=fresh)
    assert proc.wait(60) == 0, workers.output(proc)
    lines = ours(workers.output(proc))
    assert any("started worker0 pid=" in line for line in lines), lines
    for key in ("a", "b"):
        assert any(f"job={key} " in line and "-> delivered" in line for line in lines), lines
    assert any("Burst done in" in line and "2 jobs finished, 0 failed, 0 parked for a person,"
               " 0 waiting; 0 actions sent." in line for line in lines), lines
    assert lines[-2].endswith("Nothing left waiting.") and lines[-1].endswith("Stopped.")


def test_v0_prints_nothing_but_problems(workers, fresh):
    durable.submit("test_pipeline", "a", {})
    proc = workers.start("--burst", "-v", "0", env=fresh)
    assert proc.wait(60) == 0, workers.output(proc)
    assert ours(workers.output(proc)) == []


def test_a_site_whose_logging_names_durable_gets_the_lines_through_its_own_handlers(workers):
    # tests.settings sends the durable loggers to its own handler, with its own format.
    proc = workers.start("--burst", "-v", "0")
    assert proc.wait(60) == 0, workers.output(proc)
    out = workers.output(proc)
    assert " INFO durable.runworkers Starting durable workers: 1 worker process × " in out
    assert " INFO durable.runworkers Burst done in " in out
