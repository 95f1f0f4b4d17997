"""What a run hands back to the engine: an outcome the runner matches, never a call back.

A step's function returns a value (or raises ``NeedsHuman``/``Wait``); an agent's run
(``durable.agents.run``) returns one of these. The runner (``durable.engine.runner``)
matches it and makes the move; the run itself writes nothing that ends the step.
"""

import datetime
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Seat:
    """What a run is given of the worker that runs it: who it is, its lease, its watch."""

    owner: str
    lease_seconds: float
    heartbeat: object = None  # renews the lease and enforces the step timeout (None: inline)
    on_timeout: Callable = None
    # ``locking.commit_memo``'s equal that groups the memos of the process's runs (None: alone).
    commit_memo: Callable = None
    # Gives the thread's database connection back before the run waits (None: it keeps it).
    release: Callable = None
    # True once the worker drains: the run stops before its next paid call (None: never).
    stopping: Callable = None


@dataclass(frozen=True)
class Done:
    """The run returned: its output (as stored JSON) completes the step."""

    output_json: str
    duration: datetime.timedelta


@dataclass(frozen=True)
class AskHuman:
    """The run needs a person: the job parks in needs_human with the reason."""

    reason: str


@dataclass(frozen=True)
class Parked:
    """The run waits (a signal, child jobs, a timer): the job parks until it is woken."""

    waiting: object  # a durable.core.workflows.WaitingOn


@dataclass(frozen=True)
class Left:
    """The job left the worker already (an action handed to the dispatcher, proposals to decide)."""

    outcome: str


@dataclass(frozen=True)
class Lost:
    """The lease was lost: another worker has the job; write nothing more."""


@dataclass(frozen=True)
class HandedBack:
    """The worker drains: the run stopped between two calls; the job is due again for any worker."""

    calls: int  # the calls recorded so far, kept as memos


@dataclass(frozen=True)
class Throttled:
    """A call waits its turn under a provider limit: the job is due again at ``until``."""

    until: datetime.datetime
    why: str
    calls: int  # the calls recorded so far, kept as memos


@dataclass(frozen=True)
class Interrupted:
    """A job submitted later under the run's concurrency key interrupts it: the job is cancelled."""

    by: str  # the job that interrupted it
    calls: int  # the calls recorded so far, kept as memos


@dataclass(frozen=True)
class Failed:
    """The run raised: the step's retry policy decides what happens."""

    error: BaseException
    seconds: float


__all__ = ["AskHuman", "Done", "Failed", "HandedBack", "Interrupted", "Left", "Lost", "Parked", "Seat", "Throttled"]
