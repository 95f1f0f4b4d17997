"""Approvals: a person's decision bound to one proposal by its hash, with an expiry.

Models of the ``durable`` app like those of ``durable.models``, which imports them (use
them from there); ``durable.approvals`` decides them and the console's approval pages
show them.
"""

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class ApprovalStatus(models.TextChoices):
    REQUESTED = "requested", _("requested")  # waiting for a decision
    APPROVED = "approved", _("approved")  # a person approved exactly this proposal
    REJECTED = "rejected", _("rejected")  # a person refused it
    EXPIRED = "expired", _("expired")  # nobody decided in time, or approval came too late
    SUPERSEDED = "superseded", _("superseded")  # inputs or values changed; a new proposal replaced it


class ApprovalQuerySet(models.QuerySet):
    def pending(self):
        return self.filter(status=ApprovalStatus.REQUESTED)


class Approval(models.Model):
    """A human decision bound to one proposal by its hash, with an expiry."""

    job = models.ForeignKey("durable.Job", on_delete=models.CASCADE, related_name="approvals")
    # The step name, or for an agent the key of the exact tool call (t2/tool/<id>).
    step = models.CharField(_("step"), max_length=200)
    # An agent's proposals of one turn are decided together before the run resumes.
    turn = models.PositiveIntegerField(_("turn"), null=True, blank=True)
    proposal = models.JSONField(_("proposal"), encoder=DjangoJSONEncoder)
    proposal_hash = models.CharField(_("proposal hash"), max_length=64)
    input_version = models.CharField(_("input version"), max_length=255, blank=True, default="")
    summary = models.TextField(_("summary"), blank=True, default="")
    status = models.CharField(
        _("status"),
        max_length=max(len(v) for v in ApprovalStatus.values),
        choices=ApprovalStatus.choices,
        default=ApprovalStatus.REQUESTED,
    )
    requested_at = models.DateTimeField(_("requested at"), db_default=Now())
    expires_at = models.DateTimeField(_("expires at"))
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name=_("decided by"),
    )
    decided_at = models.DateTimeField(_("decided at"), null=True, blank=True)
    # The decider's note: the audit trail's, never shown to a model.
    note = models.TextField(_("note"), blank=True, default="")
    # An agent's tool call: what its model is told when the call is rejected.
    model_message = models.TextField(_("message to the model"), blank=True, default="")
    # An agent's tool call: the arguments the proposal was prepared from.
    arguments = models.JSONField(_("arguments"), encoder=DjangoJSONEncoder, null=True, blank=True)
    # An agent's tool call: the records it was prepared from, as read then (re-read before sending).
    sources = models.JSONField(_("prepared from"), encoder=DjangoJSONEncoder, default=list,
                               blank=True)
    # A proposal a person made by editing this one's arguments.
    edited_from = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="+",
        verbose_name=_("edited from"),
    )

    objects = ApprovalQuerySet.as_manager()

    class Meta:
        verbose_name = _("approval")
        verbose_name_plural = _("approvals")
        indexes = [models.Index(fields=["status", "requested_at"], name="durable_approval_queue")]
        constraints = [
            # At most one open request per job and step.
            models.UniqueConstraint(
                fields=["job", "step"],
                condition=Q(status="requested"),
                name="durable_one_open_approval",
            ),
        ]
        permissions = [("approve_proposal", "Can approve or reject proposals")]

    def __str__(self):
        return f"{self.job_id}/{self.step} [{self.status}]"
