"""Each hot write leaves the same rows by the database's own statements as by the ORM's.

A database class (``PostgresStore``, ``SqliteStore``) sends statements of its own for the
hot moves; ``durable.store.base.Database`` makes each with the ORM, for any other
database. Here both make the same move from the same rows on the same database, one
after the other (the rows of the first rolled back before the second), and what each
leaves is compared whole: every job with its columns, its events, its memos, its outbox
rows, and what the move returned.

Two things legitimately differ and are left out, here only: row ids (sequences move on,
and the second run's rows are new rows; an event's data names its outbox row by kind
instead), and instants (each move reads the database clock when it runs). An instant is
compared as its distance from its row's ``updated`` stamp (an event's or memo's from its
job's), to within a second, so a lease must still end LEASE seconds after the move that
took it, and an event be stamped when its move was.
"""

import copy
import datetime
import json
from decimal import Decimal

import pytest
from django.db import transaction

import durable
from durable.core.states import StateKind
from durable.core.workflows import registry
from durable.models import Job, JobEvent, Outbox, OutboxStatus, Pause, StepResult
from durable.store import database
from durable.store.base import Database
from durable.store.records import MemoCommit, Starts, StepCommit, Success

from .conftest import ON_POSTGRES

pytestmark = pytest.mark.django_db

LEASE = 60.0
LONG_AGO = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
ORM = Database()
IN_FLIGHT, UNKNOWN, DONE = "in_flight_create_ticket", "unknown_create_ticket", "create_ticket_done"


def fast():
    store = database.current()
    assert type(store) is not Database, "the suite runs on a database with statements of its own"
    return store


# Comparing what two moves left ----------------------------------------------------------


class Instant:
    """An instant as its distance from its row's ``updated`` stamp; equal to another within a second.

    Two runs of a move read the clock at different moments: what must agree is where each
    instant falls relative to its move (a lease ends LEASE seconds after it, an event is
    stamped with it), not the clock itself.
    """

    def __init__(self, seconds):
        self.seconds = seconds

    def __eq__(self, other):
        return isinstance(other, Instant) and abs(self.seconds - other.seconds) < 1

    def __repr__(self):
        return f"<{self.seconds:+.3f} s from updated>"


def _at(value, anchor):
    """An instant near ``anchor`` as an ``Instant``; one set long before (a setup's) as it is."""
    offset = (value - anchor).total_seconds()
    return Instant(offset) if abs(offset) < 86400 else value


def _row(row, anchor, drop=("id",)):
    return {k: _at(v, anchor) if isinstance(v, datetime.datetime) else v
            for k, v in row.items() if k not in drop}


def everything():
    """Every job, with its events, memos and outbox rows, ids and instants made comparable."""
    found = {}
    for job in Job.objects.order_by("pk").values():
        anchor = job["updated"]
        outbox = list(Outbox.objects.filter(job_id=job["id"]).order_by("kind").values())
        rows = {o["id"]: f"the outbox row of {o['kind']}" for o in outbox}
        events = []
        for event in JobEvent.objects.filter(job_id=job["id"]).order_by("id").values():
            if isinstance(event["data"], dict) and event["data"].get("action") in rows:
                event["data"] = {**event["data"], "action": rows[event["data"]["action"]]}
            events.append(_row(event, anchor))
        found[job["id"]] = {
            "job": _row(job, anchor, drop=()),
            "events": events,
            "memos": [_row(m, anchor) for m in StepResult.objects.filter(job_id=job["id"]).order_by("step").values()],
            "outbox": [_row(o, o["updated"]) for o in outbox],
        }
    return found


def returned(value):
    """What a move returned, comparable: a claim's instants checked against the row it wrote."""
    if isinstance(value, tuple | list):
        return [returned(v) for v in value]
    slots = getattr(type(value), "__slots__", None)
    if slots and hasattr(value, "lease_token") and hasattr(value, "db_now"):  # a Claimed job
        stamps = Job.objects.filter(pk=value.id).values("updated", "created").get()
        shown = {name: getattr(value, name) for name in slots}
        shown["db_now"] = ("is the job's updated", shown["db_now"] == stamps["updated"])
        shown["created"] = ("is the job's created", shown["created"] == stamps["created"])
        return shown
    if hasattr(value, "idempotency_key"):  # a ClaimedAction
        shown = dict(vars(value))
        shown["id"] = shown["id"] is not None
        return shown
    if isinstance(value, datetime.datetime):
        return _at(value, Job.objects.order_by("pk").values_list("updated", flat=True).first() or value)
    return value


def both(setup, move):
    """``move(store, setup())`` by the fast path, then by the ORM's, each rolled back after.

    Returns (fast, orm): what each move returned and the rows it left.
    """
    seen = []
    for store in (fast(), ORM):
        with transaction.atomic():
            given = setup()
            result = move(store, given)
            seen.append({"returned": returned(result), "rows": everything()})
            transaction.set_rollback(True)
    return seen


def differences(fast, orm, path="store"):
    """Where two results differ: ["path: statements gave x, the ORM y", ...]."""
    if isinstance(fast, dict) and isinstance(orm, dict):
        return [d for k in sorted(set(fast) | set(orm), key=str)
                for d in differences(fast.get(k, "(missing)"), orm.get(k, "(missing)"), f"{path}.{k}")]
    if isinstance(fast, list) and isinstance(orm, list) and len(fast) == len(orm):
        return [d for i, (f, o) in enumerate(zip(fast, orm, strict=True)) for d in differences(f, o, f"{path}[{i}]")]
    return [] if fast == orm else [f"{path}: statements gave {fast!r}, the ORM {orm!r}"]


def assert_same(setup, move):
    by_statements, by_orm = both(setup, move)
    assert differences(by_statements, by_orm) == []
    assert by_statements == by_orm
    return by_statements


# Setting the rows up -----------------------------------------------------------------------


def starts():
    return Starts(registry.all())


def claim(key="j", workflow="recorded", **submit):
    durable.submit(workflow, key, {"n": 1}, **submit)
    return fast().claim_job("w1", LEASE, starts=starts())


def step_commit(**overrides):
    fields = {"step": "a", "actor": "w1", "lease_seconds": LEASE, "output_json": json.dumps({"a": 1}),
              "cost": Decimal("0.25"), "duration": datetime.timedelta(milliseconds=1234), "attempt": 1,
              "data_json": json.dumps({"attempt": 1, "cost": "0.25", "ms": 1234.0})}
    fields.update(overrides)
    return StepCommit(**fields)


def in_flight(run_worker):
    """A ticket job whose action's row is due, as the worker left it."""
    durable.submit("ticket", "t1", {})
    run_worker()
    assert Job.objects.get(pk="t1").state == IN_FLIGHT
    # The worker measured its steps: the same figures each time, so that two runs of this
    # setup leave the same rows.
    Outbox.objects.update(step_duration=datetime.timedelta(milliseconds=5))
    StepResult.objects.update(duration=datetime.timedelta(milliseconds=5))
    for event in JobEvent.objects.all():
        if isinstance(event.data, dict) and "ms" in event.data:
            JobEvent.objects.filter(pk=event.pk).update(data={**event.data, "ms": 5.0})
    return Outbox.objects.get(job_id="t1")


def claimed_row(run_worker):
    in_flight(run_worker)
    [row] = fast().claim_actions("d", 30, 10, {}, [], 10)
    return row


def attempted_row(run_worker):
    row = claimed_row(run_worker)
    assert fast().mark_attempted(row, 60, OutboxStatus.PENDING, (IN_FLIGHT, UNKNOWN), "d", ": sending")[1] == 1
    return row


def success(**overrides):
    fields = {"remote_id": "T-1", "summary": "HTTP 201",
              "memo_json": json.dumps({"remote_id": "T-1", "status": "succeeded"}), "done": DONE,
              "terminal": False, "actor": "d", "message": "create_ticket on test_receiver succeeded",
              "data_json": json.dumps({"action": 1, "remote_id": "T-1", "cost": "0"})}
    fields.update(overrides)
    return Success(**fields)


# Submitting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["now", "later", "taken"])
def test_a_submit_inserts_the_same_job_and_event_by_statement_as_by_the_orm(when):
    def setup():
        if when == "taken":
            durable.submit("recorded", "j", {"n": 0}, submitted_by="first")
        return fast().now() + datetime.timedelta(seconds=90) if when == "later" else None

    def move(store, run_after):
        return store.insert_job(key="j", workflow="recorded", version=1, queue="q", state="pending",
                                payload_json='{"n": 1}', run_after=run_after, submitted_by="api",
                                message="recorded v1")

    seen = assert_same(setup, move)
    job = seen["rows"]["j"]["job"]
    if when == "taken":
        assert seen["returned"] is None and job["submitted_by"] == "first"
    else:
        assert job["next_run_at"] == Instant(90 if when == "later" else 0)
        assert [(e["kind"], e["at"]) for e in seen["rows"]["j"]["events"]] == [("submitted", Instant(0))]


# Claiming a job ---------------------------------------------------------------------------------


def test_a_claim_starts_the_same_step_with_the_same_lease_and_event_by_statement_as_by_the_orm():
    def setup():
        durable.submit("recorded", "j", {"n": 1})
        durable.submit("recorded", "k", {"n": 2})  # due after j: not claimed

    seen = assert_same(setup, lambda store, _: store.claim_job("w1", LEASE, starts=starts()))
    job = seen["rows"]["j"]["job"]
    assert (job["state"], job["attempts"], job["lease_owner"], job["lease_token"]) == ("a_running", 1, "w1", 1)
    assert job["lease_until"] == job["next_run_at"] == Instant(LEASE)
    assert seen["returned"]["db_now"] == ("is the job's updated", True)
    assert seen["rows"]["k"]["job"]["lease_owner"] is None


def test_a_claim_of_a_job_whose_lease_expired_mid_step_takes_it_without_starting_a_step_either_way():
    def setup():
        claim()
        Job.objects.filter(pk="j").update(lease_until=LONG_AGO,
                                          next_run_at=LONG_AGO)

    seen = assert_same(setup, lambda store, _: store.claim_job("w2", LEASE, starts=starts()))
    assert seen["returned"]["started_step"] is None and seen["returned"]["previous_owner"] == "w1"
    assert seen["rows"]["j"]["job"]["lease_token"] == 2


def test_a_claim_of_a_woken_timer_says_so_in_its_event_either_way():
    def setup():
        durable.submit("wait_until", "j", {"seconds": 5})
        table = registry.get("wait_until").table
        [timer] = [s for s, kind in table.kinds.items() if kind == StateKind.TIMER]
        Job.objects.filter(pk="j").update(state=timer, attempts=3)

    seen = assert_same(setup, lambda store, _: store.claim_job("w1", LEASE, starts=starts()))
    [_, claimed] = seen["rows"]["j"]["events"]
    assert claimed["message"] == "timer fired" and seen["rows"]["j"]["job"]["attempts"] == 3


@pytest.mark.parametrize("why", ["paused", "other queue", "other workflow", pytest.param("stopping", marks=(
    pytest.mark.skipif(ON_POSTGRES, reason="PostgreSQL's claim never waits for a lock (SKIP LOCKED): it"
                       " does not ask whether its process is stopping")))])
def test_a_claim_that_finds_nothing_it_may_take_writes_nothing_either_way(why):
    def setup():
        durable.submit("recorded", "j", {"n": 1})
        if why == "paused":
            Pause.objects.create(workflow="recorded")

    def move(store, _):
        return store.claim_job("w1", LEASE, workflows=["flaky"] if why == "other workflow" else None,
                               queues=["elsewhere"] if why == "other queue" else None, starts=starts(),
                               stopping=(lambda: True) if why == "stopping" else None)

    seen = assert_same(setup, move)
    assert seen["returned"] is None and seen["rows"]["j"]["job"]["lease_token"] == 0


# A step's commit ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["hands the job back", "keeps the lease", "ends the job", "memo exists",
                                 "lease lost", "job moved", "claims the next job"])
def test_a_step_commit_leaves_the_same_job_event_and_memo_by_statement_as_by_the_orm(how):
    def setup():
        claimed = claim()
        # What an earlier attempt left, which a commit clears.
        Job.objects.filter(pk="j").update(wake_at=LONG_AGO, last_error="the last attempt failed")
        if how == "claims the next job":  # due before j is again
            durable.submit("recorded", "k", {"n": 2}, run_after=fast().now() - datetime.timedelta(seconds=5))
        if how == "ends the job":
            Job.objects.filter(pk="j").update(state="c_running")
            claimed.state = "c_running"
        if how == "lease lost":
            Job.objects.filter(pk="j").update(lease_token=7)
        if how == "job moved":
            Job.objects.filter(pk="j").update(state="a_done")
        return claimed

    def move(store, claimed):
        if how == "keeps the lease":
            return store.complete_step(claimed, ["a_done", "b_running"], step_commit(keep=True))
        if how == "ends the job":
            return store.complete_step(claimed, ["c_done"], step_commit(step="c", terminal=True))
        if how == "claims the next job":
            return store.complete_step(claimed, ["a_done"], step_commit(), ("w1", None, None, starts()))
        return store.complete_step(claimed, ["a_done"], step_commit(write_memo=how != "memo exists"))

    seen = assert_same(setup, move)
    job, memos = seen["rows"]["j"]["job"], seen["rows"]["j"]["memos"]
    done = how not in ("lease lost", "job moved")
    assert seen["returned"][0] is done
    assert len(memos) == (1 if done and how != "memo exists" else 0)
    if how == "ends the job":
        assert job["result"] == {"a": 1} and job["next_run_at"] is None
    if how == "claims the next job":
        assert seen["returned"][1]["id"] == "k" and seen["rows"]["k"]["job"]["state"] == "a_running"


def test_the_comparison_notices_a_lease_that_ends_two_seconds_later():
    def setup():
        return claim()

    by_statements, by_orm = both(setup, lambda store, claimed: store.complete_step(
        claimed, ["a_done", "b_running"], step_commit(keep=True, lease_seconds=LEASE + 2 * (store is ORM))))
    assert by_statements["rows"]["j"]["job"]["lease_until"] != by_orm["rows"]["j"]["job"]["lease_until"]
    assert by_statements != by_orm


# An agent's memo commit -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["committed", "lease lost"])
def test_an_agent_memo_commit_leaves_the_same_progress_and_memo_by_statement_as_by_the_orm(how):
    memo = MemoCommit(key="m1", kind="model", name="gpt", seq=1, turn=1, fingerprint="f" * 64,
                      output_json=json.dumps({"text": "hello"}), cost=Decimal("0.002"), input_tokens=12,
                      output_tokens=5, model="gpt-x", duration=datetime.timedelta(seconds=2), attempt=1,
                      workflow="recorded")

    def setup():
        claimed = claim()
        Job.objects.filter(pk="j").update(last_error="the last call failed", attempts=4)
        if how == "lease lost":
            Job.objects.filter(pk="j").update(lease_token=7)
        return claimed

    seen = assert_same(setup, lambda store, claimed: store.commit_memo(
        claimed, "a_running", LEASE, json.dumps({"turn": 1}), memo))
    assert seen["returned"] is (how == "committed")
    assert len(seen["rows"]["j"]["memos"]) == (how == "committed")


def test_a_group_of_memo_commits_leaves_the_same_rows_by_statement_as_by_the_orm():
    memos = [MemoCommit(key=f"m{n}", kind="model", name="gpt", seq=n, turn=n, fingerprint="",
                        output_json=json.dumps({"n": n}), cost=Decimal("0.001"), input_tokens=n,
                        output_tokens=1, model="gpt-x", duration=datetime.timedelta(seconds=1),
                        attempt=1, workflow="recorded") for n in (1, 2, 3)]

    def group(store, claimed):
        stale = copy.copy(claimed)
        stale.lease_token += 1  # a run whose lease another worker took: refused alone
        return store.commit_memos([(claimed, "a_running", LEASE, json.dumps({"calls": 1}), memos[0]),
                                   (stale, "a_running", LEASE, json.dumps({"calls": 2}), memos[1]),
                                   (claimed, "a_running", LEASE, json.dumps({"calls": 3}), memos[2])])

    seen = assert_same(claim, group)
    assert seen["returned"] == [True, False, True]
    assert [m["step"] for m in seen["rows"]["j"]["memos"]] == ["m1", "m3"]
    assert seen["rows"]["j"]["job"]["progress"] == {"calls": 3}


# The heartbeat ----------------------------------------------------------------------------------


def test_a_heartbeat_renews_the_same_leases_by_statement_as_by_the_orm():
    def setup():
        held = [(claim("j").id, 1), (claim("k").id, 1), (claim("lost").id, 1)]
        Job.objects.filter(pk="k").update(lease_until=LONG_AGO)
        Job.objects.filter(pk="lost").update(lease_token=2)
        Job.objects.filter(pk="j").update(lease_until=datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC))
        return held

    seen = assert_same(setup, lambda store, held: store.renew_leases(held, LEASE * 2))
    assert seen["returned"] == {"j"}


# An action: its claim, and the two writes around its send ---------------------------------------


@pytest.mark.parametrize("how", ["claimed", "destination full", "paused"])
def test_an_action_claim_leases_the_same_rows_by_statement_as_by_the_orm(how, run_worker_inline):
    def setup():
        in_flight(run_worker_inline)
        if how == "paused":
            Pause.objects.create(workflow="ticket")

    rooms = {"test_receiver": 0} if how == "destination full" else {}
    full = list(rooms)
    seen = assert_same(setup, lambda store, _: store.claim_actions("d", 30, 10, rooms, full, 10))
    assert len(seen["returned"]) == (how == "claimed")
    assert seen["rows"]["t1"]["outbox"][0]["lease_token"] == (how == "claimed")


@pytest.mark.parametrize("how", ["marked", "status moved", "job moved"])
def test_marking_an_action_attempted_leaves_the_same_row_and_event_by_statement_as_by_the_orm(how,
                                                                                           run_worker_inline):
    def setup():
        row = claimed_row(run_worker_inline)
        if how == "status moved":
            Outbox.objects.filter(pk=row.id).update(status=OutboxStatus.UNKNOWN)
        if how == "job moved":
            Job.objects.filter(pk="t1").update(state="cancelled")
        return row

    seen = assert_same(setup, lambda store, row: store.mark_attempted(
        row, 60, OutboxStatus.PENDING, (IN_FLIGHT, UNKNOWN), "d", ": sending create_ticket"))
    assert seen["returned"][1] == (1 if how == "marked" else None)


@pytest.mark.parametrize("how", ["goes on", "ends the job", "memo exists", "lease lost", "job moved"])
def test_an_action_confirmation_settles_the_row_and_completes_the_step_alike_by_statement_and_by_the_orm(
        how, run_worker_inline):
    def setup():
        row = attempted_row(run_worker_inline)
        # What an earlier attempt left, which a confirmation clears.
        Outbox.objects.filter(pk=row.id).update(last_error="timed out")
        Job.objects.filter(pk="t1").update(last_error="timed out", attempts=2, wake_at=LONG_AGO)
        if how == "memo exists":
            StepResult.objects.create(job_id="t1", step=row.kind, output={"earlier": True},
                                      duration=datetime.timedelta(0), workflow="ticket")
        if how == "lease lost":
            Outbox.objects.filter(pk=row.id).update(lease_token=row.lease_token + 1)
        if how == "job moved":
            Job.objects.filter(pk="t1").update(state="cancelled")
        return row

    seen = assert_same(setup, lambda store, row: store.record_success(
        row, (IN_FLIGHT, UNKNOWN), success(terminal=how == "ends the job")))
    job, [action] = seen["rows"]["t1"]["job"], seen["rows"]["t1"]["outbox"]
    moved = how in ("goes on", "ends the job", "memo exists")
    assert seen["returned"][1] is moved
    assert (job["state"] == DONE) is moved and (action["status"] == OutboxStatus.SUCCEEDED) is moved
    if how == "ends the job":
        assert job["result"] == {"remote_id": "T-1", "status": "succeeded"} and job["next_run_at"] is None
    if how == "memo exists":
        assert [m["output"] for m in seen["rows"]["t1"]["memos"] if m["step"] == "create_ticket"] == [
            {"earlier": True}]


# The clock ----------------------------------------------------------------------------------------


def test_both_read_the_same_database_clock_and_the_same_next_due_job():
    durable.submit("recorded", "j", {}, run_after=fast().now() + datetime.timedelta(seconds=120))
    assert abs(fast().now() - ORM.now()) < datetime.timedelta(seconds=1)
    assert abs(fast().seconds_until_due() - ORM.seconds_until_due()) < 1
    Job.objects.update(next_run_at=None)
    assert fast().seconds_until_due() is None and ORM.seconds_until_due() is None
