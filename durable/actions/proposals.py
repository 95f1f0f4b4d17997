"""Proposals and who decides them: closing one, whether a user may decide, what a model is told.

What every part that handles approvals shares (the decisions themselves are
``durable.actions.approvals``; each action kind settles them its own way,
``durable.actions.kinds``).
"""

from ..models import Approval, EventKind, JobEvent

PERMISSION = "durable.approve_proposal"
CHANGED = "This proposal changed since you opened it; review the current one."
# What an agent's model is told of a rejected tool call, unless the decider writes
# otherwise: nothing of the decider's internal note.
MODEL_MESSAGE = ("A reviewer declined this action, so it was not carried out. Do not try it"
                 " again; tell the user it could not be done this way.")


def close(approval, status, note):
    """Mark an open or approved proposal superseded or expired (inside a transaction)."""
    Approval.objects.filter(pk=approval.pk).update(
        status=status, note=(approval.note + "\n" if approval.note else "") + note
    )
    approval.status = status
    JobEvent.objects.create(
        job_id=approval.job_id, kind=EventKind.APPROVAL, step=approval.step, actor="durable",
        message=f"approval {approval.pk} {status}: {note}",
        data={"approval": approval.pk, "hash": approval.proposal_hash},
    )


def is_person(user):
    """Whether ``user`` is a person's account (code and the CLI pass a name or None)."""
    return user is not None and not isinstance(user, str) and getattr(user, "pk", None)


def can_decide(user):
    """Whether ``user`` may approve or reject proposals (code and the CLI pass a name)."""
    if user is None or isinstance(user, str):
        return True
    return user.is_active and user.has_perm(PERMISSION)


__all__ = ["CHANGED", "MODEL_MESSAGE", "PERMISSION", "can_decide", "close", "is_person"]
