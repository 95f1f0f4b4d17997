"""Stopping ``runworkers``: a SIGTERM during its start-up drains instead of killing it, and
a second Ctrl-C leaves a threaded worker's task to its lease, as docs/tasks.md says."""

import os
import signal
import subprocess
import sys

import pytest

import durable
from durable.models import Job
from tests.conftest import ROOT, wait_for, worker_env
from tests.test_tasks import TaskResultStatus, hangs, lines

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.crash]

# runworkers, with a SIGTERM sent to itself while Django runs the system checks: after
# the interpreter and Django have started, before the supervisor installed its handlers.
STOPPED_DURING_START_UP = """\
import os, signal
from django.core.management import execute_from_command_line
from django.core.management.base import BaseCommand

checks = BaseCommand.check

def check(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return checks(self, *args, **kwargs)

BaseCommand.check = check
execute_from_command_line(["manage.py", "runworkers", "--processes", "1"])
"""


def test_a_sigterm_during_start_up_drains_before_any_process_starts(tmp_path):
    durable.submit("test_pipeline", "waiting", {})
    before = Job.objects.get(pk="waiting")
    proc = subprocess.run([sys.executable, "-c", STOPPED_DURING_START_UP], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out  # not -15
    assert "Received Terminated: draining 0 processes" in out
    assert "Stopped before starting any process." in out
    assert "started worker0" not in out
    after = Job.objects.get(pk="waiting")  # due all along, never claimed
    assert (after.state, after.lease_owner, after.attempts) == (before.state, None, 0)
    assert after.next_run_at is not None


def test_a_second_ctrl_c_leaves_a_threaded_workers_task_to_its_lease_then_it_runs_again(
        workers, tmp_path):
    log = tmp_path / "task.log"
    result = hangs.enqueue(str(log))
    proc = workers.start(processes=1, DURABLE_LEASE_SECONDS=2)  # the default threads
    wait_for(lambda: any(line.startswith("start 1") for line in lines(log)),
             message="the task to start")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    wait_for(lambda: "Received Interrupt: draining" in workers.output(proc),
             message="the drain to begin")
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 0, workers.output(proc)
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING  # not recorded: left to its lease
    assert result.errors == []

    again = workers.start(processes=1, DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: any(line.startswith("start 2") for line in lines(log)), timeout=60,
             message="another worker to run the task again once the lease expired")
    workers.kill(again)
    assert "finished" not in lines(log)
