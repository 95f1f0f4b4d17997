"""Property-based abuse (hypothesis): any payload, any order of operator and worker events.

The state machine drives one job of ``drill_chaos`` through random sequences of worker
steps (succeed, retryable failure, poison, needs a human, durable wait), workers that
die after claiming or mid-job, time passing (leases and timers expiring), stale workers
trying to commit after their lease passed, operator verbs, and attempts at illegal
edges. After every event: the state is in the table, a terminal job never moves again,
every recorded move is an edge of the table, no illegal edge ever succeeds, a stale
worker writes nothing, and no job is lost (a job workers must run is always due).
"""

import datetime
import itertools
import json
import os
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import durable
from durable.core.identity import same_json
from durable.core.states import StateKind
from durable.core.workflows import registry
from durable.engine.runner import Runner
from durable.exceptions import IllegalTransition, OperatorError, PayloadInvalid
from durable.models import Job, JobEvent, StepResult
from durable.store import locking
from durable.verbs import jobs as services
from tests.testapp.drill_workflows import CHAOS

pytestmark = pytest.mark.django_db

_keys = itertools.count()
PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("DURABLE_PROPERTY_EXAMPLES", 25)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Submit payloads -----------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=25,
)
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


@PROPERTY_SETTINGS
@given(payload=json_values)
def test_submit_refuses_exactly_the_payloads_a_database_cannot_store_and_stores_the_rest(payload):
    key = f"p-{next(_keys)}"
    # None would be SQL NULL, not JSON null: refused with a message, like NUL characters.
    unstorable = payload is None or bool(_NUL.search(json.dumps(payload)))
    try:
        durable.submit("recorded", key, payload)
    except PayloadInvalid as exc:
        assert unstorable, f"refused a storable payload: {exc}"
        assert not Job.objects.filter(pk=key).exists()
        return
    assert not unstorable
    # Equal as JSON: PostgreSQL may give a float back as an int of the same value.
    assert same_json(Job.objects.get(pk=key).payload, json.loads(json.dumps(payload)))
    # Idempotent: the same payload again is the same job, never a conflict.
    assert durable.submit("recorded", key, payload).pk == key
    assert JobEvent.objects.filter(job_id=key).count() == 1


@PROPERTY_SETTINGS
@given(first=json_values, second=json_values)
def test_a_resubmission_with_another_payload_never_changes_the_stored_one(first, second):
    key = f"p-{next(_keys)}"
    try:
        durable.submit("recorded", key, first)
    except PayloadInvalid:
        return
    stored = Job.objects.get(pk=key).payload
    try:
        durable.submit("recorded", key, second)
    except (PayloadInvalid, durable.IdempotencyConflict):
        pass
    assert same_json(Job.objects.get(pk=key).payload, stored)


# Operator actions and worker events against the transition table -----------------------

TABLE = registry.get("drill_chaos").table
STATES = sorted(TABLE.kinds)
OUTCOMES = ["ok", "ok", "retry", "poison", "human", "wait"]
# States in which workers must eventually run the job: never without a due time.
MUST_BE_DUE = (StateKind.INITIAL, StateKind.READY, StateKind.TIMER, StateKind.WORKING)


def past():
    return locking.db_now() - datetime.timedelta(seconds=1)


class JobUnderAbuse(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.key = None
        self.worker = Runner(f"vm:{os.getpid()}:worker0")
        self.stale = []  # claims whose worker was left holding them (it "died" or stalled)
        self.finished_as = None

    @initialize()
    def submit(self):
        self.key = f"chaos-{next(_keys)}"
        # A queue of its own: the worker must not pick up jobs of earlier examples.
        durable.submit("drill_chaos", self.key, {}, queue=self.key)

    def job(self):
        return Job.objects.get(pk=self.key)

    # Workers ----------------------------------------------------------------------------

    @rule(outcome=st.sampled_from(OUTCOMES), dies_after=st.booleans())
    def a_worker_runs_one_step(self, outcome, dies_after):
        CHAOS[self.key] = outcome
        started = self.worker.claim(queues=[self.key])
        if started is None:
            CHAOS.pop(self.key, None)
            return
        following = self.worker.run_step(started)
        if following is not None:
            if dies_after:
                self.stale.append(following)  # holds the lease of the next step, then dies
            else:
                self.worker.run(following)

    @rule()
    def a_worker_dies_right_after_claiming(self):
        started = self.worker.claim(queues=[self.key])
        if started is not None:
            self.stale.append(started)

    @rule()
    def time_passes(self):
        # Leases expire and timers and backoffs fall due, on the database clock.
        Job.objects.filter(pk=self.key, lease_until__isnull=False).update(lease_until=past())
        Job.objects.filter(pk=self.key, next_run_at__isnull=False).update(next_run_at=past())

    @rule(outcome=st.sampled_from(OUTCOMES))
    def a_stale_worker_tries_to_commit(self, outcome):
        assume(self.stale)
        started = self.stale.pop()
        job = self.job()
        lost = job.lease_token != started.claimed.lease_token or job.lease_until is None or (
            job.lease_until < locking.db_now())
        events, memos = JobEvent.objects.count(), StepResult.objects.count()
        CHAOS[self.key] = outcome
        self.worker.run_step(started)
        CHAOS.pop(self.key, None)
        if lost:
            written = list(JobEvent.objects.order_by("id").values_list(
                "kind", "from_state", "to_state", "actor")[events:])
            assert (JobEvent.objects.count(), StepResult.objects.count()) == (events, memos), (
                f"a worker whose lease had passed committed {written}; the job was {job.state} "
                f"token {job.lease_token} until {job.lease_until}, the worker's token "
                f"{started.claimed.lease_token}, now {locking.db_now()}")
            assert self.job().state == job.state

    # Operators --------------------------------------------------------------------------

    @rule(verb=st.sampled_from(["requeue", "retry_now", "cancel", "send_back"]))
    def an_operator_acts(self, verb):
        try:
            getattr(services, verb)(self.key, user="ops", reason="property test")
        except OperatorError:
            pass  # refused, with a message: nothing changed

    @rule(to=st.sampled_from([*STATES, "no_such_state"]))
    def an_illegal_edge_is_refused_and_changes_nothing(self, to):
        job = self.job()
        assume(not TABLE.allows(job.state, to))
        before = Job.objects.filter(pk=self.key).values().get()
        events = JobEvent.objects.filter(job_id=self.key).count()
        with pytest.raises(IllegalTransition):
            locking.transition(job, to, actor="property test", table=TABLE)
        assert Job.objects.filter(pk=self.key).values().get() == before
        assert JobEvent.objects.filter(job_id=self.key).count() == events

    # Invariants -------------------------------------------------------------------------

    @invariant()
    def the_state_is_in_the_table(self):
        if self.key:
            assert self.job().state in TABLE.kinds

    @invariant()
    def a_terminal_job_never_moves_again(self):
        if not self.key:
            return
        job = self.job()
        if self.finished_as is not None:
            assert job.state == self.finished_as
        elif TABLE.is_terminal(job.state):
            self.finished_as = job.state
            assert job.next_run_at is None and job.lease_owner is None

    @invariant()
    def every_recorded_move_is_an_edge_of_the_table(self):
        if not self.key:
            return
        moves = JobEvent.objects.filter(job_id=self.key).exclude(from_state="").values_list(
            "from_state", "to_state", "data")
        for frm, to, data in moves:
            # A step that continues records the state it passed through ("via").
            via = (data or {}).get("via") if isinstance(data, dict) else None
            path = [frm, via, to] if via else [frm, to]
            assert frm == to or all(TABLE.allows(a, b) for a, b in itertools.pairwise(path)), (
                f"{' -> '.join(path)} is not in the table")

    @invariant()
    def no_job_is_lost(self):
        if not self.key:
            return
        job = self.job()
        kind = TABLE.kinds[job.state]
        if kind in MUST_BE_DUE:
            assert job.next_run_at is not None, f"{job.state} with nothing scheduled: lost"
        else:
            assert kind in (StateKind.TERMINAL, StateKind.FAILED, StateKind.HUMAN)

    @invariant()
    def memos_are_one_per_step_and_only_for_steps_that_finished(self):
        if not self.key:
            return
        steps = list(StepResult.objects.filter(job_id=self.key).values_list("step", flat=True))
        assert len(steps) == len(set(steps))
        assert steps == ["a", "b", "c"][: len(steps)]


def test_random_operator_actions_and_worker_events_keep_every_job_inside_its_table():
    run_state_machine_as_test(
        JobUnderAbuse,
        settings=settings(
            PROPERTY_SETTINGS, max_examples=int(os.environ.get("DURABLE_PROPERTY_EXAMPLES", 25)),
            stateful_step_count=30,
        ),
    )
