"""The drills' detectors see what they claim to count (no worker processes: fast)."""

import datetime
from pathlib import Path

import pytest

from durable.core.states import StateKind
from durable.engine.runner import Runner
from durable.models import EventKind, JobEvent, StepResult

from .counts import Counts, duplicate_executions, read_executions, stale_writes, table
from .lab import sigkill_deaths

W1, W2 = "vm:101:worker0", "vm:202:worker1"
KINDS = {"pending": StateKind.INITIAL, "a_running": StateKind.WORKING, "a_done": StateKind.READY,
         "b_running": StateKind.WORKING, "b_done": StateKind.TERMINAL}


def ev(i, kind, frm, to, actor, step="a", message="", data=None):
    return {"id": i, "job_id": "j", "kind": kind, "from_state": frm, "to_state": to,
            "step": step, "actor": actor, "message": message, "data": data}


def claim(i, actor, frm="pending", to="a_running", kind=EventKind.CLAIMED):
    return ev(i, kind, frm, to, actor)


def test_a_write_by_the_lease_holder_is_not_stale():
    events = [
        claim(1, W1),
        ev(2, EventKind.STEP_DONE, "a_running", "a_done", W1, data={"attempt": 1, "ms": 1}),
        ev(3, EventKind.STEP_DONE, "a_done", "b_running", W1, data={"attempt": 1, "ms": 1}),
        ev(4, EventKind.STEP_DONE, "b_running", "b_done", W1, step="b", data={"attempt": 1}),
    ]
    assert stale_writes(events, {"j": KINDS}) == []


def test_a_write_after_another_worker_reclaimed_the_lease_is_stale():
    events = [
        claim(1, W1),
        claim(2, W2, "a_running", "a_running", EventKind.RECLAIMED),
        ev(3, EventKind.STEP_DONE, "a_running", "a_done", W1, data={"attempt": 1}),
    ]
    assert [e["id"] for e in stale_writes(events, {"j": KINDS})] == [3]


def test_a_write_after_the_worker_released_its_own_lease_is_stale():
    events = [
        claim(1, W1),
        ev(2, EventKind.RETRY, "a_running", "pending", W1, data={"attempt": 1}),
        ev(3, EventKind.STEP_DONE, "a_running", "a_done", W1, data={"attempt": 1}),
    ]
    assert [e["id"] for e in stale_writes(events, {"j": KINDS})] == [3]


def test_a_write_after_an_operator_moved_the_job_is_stale():
    events = [
        claim(1, W1),
        ev(2, EventKind.OPERATOR, "a_running", "cancelled", "ops"),
        ev(3, EventKind.STEP_DONE, "a_running", "a_done", W1, data={"attempt": 1}),
    ]
    assert [e["id"] for e in stale_writes(events, {"j": KINDS})] == [3]


def test_a_rerun_without_a_kill_or_lease_loss_is_an_unexplained_duplicate():
    started = [("j", "a", 1, 101), ("j", "a", 1, 202)]
    memos = [{"job_id": "j", "step": "a", "attempt": 1}]
    events = [ev(1, EventKind.STEP_DONE, "a_running", "a_done", W2, data={"attempt": 1})]
    dup, allowed, phantom, unexplained = duplicate_executions(started, memos, events, set())
    assert (dup, allowed, phantom) == (1, 0, [])
    assert unexplained == [("j", "a", 1, 101)]


def test_a_rerun_after_a_kill_or_a_reclaimed_lease_is_allowed():
    started = [("j", "a", 1, 101), ("j", "a", 2, 202)]
    memos = [{"job_id": "j", "step": "a", "attempt": 2}]
    events = [
        ev(1, EventKind.RECLAIMED, "a_running", "a_running", W2,
           message=f"lease of {W1} expired; attempt 2"),
        ev(2, EventKind.STEP_DONE, "a_running", "a_done", W2, data={"attempt": 2}),
    ]
    assert duplicate_executions(started, memos, events, set())[:2] == (1, 1)
    assert duplicate_executions(started, memos, events[1:], {101})[:2] == (1, 1)


def test_a_rerun_after_a_takeover_is_allowed_when_the_reclaim_names_a_holder_in_between():
    # 101's lease expired; thread 2 of 202 claimed the step, lost its connection before
    # writing its own "reclaimed" event, and its lease expired too; 303 names 202.
    started = [("j", "a", 1, 101), ("j", "a", 2, 303)]
    memos = [{"job_id": "j", "step": "a", "attempt": 2}]
    w3 = "vm:303:worker2.5"
    events = [
        ev(1, EventKind.RECLAIMED, "a_running", "a_running", w3,
           message="lease of vm:202:worker1.2 expired; attempt 2"),
        ev(2, EventKind.STEP_DONE, "a_running", "a_done", w3, data={"attempt": 2}),
    ]
    assert duplicate_executions(started, memos, events, set())[:2] == (1, 1)
    # A takeover of another step of the job allows nothing here.
    other = [{**events[0], "step": "b"}, events[1]]
    assert duplicate_executions(started, memos, other, set())[:2] == (1, 0)


def test_a_retry_after_a_recorded_failure_and_a_run_nobody_repeated_are_not_duplicates():
    started = [("j", "a", 1, 101), ("j", "a", 2, 101), ("j", "b", 1, 101)]
    memos = [{"job_id": "j", "step": "a", "attempt": 2}]
    events = [
        ev(1, EventKind.RETRY, "a_running", "pending", W1, data={"attempt": 1}),
        ev(2, EventKind.STEP_DONE, "a_running", "a_done", W1, data={"attempt": 2}),
    ]
    assert duplicate_executions(started, memos, events, set())[:3] == (0, 0, [])


def test_a_memo_no_run_produced_is_reported():
    memos = [{"job_id": "j", "step": "a", "attempt": 1}]
    events = [ev(1, EventKind.STEP_DONE, "a_running", "a_done", W1, data={"attempt": 1})]
    assert duplicate_executions([], memos, events, set())[2] == [("j", "a", 1, 101)]


def test_kills_are_read_from_the_supervisor_log_including_deaths_during_the_drain():
    log = "\n".join([
        "x INFO durable.supervisor started worker0 pid=11",
        "x INFO durable.supervisor started worker1 pid=12",
        "x WARNING durable.supervisor worker0 died (exit code -9); starting a replacement",
        "x INFO durable.supervisor started worker0 pid=13",
        "x INFO durable.supervisor started dispatcher0 pid=14",
        "x WARNING durable.supervisor dispatcher0 died (exit code 1); starting a replacement",
        "x INFO durable.worker vm:12:worker1 stopped",
        "x INFO durable.supervisor supervisor exiting",
    ])
    assert sigkill_deaths(log, finished=False) == [11]
    # Once the supervisor has exited, a child that never logged "stopped" was killed.
    assert sigkill_deaths(log) == [11, 13]


def test_a_torn_last_line_of_the_executions_log_is_ignored(tmp_path):
    path = tmp_path / "executions.log"
    path.write_text("exec j a 1 101\ndone j a 1 101\nexec j b 1")
    started, returned = read_executions(path)
    assert started == [("j", "a", 1, 101)]
    assert returned == {("j", "a", 1, 101)}


def test_the_table_lists_every_count_and_a_row_with_a_problem_says_which():
    row = Counts(drill="demo", database="sqlite", jobs=3, kills=1, dup_exec=2, dup_exec_hits=1)
    text = table([row])
    assert "dup exec (hits)" in text and "| 2 (1)" in text
    assert row.problems() == ["1 duplicate executions without a kill or lease loss"]


@pytest.mark.django_db
def test_the_stale_write_detector_sees_an_unfenced_commit_in_a_real_timeline():
    """Forge what a worker without fencing would write, and check the count catches it."""
    import durable
    from durable.models import Job

    from .counts import count

    durable.submit("drill", "forged", {})
    first = Runner(W1).claim()
    Job.objects.filter(pk="forged").update(lease_until=None, next_run_at="2000-01-01T00:00:00Z")
    second = Runner(W2).claim()
    assert first.claimed.lease_token != second.claimed.lease_token
    # W1 "commits" step a as if fencing were missing: memo and event, after W2's claim.
    JobEvent.objects.create(job_id="forged", kind=EventKind.STEP_DONE, from_state="a_running",
                            to_state="a_done", step="a", actor=W1, data={"attempt": 1})
    StepResult.objects.create(job_id="forged", step="a", output={}, attempt=1, workflow="drill",
                              duration=datetime.timedelta(0))

    class Bench:
        database, submitted, paused = "sqlite", ["forged"], set()
        exec_log = Path("/nonexistent/executions.log")

        def kills(self):
            return set()

    row = count(Bench(), "forged", began=0)
    assert row.stale >= 1
    assert any("stale write" in note for note in row.notes)


def test_a_note_the_releasing_commit_adds_is_not_stale_but_a_later_move_is():
    kinds = {**KINDS, "awaiting": StateKind.APPROVAL}
    events = [
        claim(1, W1),
        ev(2, EventKind.APPROVAL, "a_running", "awaiting", W1, data={"approval": 1}),
        ev(3, EventKind.ACTION, "awaiting", "awaiting", W1, data={"phase": "enqueued"}),
        ev(4, EventKind.STEP_DONE, "awaiting", "a_done", W1, data={"attempt": 1}),
    ]
    assert [e["id"] for e in stale_writes(events, {"j": kinds})] == [4]
