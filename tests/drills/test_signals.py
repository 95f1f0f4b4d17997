"""Stopping workers the way people and process managers do: the step in progress drains."""

import os
import signal
import time

import pytest

from durable.models import StepResult

from .drills import _lines, _wait

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]


def test_ctrl_c_on_runworkers_finishes_the_step_in_progress_instead_of_abandoning_it(lab):
    [key] = lab.submit(1, prefix="ctrl-c", workflow="drill_hold",
                       hold={"step": "b", "seconds": 1.5, "attempt": 1})
    proc = lab.runworkers(1)
    assert _wait(lambda: any(line[:3] == ("exec", key, "b") for line in _lines(lab.exec_log)), 30)
    # A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the
    # supervisor and every child at once. The supervisor forwards it as SIGTERM.
    os.killpg(proc.pid, signal.SIGINT)
    began = time.monotonic()
    assert proc.wait(30) == 0, lab.output(proc)
    output = lab.output(proc)
    assert "exiting now" not in output, "a child counted one Ctrl-C twice and abandoned its step"
    assert StepResult.objects.filter(job_id=key, step="b").exists(), output
    assert time.monotonic() - began < 10
