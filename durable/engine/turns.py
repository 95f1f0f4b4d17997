"""A run that stops before its turn: handed back (draining, throttled) or interrupted.

The runner (``durable.engine.runner``) asks here before it runs a step of a job under a
concurrency key (``durable.store.concurrency.admit``), and acts here on a run that
stops between two calls: the job is handed back, due again when its turn comes, its
attempt not spent, or, interrupted by a later job of its key, cancelled with what it
recorded kept.
"""

import logging

from django.db import transaction

from ..core.states import CANCELLED
from ..store import concurrency, locking, moves
from ..store.withdrawal import withdraw

logger = logging.getLogger("durable.worker")


def admitted(runner, started):
    """True when the job may run its step now; else it was handed back or interrupted here."""
    claimed = started.claimed
    if claimed.concurrency_key is None:
        return True
    turn = concurrency.admit(claimed.id, claimed.concurrency_key, claimed.concurrency_seq)
    if turn.go:
        return True
    if turn.interrupted_by is not None:
        interrupt(runner, started, turn.interrupted_by, 0)
    else:
        hand_back(runner, started, 0, turn.due, turn.why)
    return False


def hand_back(runner, started, calls, until=None, why=""):
    """Stop between two calls, the job due again: now (the worker drains) or at ``until``
    (a call waits its turn under a provider limit or its concurrency key, on no thread)."""
    step = started.step.name
    if until is None:
        how, message = "handed back (draining)", (f"the worker drains: handed back after {calls} recorded"
                                                   " calls, for any worker to go on from the next")
    else:
        how, message = (f"throttled until {until.isoformat()}: {why}",
                        f"throttled until {until.isoformat(timespec='milliseconds')} after {calls}"
                        f" recorded calls: {why}")
    if locking.hand_back(started.claimed, actor=runner.owner, step=step, message=message, due=until):
        logger.info("%s job=%s step=%s %s after %d recorded calls", runner.owner, started.claimed.id,
                    step, how, calls)
        runner.finished(started, "handed back" if until is None else "throttled")
    else:
        runner.lost(started)


def interrupt(runner, started, by, calls):
    """A later job of the run's concurrency key interrupts it: cancel the job, its memos kept."""
    claimed = started.claimed
    message = (f"interrupted by job {by}, submitted later under concurrency key {claimed.concurrency_key}"
               f" (its workflow's when_busy is 'interrupt'); the {calls} calls it recorded are kept")
    with transaction.atomic():
        ok = locking.transition(claimed, CANCELLED, token=claimed.lease_token, actor=runner.owner,
                                step=started.step.name, message=message, move=moves.hand_over(),
                                table=started.table)
        if ok:
            withdraw(claimed.id, f"job interrupted by {by}")
    if ok:
        logger.info("%s job=%s interrupted by %s after %d recorded calls", runner.owner, claimed.id, by, calls)
        runner.finished(started, "interrupted")
    else:
        runner.lost(started)
