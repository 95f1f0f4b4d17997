"""Run one claimed job: memo first, execute, commit memo and state advance together.

A worker that finishes a step continues the same job under its lease instead of
releasing and re-claiming it. Every write here is fenced by the lease token.

An action step's action goes to ``durable.actions.outbox``, which returns an outcome the
runner acts on. A workflow that drives its own run (an agent's, ``workflow.runs_itself``)
returns an outcome too (``durable.core.outcomes``), which ``_act_on`` matches; nothing
calls the runner back. Each move returns what the runner continues with (None: the job
has left this worker).
"""

import copy
import datetime
import json
import logging
import threading
import time
from decimal import Decimal

from django.db import DataError, transaction

from .. import faults
from ..actions import outbox
from ..conf import durable_settings
from ..core.identity import storable_json
from ..core.outcomes import AskHuman, Done, Failed, HandedBack, Interrupted, Left, Lost, Parked, Seat, Throttled
from ..core.retry import backoff, classify, describe, scrub
from ..core.states import RESUMING_KINDS, WOKEN, StateKind
from ..core.workflows import Action, NeedsHuman, Wait, WaitingOn, registry
from ..exceptions import LeaseLost, UnknownWorkflow
from ..models import EventKind, StepResult
from ..signals import job_finished, step_finished, step_started
from ..steps import limits as pacing
from ..steps.context import Context
from ..store import concurrency, locking, moves
from . import turns

logger = logging.getLogger("durable.worker")


class Started:
    """A claimed job with the step this worker is about to run."""

    __slots__ = ("claimed", "workflow", "table", "step", "states", "attempt", "memos")

    def __init__(self, claimed, workflow, step, states, attempt):
        self.claimed = claimed
        self.workflow = workflow
        self.table = workflow.table
        self.step = step
        self.states = states
        self.attempt = attempt
        self.memos = None


class Runner:
    """Executes steps of claimed jobs for one worker process."""

    def __init__(self, owner, heartbeat=None, lease_seconds=None, workflows=None, queues=None,
                 chain=True, drain=None, commits=None, release=None):
        self.owner = owner
        self.heartbeat = heartbeat
        self.lease_seconds = lease_seconds or durable_settings.LEASE_SECONDS
        self.workflows = workflows
        self.queues = queues
        # Claim the next job in the transaction that finishes the last one: a job then
        # costs one commit per step and nothing more.
        self.chain = chain
        # The drain flag (durable.engine.process.Drains): a worker's runners share its one flag.
        self.drain = drain or threading.Event()
        # A process with more runs in flight than connections: agents' memos share one
        # group commit (durable.engine.commits), and a thread gives its connection back
        # before it waits on a step or a call (durable.engine.connections).
        self.commits = commits
        self.release = release
        self._starts = None
        self._starts_generation = None

    @property
    def stopping(self):
        return self.drain.is_set()

    # Claiming and starting -------------------------------------------------------

    def claim(self, workflows=None, queues=None):
        """Claim a due job and start its next step, with one commit; None once stopping.

        Checked here, at the claim itself, because a slot may have spent a while on other
        work (firing schedules, rolling up costs) since its loop last looked.
        """
        if self.stopping:
            return None
        started = self._begin(self._claim_job(workflows, queues))
        if started is not None:
            faults.point("after_claim")
        return started

    def _begin(self, claimed):
        """Start a claimed job; the claim statement already started most (see locking.Starts)."""
        if claimed is None:
            return None
        if claimed.started_step is not None:
            return self._start(claimed)
        # A state the claim does not start (a lease that expired mid-step, an unknown
        # workflow): its bookkeeping is a transaction of its own.
        with transaction.atomic():
            return self._start(claimed)

    def _refresh_starts(self):
        if self._starts is None or self._starts_generation != registry.generation:
            self._starts_generation = registry.generation
            self._starts = locking.Starts(registry.all())
        return self._starts

    def _claim_job(self, workflows=None, queues=None):
        return locking.claim_job(self.owner, self.lease_seconds, workflows or self.workflows,
                                 queues or self.queues, self._refresh_starts(),
                                 stopping=self.drain.is_set)

    def _start(self, claimed):
        try:
            workflow = registry.get(claimed.workflow)
        except UnknownWorkflow as exc:
            self._park(claimed, f"{exc}. The job is parked; redeploy the workflow, then retry it.")
            return None
        table = workflow.table
        token = claimed.lease_token
        if claimed.started_step is not None:
            # The claim statement started the step (see locking.Starts).
            states = table.step_of(claimed.state)
            started = Started(claimed, workflow, workflow.steps_by_name[states.step], states,
                              claimed.attempts)
            if claimed.attempts == 1 and states.before == table.initial and claimed.wake_at is None:
                started.memos = {}  # a job that never ran has no memos: skip the lookup
            return started
        kind = table.kinds.get(claimed.state)
        if kind in (StateKind.INITIAL, StateKind.READY):
            states = table.step_starting_at(claimed.state)
            step = workflow.steps_by_name[states.step]
            attempt = claimed.attempts + 1
            ok = locking.transition(
                claimed, states.working, token=token, actor=self.owner, step=step.name,
                kind=EventKind.CLAIMED, message=f"attempt {attempt}", table=table,
                move=moves.keep_lease(attempts=attempt),
            )
        elif kind in RESUMING_KINDS:
            states = table.step_of(claimed.state)
            step = workflow.steps_by_name[states.step]
            attempt = max(claimed.attempts, 1)
            ok = locking.transition(
                claimed, states.working, token=token, actor=self.owner, step=step.name,
                kind=EventKind.CLAIMED, message=WOKEN[kind], table=table,
                move=moves.keep_lease(attempts=attempt),
            )
        elif kind == StateKind.WORKING:
            # The previous holder's lease expired mid-step: it died, stalled or was
            # partitioned. Its writes are fenced out; this run is a new attempt.
            states = table.step_of(claimed.state)
            step = workflow.steps_by_name[states.step]
            attempt = claimed.attempts + 1
            max_attempts = step.retry.resolved()[0]
            # No previous owner: the job was handed back between two calls (locking.hand_back),
            # by a draining worker or for a call's turn under a provider limit.
            message = (f"lease of {claimed.previous_owner} expired; attempt {attempt}"
                       if claimed.previous_owner else f"taken over after it was handed back; attempt {attempt}")
            if attempt > max_attempts:
                error = f"Worker lost {claimed.attempts} times while running {step.name} (lease expired)"
                self._fail(claimed, table, states, attempt - 1, error, kind=EventKind.FAILED)
                return None
            ok = locking.reclaim(claimed, attempt, actor=self.owner, step=step.name, message=message)
        else:
            # Not a state workers run (a human, the dispatcher or nobody owns it):
            # take it out of the claim index rather than spin on it.
            locking.park_job(claimed)
            return None
        if not ok:
            return None
        claimed.state = states.working
        claimed.attempts = attempt
        started = Started(claimed, workflow, step, states, attempt)
        if kind == StateKind.INITIAL and attempt == 1:
            started.memos = {}  # a job that never ran has no memos: skip the lookup
        return started

    def _park(self, claimed, message):
        locking.park_job(claimed, actor=self.owner, error=scrub(message))
        logger.error("%s job=%s parked: %s", self.owner, claimed.id, message)

    # Running -----------------------------------------------------------------------

    def run(self, started):
        """Run steps of one job until it leaves this worker (done, waiting, failed, lost)."""
        while started is not None:
            started = self.run_step(started)

    def _load_memos(self, job_id):
        return dict(StepResult.objects.filter(job_id=job_id).values_list("step", "output"))

    def run_step(self, started):
        if not turns.admitted(self, started):  # a job of a concurrency key waits its turn
            return None
        if started.workflow.runs_itself:
            # An agent workflow: run() from the top, one memo per call (durable.agents.run).
            seat = Seat(self.owner, self.lease_seconds, self.heartbeat, self.on_timeout,
                        commit_memo=self.commits and self.commits.commit_memo, release=self.release,
                        stopping=self.drain.is_set)
            return self._act_on(started, started.workflow.drive(started, seat))
        claimed, step = started.claimed, started.step
        if started.memos is None:
            started.memos = self._load_memos(claimed.id)
        memos = started.memos
        data = self._input_for(started)
        if step.name in memos:
            # Memo first: this step committed before (the job was sent back past it).
            logger.info("%s job=%s step=%s memo found, not re-run", self.owner, claimed.id, step.name)
            return self.complete(started, memos[step.name], Decimal(0), datetime.timedelta(0),
                                  write_memo=False)
        ctx = Context(
            job_id=claimed.id, workflow=started.workflow.name, step=step.name,
            attempt=started.attempt, payload=claimed.payload, memos=memos,
            db_now=claimed.db_now, wake_at=claimed.wake_at, lease_token=claimed.lease_token,
            enqueued_at=claimed.created, first_claim=claimed.fresh, worker=self.owner,
        )
        if step_started.receivers and step_started.has_listeners(started.workflow.name):
            step_started.send(started.workflow.name, job_id=claimed.id, step=step.name,
                              attempt=started.attempt, worker=self.owner)
        faults.point("before_step")
        began = time.monotonic()
        self._watch(started)
        try:
            with pacing.step_calls(claimed.id, claimed.lease_token, step.name, self.release):  # paced, budgeted
                returned = started.workflow.call_step(step, data, ctx)
        except (NeedsHuman, Wait, WaitingOn, pacing.Throttled) as signal_:
            return self._signalled(started, signal_)
        except LeaseLost:
            self.lost(started)
            return None
        except Exception as exc:  # noqa: BLE001 - every failure is classified below
            return self.fail_step(started, exc, time.monotonic() - began)
        finally:
            if self.heartbeat is not None:
                self.heartbeat.unwatch()
        duration = datetime.timedelta(seconds=time.monotonic() - began)
        faults.point("after_step_before_commit")
        cost, returned = returned.cost, returned.value
        if isinstance(returned, Action) or step.action:
            # An action step that returns anything else is refused there, clearly.
            return self._action(started, returned, ctx, cost, duration)
        try:
            output_json = storable_json(returned)
            output = json.loads(output_json)
            if cost < 0:
                raise ValueError(f"a step's cost must not be negative (got {cost})")
        except (TypeError, ValueError) as exc:
            # Deterministic: the same code would produce the same output again.
            return self.fail_step(started, type(exc)(f"step output refused, it is not storable JSON: {exc}"), 0)
        return self.complete(started, output, cost, duration, output_json=output_json)

    def _signalled(self, started, signal_):
        """A step stopped to wait: for a person, a time, a signal, children, or a model call's turn
        under a provider limit (the job is handed back, and the step runs again at its turn)."""
        if isinstance(signal_, NeedsHuman):
            return self.needs_human(started, signal_.reason)
        if isinstance(signal_, Wait):
            return self._wait(started, signal_)
        if isinstance(signal_, WaitingOn):
            return self.suspend(started, signal_)
        turns.hand_back(self, started, 0, signal_.until, signal_.why)
        return None

    def _watch(self, started):
        """The step begins: its lease is renewed and it is timed; it waits on no connection."""
        if self.release is not None:
            self.release()  # the step may wait on the network; its own queries borrow one
        if self.heartbeat is not None:
            self.heartbeat.watch(started, started.step.effective_timeout, self.on_timeout)

    def _act_on(self, started, outcome):
        """Make the move a driven run's outcome asks for; return what to continue with."""
        match outcome:
            case Done(output_json, duration):
                started.memos = {}  # the run wrote its own memos, call by call
                return self.complete(started, json.loads(output_json), Decimal(0), duration,
                                     write_memo=False, output_json=output_json)
            case AskHuman(reason):
                return self.needs_human(started, reason)
            case Parked(waiting):
                return self.suspend(started, waiting)
            case Left(how):
                self.finished(started, how)
                return None
            case Lost():
                self.lost(started)
                return None
            case HandedBack(calls):
                turns.hand_back(self, started, calls)
                return None
            case Throttled(until, why, calls):
                turns.hand_back(self, started, calls, until, why)
                return None
            case Interrupted(by, calls):
                turns.interrupt(self, started, by, calls)
                return None
            case Failed(error, seconds):
                return self.fail_step(started, error, seconds)
        raise TypeError(f"a run returned {outcome!r}, which is not an outcome (durable.core.outcomes)")

    def _input_for(self, started):
        index = started.workflow.steps.index(started.step)
        if index == 0:
            return started.claimed.payload
        return started.memos.get(started.workflow.steps[index - 1].name)

    # Committing ----------------------------------------------------------------------

    def complete(self, started, output, cost, duration, write_memo=True, output_json=None):
        """Write the memo and advance the state in one transaction; maybe continue.

        ``write_memo`` False: the memo exists already (or the driver wrote its own).
        """
        claimed, step, states, table = started.claimed, started.step, started.states, started.table
        nxt = table.step_starting_at(states.done)
        terminal = table.is_terminal(states.done)
        keep_going = nxt is not None and not self.stopping
        path = [states.done, nxt.working] if keep_going else [states.done]
        if terminal:
            faults.point("before_final_transition")
        # The next job's claim rides on the commit that finishes this one.
        chain = not keep_going and self.chain and not self.stopping
        try:
            ok, claimed_next = self._commit_step(started, path, output, cost, duration, write_memo,
                                                 keep_going, terminal, chain, output_json)
        except DataError as exc:
            # The database refused the values themselves (not an outage): retrying the
            # same output cannot help, so the step fails here instead of looping.
            return self.fail_step(started, exc, 0)
        if not ok:
            self.lost(started)
            return None
        following = self._begin(claimed_next)
        faults.point("after_final_transition" if terminal else "after_commit")
        started.memos[step.name] = output
        if logger.isEnabledFor(logging.DEBUG if keep_going else logging.INFO):
            # A line per job at INFO (its last step here); every step at DEBUG.
            logger.log(
                logging.DEBUG if keep_going else logging.INFO,
                "%s job=%s step=%s attempt=%d done in %.1fms cost=%s -> %s",
                self.owner, claimed.id, step.name, started.attempt,
                duration.total_seconds() * 1000, cost, claimed.state,
            )
        self.finished(started, "done")
        if terminal and job_finished.receivers and job_finished.has_listeners(started.workflow.name):
            job_finished.send(started.workflow.name, job_id=claimed.id, state=claimed.state)
        if not keep_going:
            if following is not None:
                faults.point("after_claim")
            return following
        started.step = started.workflow.steps_by_name[nxt.step]
        started.states = nxt
        started.attempt = 1
        claimed.attempts = 1
        claimed.wake_at = None
        return started

    def _commit_step(self, started, path, output, cost, duration, write_memo, keep_going, terminal,
                     chain, output_json):
        """One write (or, with ``chain``, one transaction with the next claim): (ok, next Claimed)."""
        claimed, step = started.claimed, started.step
        locking.check_path(started.table, claimed.workflow, claimed.state, path)
        if output_json is None:
            output_json = storable_json(output)
        # The event's data, written directly: a number and a Decimal's digits need no escaping.
        # One event per step: a step that continues records the state it passed through.
        via = f', "via": {json.dumps(path[0])}' if len(path) > 1 else ""
        data_json = (f'{{"attempt": {int(started.attempt)}, "cost": "{cost}", '
                     f'"ms": {round(duration.total_seconds() * 1000, 3)}{via}}}')
        commit = locking.StepCommit(
            step=step.name, actor=self.owner, lease_seconds=self.lease_seconds,
            output_json=output_json, cost=cost, duration=duration, attempt=started.attempt,
            data_json=data_json, keep=keep_going, terminal=terminal, write_memo=write_memo,
        )
        then_claim = (self.owner, self.workflows, self.queues, self._refresh_starts()) if chain else None
        if terminal and (claimed.parent_id is not None or claimed.concurrency_key is not None):
            # The finishing transaction wakes a parent's join, or the next job of a concurrency key.
            from ..steps.children import wake_parent

            with transaction.atomic():
                ok, claimed_next = locking.complete_step(claimed, path, commit, then_claim=then_claim)
                if ok and claimed.parent_id is not None:
                    wake_parent(claimed.parent_id, claimed.id)
                if ok and claimed.concurrency_key is not None:
                    concurrency.wake(claimed.concurrency_key)
        else:
            ok, claimed_next = locking.complete_step(claimed, path, commit, then_claim=then_claim)
        if ok:
            claimed.state = path[-1]
        return ok, claimed_next

    def _action(self, started, action, ctx, cost, duration):
        """Hand an action to the outbox in the completing transaction, and act on the outcome."""
        claimed = started.claimed
        outcome = outbox.enqueue(started, action, ctx, cost, duration, actor=self.owner)
        match outcome:
            case outbox.Confirmed(memo):
                return self.complete(started, memo, cost, duration)
            case outbox.Refused(exc):
                return self.fail_step(started, exc, duration.total_seconds())
            case outbox.Lost():
                self.lost(started)
                return None
            case outbox.Conflict(message):
                self._fail(claimed, started.table, started.states, started.attempt, message)
                self.finished(started, "failed")
                return None
            case outbox.Handed(message, key):
                logger.info("%s job=%s step=%s -> %s: %s (key %s)", self.owner, claimed.id,
                            started.step.name, claimed.state, message, key)
                self.finished(started, "action")
                return None
            case outbox.Proposed(message):
                logger.info("%s job=%s step=%s -> %s: %s", self.owner, claimed.id,
                            started.step.name, claimed.state, message)
                self.finished(started, "action")
                return None
        raise TypeError(f"the outbox returned {outcome!r}")

    def needs_human(self, started, reason):
        """Park the step for a person (its ``needs_human`` state), with the reason."""
        states = started.states
        if states.human is None:
            return self.fail_step(
                started,
                TypeError(f"step {started.step.name} raised NeedsHuman but is not declared "
                          f"with needs_human=True: {reason}"),
                0,
            )
        return self._park_step(started, states.human, scrub(reason), "needs_human",
                               EventKind.TRANSITION)

    def _wait(self, started, signal_):
        states = started.states
        if states.timer is None:
            return self.fail_step(
                started,
                TypeError(f"step {started.step.name} waited but is not declared with waits=True"),
                0,
            )
        until = signal_.until
        if until is None:
            until = started.claimed.db_now + datetime.timedelta(seconds=float(signal_.seconds))
        with transaction.atomic():
            ok = locking.transition(
                started.claimed, states.timer, token=started.claimed.lease_token,
                actor=self.owner, step=started.step.name, table=started.table,
                message=f"waiting until {until.isoformat()}",
                move=moves.wait_until(until, wake_at=until),
            )
        if not ok:
            self.lost(started)
            return None
        logger.info("%s job=%s step=%s waiting until %s", self.owner, started.claimed.id,
                    started.step.name, until.isoformat())
        self.finished(started, "waiting")
        return None

    def suspend(self, started, waiting):
        """Park the step on a signal or its children: no lease, due at the deadline or on a wake."""
        from ..steps.inbox import park

        states = started.states
        state, option, call = ((states.signal, "signals", "wait_for") if waiting.kind == "signal"
                               else (states.join, "joins", "join"))
        if state is None:
            return self.fail_step(
                started,
                TypeError(f"step {started.step.name} called ctx.{call}() but is not declared with "
                          f"{option}=True"),
                0,
            )
        until = waiting.deadline
        what = f"signal {waiting.name}" if waiting.kind == "signal" else (
            f"{len(waiting.data['children'])} children")
        with transaction.atomic():
            ok = locking.transition(
                started.claimed, state, token=started.claimed.lease_token, actor=self.owner,
                step=started.step.name, table=started.table,
                message=f"waiting for {what}" + (f" until {until.isoformat()}" if until else ""),
                move=moves.wait_until(until, awaiting=waiting.key),
            )
            if ok:
                park(started.claimed, waiting)
        if not ok:
            self.lost(started)
            return None
        logger.info("%s job=%s step=%s waiting for %s", self.owner, started.claimed.id,
                    started.step.name, what)
        self.finished(started, "waiting")
        return None

    def fail_step(self, started, exc, elapsed):
        """Classify ``exc`` by the step's retry policy: retry later, or fail the step."""
        decision = classify(exc, started.step.retry)
        error = describe(exc)
        details = getattr(exc, "event_data", None)  # see DurableError
        max_attempts, base, cap = started.step.retry.resolved()
        if decision.retryable and started.attempt < max_attempts:
            delay = decision.retry_after
            if delay is None:
                delay = backoff(started.attempt - 1, base, cap)
            return self._retry(started, error, delay, decision.reason, details)
        why = "poison" if not decision.retryable else f"gave up after {started.attempt} attempts"
        self._fail(started.claimed, started.table, started.states, started.attempt,
                   f"{error} ({why})", actor=self.owner, details=details)
        self.finished(started, "failed")
        return None

    def _retry(self, started, error, delay, reason, details=None):
        claimed, states = started.claimed, started.states
        with transaction.atomic():
            ok = locking.transition(
                claimed, states.before, token=claimed.lease_token, actor=self.owner,
                step=started.step.name, table=started.table, kind=EventKind.RETRY,
                message=error, data={**(details or {}), "attempt": started.attempt,
                                     "delay": round(delay, 3), "reason": reason},
                move=moves.retry_at(locking.now_plus(delay), error=error),
            )
        if not ok:
            self.lost(started)
            return None
        faults.point("during_backoff")
        logger.warning("%s job=%s step=%s attempt=%d retry in %.2fs: %s", self.owner, claimed.id,
                       started.step.name, started.attempt, delay, error)
        self.finished(started, "retry")
        return None

    def _fail(self, claimed, table, states, attempt, error, actor=None, kind=EventKind.FAILED,
              details=None):
        error = scrub(error)
        with transaction.atomic():
            ok = locking.transition(
                claimed, states.failure, token=claimed.lease_token, actor=actor or self.owner,
                step=states.step, table=table, kind=kind, message=error,
                data={**(details or {}), "attempt": attempt},
                move=moves.hand_over(error=error),
            )
        if ok:
            logger.error("%s job=%s step=%s failed -> %s: %s", actor or self.owner, claimed.id,
                         states.step, states.failure, error)
        return ok

    def _park_step(self, started, state, message, outcome, kind):
        claimed = started.claimed
        with transaction.atomic():
            ok = locking.transition(
                claimed, state, token=claimed.lease_token, actor=self.owner,
                step=started.step.name, table=started.table, kind=kind, message=message,
                move=moves.hand_over(error=message),
            )
        if not ok:
            self.lost(started)
            return None
        logger.info("%s job=%s step=%s -> %s: %s", self.owner, claimed.id, started.step.name,
                    state, message)
        self.finished(started, outcome)
        return None

    def lost(self, started):
        """The lease was lost (or the job moved): nothing of this run is recorded."""
        logger.warning(
            "%s job=%s step=%s: lease lost or job moved (cancelled?); result discarded",
            self.owner, started.claimed.id, started.step.name,
        )

    def finished(self, started, outcome):
        """Send ``step_finished`` for the step, with how it ended (done, action, waiting, …)."""
        if step_finished.receivers and step_finished.has_listeners(started.workflow.name):
            step_finished.send(started.workflow.name, job_id=started.claimed.id,
                               step=started.step.name, outcome=outcome,
                               state=started.claimed.state, worker=self.owner)

    # Timeouts (called from a thread of the heartbeat) ----------------------------------

    def on_timeout(self, started, elapsed):
        """Record a step past its timeout as a retryable failure, while its thread still runs.

        Fenced by the lease token like every write of this runner: the transition
        clears the lease, so the step thread's own commit, if it ever returns, is
        refused, and another worker (or another thread of this one) may take the job.
        The heartbeat then abandons the thread (see ``durable.engine.worker``).
        """
        from ..exceptions import StepTimeout

        exc = StepTimeout(f"step {started.step.name} ran {elapsed:.1f}s, past its timeout of "
                          f"{started.step.effective_timeout}s")
        # On copies: the step's thread still holds ``started`` and must find it as it
        # was, so that its late commit is refused by the fence and nothing else.
        mine = copy.copy(started)
        mine.claimed = copy.copy(started.claimed)
        self.fail_step(mine, exc, elapsed)
