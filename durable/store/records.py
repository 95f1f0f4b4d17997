"""What the store's moves take and hand back, whichever database runs them.

A claim hands back a ``Claimed`` job or ``ClaimedAction`` rows; a step's commit takes a
``StepCommit``, an agent call's a ``MemoCommit``, a confirmed action's a ``Success``.
Every database class (``durable.store.base.Database`` and its subclasses) builds and
reads these same shapes, so a caller never learns which one ran. A submit takes a job's
head start and a claim its reach, both from ``DURABLE["PRIORITY_AGING"]``.
"""

import dataclasses
import datetime
import json
import math
from decimal import Decimal

from django.core.exceptions import ImproperlyConfigured
from django.utils.dateparse import parse_datetime

from ..conf import durable_settings
from ..core.states import RESUMING_KINDS, WOKEN, StateKind
from ..models import EventKind
from ..models.priorities import MIN_PRIORITY

# NOTIFY channel of idle workers (on a database that notifies); its payload is the workflow.
JOBS_CHANNEL = "durable_jobs"
# NOTIFY channel of idle dispatchers; its payload is the job id.
OUTBOX_CHANNEL = "durable_outbox"

MICROSECOND = datetime.timedelta(microseconds=1)
# A job of priority 0: the claim counts it due when it is due (``Job.head_start``).
NO_HEAD_START = datetime.timedelta(0)
# The most PRIORITY_AGING may be (seconds per priority step): at a day per step a priority
# already outweighs a hundred days of waiting, and far larger head starts would overflow
# the interval PostgreSQL stores and the moments the claim orders by.
MAX_PRIORITY_AGING = 86400.0


# Priorities ---------------------------------------------------------------------------------


def priority_aging():
    """``DURABLE["PRIORITY_AGING"]`` in seconds; ImproperlyConfigured, naming it, unless from 0 to a day."""
    value = durable_settings.PRIORITY_AGING
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or not 0 <= value <= MAX_PRIORITY_AGING):
        raise ImproperlyConfigured(
            f"DURABLE['PRIORITY_AGING'] must be a number of seconds per priority step from 0 to"
            f" {MAX_PRIORITY_AGING:g}; got {value!r}."
        )
    return float(value)


def head_start(priority):
    """How much earlier than it falls due the claim counts a job of ``priority`` due (later, below 0).

    Fixed when the job is submitted (``Job.head_start``): the claim's index holds the
    order it makes, so a change of the setting applies to the jobs submitted after it.
    """
    return datetime.timedelta(seconds=priority * priority_aging())


def claim_reach():
    """Seconds past now that the claim reads its order to: the most a job can be counted late.

    A due job of the lowest priority is counted ``-MIN_PRIORITY x aging`` late, so every
    due job is within this reach, and the claim's index is read as a range that ends
    there, not to its end when nothing is due. A job submitted under a larger aging than
    today's comes within reach that much later (a bounded delay, never a lost job).
    """
    return -MIN_PRIORITY * priority_aging()


def aware(value):
    """A datetime as the database returned it (SQLite: UTC text without an offset), aware."""
    if value is None:
        return None
    if not isinstance(value, datetime.datetime):
        value = parse_datetime(value)
    return value.replace(tzinfo=datetime.UTC) if value.tzinfo is None else value


def step_figures(cost, duration):
    """A step's cost and duration as returned raw: typed, or as SQLite stores them
    (a number, and an integer of microseconds)."""
    if not isinstance(duration, datetime.timedelta):
        duration = datetime.timedelta(microseconds=int(duration or 0))
    return Decimal(str(cost or 0)), duration


# Jobs ---------------------------------------------------------------------------------------


class Claimed:
    """A job row as the claim returned it, plus the lease this worker now holds."""

    __slots__ = (
        "id", "workflow", "state", "attempts", "lease_token", "payload", "wake_at",
        "db_now", "previous_owner", "owner", "started_step", "parent_id", "created", "fresh",
        "concurrency_key", "concurrency_seq",
    )

    def __init__(self, started_step=None, parent_id=None, created=None, concurrency_key=None,
                 concurrency_seq=None, **kw):
        self.started_step = started_step
        self.parent_id = parent_id
        # The job's concurrency key and its number under it (``durable.core.concurrency``).
        self.concurrency_key = concurrency_key
        self.concurrency_seq = concurrency_seq
        self.created = created  # when the job was submitted (the database's stamp)
        for k, v in kw.items():
            setattr(self, k, v)
        # Whether this is the job's first lease (the token only ever grows): nothing ran,
        # waited or was retried before it, so there is no earlier history to read.
        self.fresh = self.lease_token == 1

    @property
    def pk(self):
        return self.id

    @classmethod
    def of_row(cls, row, owner, previous_owner, started_step):
        """From a claim's row: id, workflow, state, attempts, lease_token, payload, wake_at,
        now, ..., parent_id, created, concurrency_key, concurrency_seq (the last four last,
        whatever comes between)."""
        return cls(
            id=row[0],
            workflow=row[1],
            state=row[2],
            attempts=row[3],
            lease_token=row[4],
            payload=json.loads(row[5]) if isinstance(row[5], str) else row[5],
            wake_at=aware(row[6]),
            db_now=aware(row[7]),
            previous_owner=previous_owner,
            owner=owner,
            started_step=started_step,
            parent_id=row[-4],
            created=aware(row[-3]),
            concurrency_key=row[-2],
            concurrency_seq=row[-1],
        )


class Starts:
    """Where a claim starts each state a worker runs from: (workflow, state) -> step.

    The claim applies it in the same write, so a job is claimed and its step started
    at once. States not in it (a working state whose lease expired, an unknown
    workflow) are left to the runner.
    """

    def __init__(self, definitions):
        self.by_state = {}
        for definition in definitions:
            table = definition.table
            for state, kind in table.kinds.items():
                if kind in (StateKind.INITIAL, StateKind.READY):
                    states, woken = table.step_starting_at(state), None
                elif kind in RESUMING_KINDS:
                    states, woken = table.step_of(state), WOKEN[kind]
                else:
                    continue
                if states is not None:
                    self.by_state[(definition.name, state)] = (states.working, states.step, woken)
        rows = [(wf, state, working, step, woken is not None, woken or "")
                for (wf, state), (working, step, woken) in self.by_state.items()]
        self.arrays = {
            f"start_{name}": [row[i] for row in rows]
            for i, name in enumerate(("workflows", "states", "working", "steps", "timers",
                                      "messages"))
        }

    def start(self, workflow, state):
        """(working state, step, wake-up message or None) for a job claimed in ``state``."""
        return self.by_state.get((workflow, state), (None, None, None))


NO_STARTS = Starts(())


@dataclasses.dataclass(frozen=True, slots=True)
class StepCommit:
    """What the commit of one finished step writes (see ``locking.complete_step``)."""

    step: str                     # the step that finished
    actor: str                    # who ran it, for its event
    lease_seconds: float          # the lease kept (``keep``) or taken by a chained claim
    output_json: str              # its output: the memo, and the job's result when terminal
    cost: Decimal
    duration: datetime.timedelta
    attempt: int                  # the attempt that produced the output
    data_json: str                # the event's data
    keep: bool = False            # the job runs its next step here: the lease is renewed
    terminal: bool = False        # the job ends: its result is written, it is never due again
    write_memo: bool = True       # False when the memo exists already (the step was not re-run)
    kind: str = EventKind.STEP_DONE.value


@dataclasses.dataclass(frozen=True, slots=True)
class MemoCommit:
    """One model or tool call's memo, as ``locking.commit_memo`` writes it."""

    key: str                      # the call's memo key (StepResult.step)
    kind: str                     # model or tool
    name: str
    seq: int                      # its place among the job's calls
    turn: int
    fingerprint: str              # what was asked, to check a replay asks the same
    output_json: str
    cost: Decimal
    input_tokens: int
    output_tokens: int
    model: str
    duration: datetime.timedelta
    attempt: int
    workflow: str


# Outbox rows --------------------------------------------------------------------------------

# The columns every action claim returns, in order; the last three are the producing
# step's, which the action's memo carries.
ACTION_COLUMNS = ("id", "job_id", "kind", "destination", "operation", "payload",
                  "idempotency_key", "status", "attempts", "lookups", "lease_token", "version",
                  "last_error", "step_key", "step_cost", "step_duration", "step_attempt")
# What a claim also says of each row, from the pick: the lease's previous owner, the job's
# workflow and its parent (the writes around a send need no read of the job for them).
JOB_COLUMNS = ("previous_owner", "workflow", "parent_id")


class ClaimedAction:
    """An outbox row as the claim returned it, plus the lease this dispatcher holds.

    Besides the row's own columns (``ACTION_COLUMNS``) it knows its job's workflow and
    parent and who held the lease before (``JOB_COLUMNS``).
    """

    def __init__(self, values, previous_owner, workflow, parent_id):
        for name, value in zip(ACTION_COLUMNS, values, strict=True):
            setattr(self, name, value)
        if isinstance(self.payload, str):
            self.payload = json.loads(self.payload)
        self.step_cost, self.step_duration = step_figures(self.step_cost, self.step_duration)
        self.previous_owner = previous_owner
        self.workflow = workflow
        self.parent_id = parent_id

    pk = property(lambda self: self.id)


@dataclasses.dataclass(frozen=True, slots=True)
class Success:
    """What ``action_rows.record_success`` writes for a confirmed action (its memo is the step's)."""

    remote_id: str
    summary: str                  # the row's response summary, redacted
    memo_json: str                # the step's memo: the job's result too when ``terminal``
    done: str                     # the step's done state
    terminal: bool
    actor: str
    message: str                  # the step's event
    data_json: str                # its data
