"""What a job that stops early leaves behind: withdrawn before it leaves the system.

A cancelled or interrupted job's actions not sent yet are cancelled, its approvals not
decided are superseded, and its model calls waiting under a provider limit give their
share back (a concurrent slot it held wakes the next run). Anything already sent stays
as it is, visible.
"""

from django.db.models.functions import Now

from ..models import Approval, ApprovalStatus, Outbox, OutboxStatus, Reservation, ReservationState
from . import limits


def withdraw(job_id, why):
    """Withdraw ``job_id``'s pending actions, approvals and limit reservations, in the caller's transaction."""
    Outbox.objects.filter(job_id=job_id, status=OutboxStatus.PENDING).update(
        status=OutboxStatus.CANCELLED, next_attempt_at=None, last_error=why)
    Approval.objects.filter(job_id=job_id, status=ApprovalStatus.REQUESTED).update(
        status=ApprovalStatus.SUPERSEDED, note=why)
    open_ = Reservation.objects.filter(job_id=job_id, state__in=[*ReservationState.waiting(),
                                                                 ReservationState.CALLING])
    slots = set(open_.filter(state=ReservationState.CALLING).values_list("limit", flat=True))
    open_.update(state=ReservationState.RELEASED, settled_at=Now())
    for name in slots:
        limits.wake_queued(name)
