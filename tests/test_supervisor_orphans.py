"""A SIGKILLed runworkers supervisor leaves no orphans: its children drain and exit.

Real processes: only the supervisor is killed (not its process group), and the
children it had are then watched from outside until they are gone.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import durable
from durable.models import EventKind, Job, JobEvent
from tests.conftest import ROOT, wait_for
from tests.test_processes import executions

pytestmark = pytest.mark.django_db(transaction=True)

# Generous: a draining child finishes the step it has (1.5 s here) and exits.
GONE_WITHIN = 60


def alive(pid):
    """True while ``pid`` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def children_of(workers, proc, count):
    """The pids the supervisor logged starting ("started worker0 pid=123")."""
    return wait_for(
        lambda: (pids := [int(p) for p in re.findall(r"started \w+ pid=(\d+)",
                                                      workers.output(proc))])
        and len(pids) >= count and pids,
        message=f"{count} children to start",
    )


def told(output):
    """The lines in which a child says it received SIGTERM (they name it host:pid:role)."""
    return "\n".join(line for line in output.splitlines() if "received Terminated" in line)


@pytest.mark.crash
def test_children_of_a_sigkilled_supervisor_finish_their_step_exit_and_claim_nothing(workers, tmp_path):
    log = tmp_path / "exec.log"
    durable.submit("recorded", "in-hand", {"log": str(log), "sleep": 1.5})
    supervisor = workers.start(processes=2, DURABLE_LEASE_SECONDS=30)
    # Two workers and the outbox dispatcher.
    pids = children_of(workers, supervisor, 3)
    wait_for(lambda: workers.output(supervisor).count(" started (lease") == 3,
             message="the three children to be running")
    wait_for(lambda: executions(log)[("in-hand", "b-start")] == 1, message="step b to start")

    os.kill(supervisor.pid, signal.SIGKILL)  # the supervisor alone, not its group
    assert supervisor.wait(10) == -signal.SIGKILL
    try:
        # Each child is told (SIGTERM) and drains: a claim already under way when the
        # signal lands still completes, so new work is submitted once all three know.
        wait_for(lambda: all(f":{pid}:" in told(workers.output(supervisor)) or not alive(pid)
                             for pid in pids),
                 timeout=GONE_WITHIN, message="every child to learn its supervisor is gone")
        killed_at = JobEvent.objects.order_by("-id").values_list("id", flat=True).first()
        durable.submit("recorded", "after", {"log": str(log)})
        wait_for(lambda: not any(alive(pid) for pid in pids), timeout=GONE_WITHIN,
                 interval=0.2, message=f"the children {pids} to exit after their supervisor")
    finally:
        for pid in pids:  # orphans outlive the test's cleanup of the supervisor
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    # The step in hand was finished and committed, its job released; nothing new started.
    job = Job.objects.get(pk="in-hand")
    assert job.state == "b_done" and job.lease_owner is None
    assert executions(log)[("in-hand", "b")] == 1
    assert executions(log)[("in-hand", "c")] == 0
    assert Job.objects.get(pk="after").state == "pending"
    assert not JobEvent.objects.filter(
        id__gt=killed_at, kind__in=[EventKind.CLAIMED, EventKind.RECLAIMED]).exists()


# A parent that forks a child which watches it the portable way (no parent-death
# signal), as a child does where the kernel offers none.
PORTABLE = textwrap.dedent("""
    import os, signal, sys, time
    from durable.engine.supervisor import _watch_parent

    parent = os.getpid()
    child = os.fork()
    if child == 0:
        def drained(signum, frame):
            with open(sys.argv[1], "w") as f:
                f.write(signal.strsignal(signum))
            os._exit(0)
        signal.signal(signal.SIGTERM, drained)
        import threading
        threading.Thread(target=_watch_parent, args=(parent, 0.05), daemon=True).start()
        time.sleep(120)
        os._exit(1)
    print(child, flush=True)
    time.sleep(120)
""")


def test_where_there_is_no_parent_death_signal_a_child_notices_its_parent_is_gone(tmp_path):
    marker = tmp_path / "signalled"
    parent = subprocess.Popen([sys.executable, "-c", PORTABLE, str(marker)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"})
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.3)
        assert alive(child) and not marker.exists()  # the parent lives: nothing happens
        parent.kill()
        parent.wait(10)
        wait_for(lambda: not alive(child), timeout=GONE_WITHIN, message="the child to exit")
        assert marker.read_text() == signal.strsignal(signal.SIGTERM)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        parent.stdout.close()
