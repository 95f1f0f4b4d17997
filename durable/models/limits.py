"""Provider limits shared by every worker: a row per declared limit, a row per call it paced.

``DURABLE["LIMITS"]`` declares the limits (``durable.core.limits``); these rows are their
state, which every worker on every host reads and writes in short transactions
(``durable.store.limits``). Models of the ``durable`` app like those of
``durable.models``, which imports them (use them from there).
"""

import datetime

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class Limit(models.Model):
    """One declared limit's schedule: the next free moment of its requests and of its tokens.

    A call books the next free moment and moves it on by what it takes; a 429 from the
    provider pauses the limit for every worker until its Retry-After has passed. Moments
    are seconds since the epoch on the database's clock: each booking is one UPDATE that
    does its arithmetic on the locked row.
    """

    name = models.CharField(_("name"), max_length=100, primary_key=True)
    requests_free = models.FloatField(_("requests free at"), null=True, blank=True)
    tokens_free = models.FloatField(_("tokens free at"), null=True, blank=True)
    paused_until = models.FloatField(_("paused until"), null=True, blank=True)
    # The last booking: its moment and the tokens it reserved (what the UPDATE returns).
    booked = models.FloatField(_("last booked moment"), null=True, blank=True)
    booked_tokens = models.BigIntegerField(_("tokens last booked"), default=0)
    # The provider's tokens per token estimated from a request's characters, learnt from
    # the usage of the calls settled so far: a call reserves its estimate times this.
    token_ratio = models.FloatField(_("tokens per estimated token"), default=1.0)
    # The provider's last refusal (HTTP 429) and what it said.
    refused_at = models.DateTimeField(_("last refused"), null=True, blank=True)
    refusal = models.CharField(_("refusal"), max_length=500, blank=True, default="")
    refusals = models.PositiveBigIntegerField(_("refusals"), default=0)
    updated = models.DateTimeField(_("updated"), db_default=Now())

    class Meta:
        verbose_name = _("limit")
        verbose_name_plural = _("limits")

    def __str__(self):
        return self.name

    @staticmethod
    def moment(seconds):
        """A moment of the schedule as an aware datetime (None stays None)."""
        return None if seconds is None else datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)


class ReservationState(models.TextChoices):
    BOOKED = "booked", _("booked")  # a moment of the limit is the call's; it waits for it, throttled
    QUEUED = "queued", _("queued")  # every concurrent slot is taken: waits for one, throttled
    CALLING = "calling", _("calling")  # the call is in flight (holds a concurrent slot while its lease does)
    SETTLED = "settled", _("settled")  # the call was answered: its tokens are the reply's usage
    REFUSED = "refused", _("refused")  # the provider answered 429: the limit paused
    RELEASED = "released", _("released")  # given back unused: the call failed, its run died or moved on

    @classmethod
    def waiting(cls):
        return (cls.BOOKED, cls.QUEUED)


class Reservation(models.Model):
    """One model call's share of one limit: booked, in flight, then settled or given back.

    A call in flight holds a concurrent slot only while its job holds the lease it was
    made under (``lease_token``): a run that dies gives its slot back when its lease
    passes, with no one to clean up after it.
    """

    limit = models.CharField(_("limit"), max_length=100)
    job = models.ForeignKey("durable.Job", on_delete=models.CASCADE, related_name="reservations",
                            verbose_name=_("job"))
    key = models.CharField(_("call"), max_length=200)
    state = models.CharField(_("state"), max_length=max(len(v) for v in ReservationState.values),
                             choices=ReservationState.choices)
    lease_token = models.BigIntegerField(_("lease token"), default=0)
    # The moment booked for the call (database clock): it starts no earlier.
    starts_at = models.DateTimeField(_("starts at"), null=True, blank=True)
    tokens = models.PositiveIntegerField(_("tokens reserved"), default=0)
    # The request's tokens as estimated from its characters, before the limit's ratio.
    estimate = models.PositiveIntegerField(_("tokens estimated"), default=0)
    used_tokens = models.PositiveIntegerField(_("tokens used"), null=True, blank=True)
    priority = models.SmallIntegerField(_("priority"), default=0)
    created = models.DateTimeField(_("created"), db_default=Now())
    settled_at = models.DateTimeField(_("settled at"), null=True, blank=True)

    class Meta:
        verbose_name = _("reservation")
        verbose_name_plural = _("reservations")
        indexes = [
            # A run finds its own reservation of a call when it comes back.
            models.Index(fields=["job", "key"], name="durable_reservation_call"),
            # Calls in flight and runs waiting, per limit: the concurrent count, the queue.
            models.Index(fields=["limit", "state", "created"], name="durable_reservation_open",
                         condition=Q(state__in=["booked", "queued", "calling"])),
            # The limits page: each limit's use over the last hour.
            models.Index(fields=["limit", "created"], name="durable_reservation_use"),
        ]

    def __str__(self):
        return f"{self.limit} {self.job_id} {self.key} ({self.state})"
