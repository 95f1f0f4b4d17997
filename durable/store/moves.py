"""Named moves: what a job's state move writes besides the state, each under a name.

A move that takes a job out of a worker's hands ends the worker's lease and says when
the job is due to be claimed next; some also reset the attempt count, record or clear
the error, or keep the result. Which columns that is belongs here: callers name the
move (``transition(job, state, move=moves.hand_over())``), never a lease column.

    hand_over(error=)        not due: the dispatcher, a person or a signal has the job, or it stopped
    run_again(error=)        due now, from a fresh attempt count
    retry_at(when, error)    due at ``when``, the attempt count kept
    wait_until(until, ...)   due at ``until`` (a timer, a wait's deadline; None: only a wake)
    step_done(terminal, ..)  a step's outcome recorded: the next step due now, or the result kept
    keep_lease(attempts=, ..) only a count or a note changes; a lease held stands
    hand_back(attempts)      a draining worker stops mid-step: due now, its attempt given back
"""

import dataclasses
from dataclasses import dataclass

from django.db.models.functions import Now


class _Keep:
    def __repr__(self):
        return "KEEP"


KEEP = _Keep()  # the column is left as it is
# The worker's hold on a job; a move that hands the job on clears both.
LEASE_COLUMNS = ("lease_until", "lease_owner")


@dataclass(frozen=True)
class Move:
    """The columns one move writes besides ``state`` and ``updated``; ``KEEP`` leaves one as it is."""

    name: str
    ends_lease: bool = True
    due: object = KEEP  # next_run_at: None (not due), Now(), a time
    attempts: object = KEEP
    error: object = KEEP  # last_error
    wake_at: object = KEEP
    result: object = KEEP
    awaiting: object = KEEP
    also: tuple = ()  # other columns of the job the move sets, as (column, value) pairs

    def setting(self, **columns):
        """This move, also setting other columns of the job (a grant's turn limit, say)."""
        named = set(columns) & set(LEASE_COLUMNS)
        if named:
            raise ValueError(f"a move ends the lease itself; do not set {', '.join(sorted(named))}")
        return dataclasses.replace(self, also=self.also + tuple(columns.items()))

    def columns(self):
        """``{column: value}`` for the UPDATE that makes this move."""
        written = dict.fromkeys(LEASE_COLUMNS) if self.ends_lease else {}
        for column, value in (("next_run_at", self.due), ("attempts", self.attempts),
                              ("last_error", self.error), ("wake_at", self.wake_at),
                              ("result", self.result), ("awaiting", self.awaiting)):
            if value is not KEEP:
                written[column] = value
        written.update(self.also)
        return written


def hand_over(*, error=KEEP):
    """The job leaves the worker and is not due: someone else has it now, or it stopped.

    The dispatcher (an action in flight), a person (approval, needs_human, failed,
    cancelled) or a signal will move it on; no worker claims it until then.
    """
    return Move("hand over", due=None, error=error)


def run_again(*, error=KEEP):
    """The job is due now, from a fresh attempt count (a requeue, a decision, a resume)."""
    return Move("run again", due=Now(), attempts=0, error=error)


def retry_at(when, *, error):
    """The step failed and is retried at ``when``; the attempt count stands."""
    return Move("retry", due=when, error=error)


def wait_until(until, *, wake_at=KEEP, awaiting=KEEP):
    """The job waits: due at ``until`` (None: only a wake moves it), maybe on ``awaiting``."""
    return Move("wait", due=until, wake_at=wake_at, awaiting=awaiting)


def step_done(*, terminal, result=KEEP):
    """A step's outcome is recorded: the next step is due now, or (``terminal``) the result is kept."""
    return Move("step done", due=None if terminal else Now(), attempts=0, wake_at=None, error="",
                result=result if terminal else KEEP)


def keep_lease(*, attempts=KEEP, error=KEEP):
    """Only the attempt count or the error note changes besides the state; a lease held stands."""
    return Move("keep lease", ends_lease=False, attempts=attempts, error=error)


def hand_back(attempts, due=None):
    """A run stops between two calls: due now (a draining worker) or at ``due`` (a call waits
    its turn under a provider limit), the lease ended, and ``attempts`` one less, so the
    next claim counts the same attempt again."""
    return Move("hand back", due=Now() if due is None else due, attempts=max(0, int(attempts) - 1))


__all__ = ["KEEP", "LEASE_COLUMNS", "Move", "hand_back", "hand_over", "keep_lease", "retry_at", "run_again",
           "step_done", "wait_until"]
