"""Preparing a proposal again from current inputs: which steps run again, and where from.

A proposal is prepared from the memos of earlier steps (``Step.prepared_from``; by
default every step before the action). When it must be prepared again because its
inputs changed (the workflow's ``input_version`` differs from the one the proposal was
prepared from), reusing those memos would carry the old values into the new proposal,
so they are set aside (their costs stay counted) and the job goes back to the start of
the first of them. When the inputs did not change (an expiry, a hash that no longer
matches), only the action step runs again.

``context_for`` rebuilds a step's Context from stored state, for the hooks called
outside the step (the input version, the approval predicate, the current record).
"""

import logging

from ..core.identity import version_text
from ..core.states import prepare_again_plan
from ..models import StepResult
from ..steps.context import Context
from ..store import ledger, locking

logger = logging.getLogger("durable.approvals")


def context_for(job, st, db_now=None):
    """Rebuild a step's Context from stored state (for hooks called outside the step)."""
    step_memos = dict(StepResult.objects.filter(job_id=job.pk).values_list("step", "output"))
    return Context(
        job_id=job.pk, workflow=job.workflow, step=st.name, attempt=max(job.attempts, 1),
        payload=job.payload, memos=step_memos, db_now=db_now or locking.db_now(),
    )


def inputs_changed(job, st, approval):
    """Whether the inputs changed since ``approval`` was prepared (an error counts as changed)."""
    if approval is None:
        return False
    try:
        current = version_text(job.definition.input_version(job, context_for(job, st)))
    except Exception:  # noqa: BLE001 - an unverifiable input is not a current one
        return True
    return current != approval.input_version


def plan(job, step_name, approval, own_start):
    """``(state to go to, [steps that run again], [their memos as history rows])``."""
    st = job.definition.steps_by_name[step_name]
    target, steps = prepare_again_plan(job.table, st)
    if not steps or not inputs_changed(job, st, approval):
        return own_start, [], []
    rows = [{"step": m.step, "cost": str(m.cost), "attempt": m.attempt, "at": m.at.isoformat()}
            for m in job.steps.filter(step__in=steps).order_by("at", "pk")]
    return target, steps, rows


def carry_out(job, steps):
    """After the job moved: delete the stale memos (their costs stay in the rollups)."""
    if steps:
        ledger.set_aside(job.pk, steps)
        logger.info("job=%s memos of %s set aside: the proposal is prepared again from current"
                    " inputs", job.pk, ", ".join(steps))
