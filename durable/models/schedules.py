"""The schedules' rows: where each declared schedule stands, and its decisions.

Models of the ``durable`` app like those of ``durable.models``, which imports them (use
them from there); ``durable.schedules.firing`` reads and writes them.
"""

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class ScheduleState(models.Model):
    """Where a declared schedule stands: the latest tick decided, its last run, a pause.

    The firer reads and writes it under a row lock; the jobs it submits are keyed by the
    schedule and the tick, so one tick is one job whatever happens to this row.
    """

    name = models.CharField(_("name"), max_length=100, primary_key=True)
    target = models.CharField(_("runs"), max_length=255, blank=True, default="")
    # The declaration that decides ticks ("cron 0 3 * * * Europe/Berlin", "every 60s"); a
    # change restarts the schedule from the next tick instead of catching up on the old one.
    spec = models.CharField(_("expression"), max_length=255, blank=True, default="")
    last_tick = models.DateTimeField(_("last tick decided"), null=True, blank=True)
    next_tick = models.DateTimeField(_("next tick"), null=True, blank=True)
    # When a firer should look again (the next tick, or sooner while ticks are queued).
    due_at = models.DateTimeField(_("due at"), null=True, blank=True)
    last_job = models.CharField(_("last run"), max_length=255, blank=True, default="")
    # Ticks (UTC ISO strings) waiting for the previous run to finish (overlap "queue").
    queued = models.JSONField(_("queued ticks"), default=list, blank=True)
    missed = models.PositiveBigIntegerField(_("missed ticks"), default=0)
    paused_at = models.DateTimeField(_("paused at"), null=True, blank=True)
    paused_by = models.CharField(_("paused by"), max_length=150, blank=True, default="")
    pause_reason = models.TextField(_("pause reason"), blank=True, default="")
    created = models.DateTimeField(_("created"), db_default=Now())
    updated = models.DateTimeField(_("updated"), db_default=Now())

    class Meta:
        verbose_name = _("schedule")
        verbose_name_plural = _("schedules")
        # The firer's "is anything due?" read.
        indexes = [models.Index(fields=["due_at"], name="durable_schedule_due")]
        permissions = [
            ("pause_schedule", "Can pause and resume schedules"),
            ("run_schedule", "Can run a schedule now"),
        ]

    def __str__(self):
        return f"{self.name} ({self.spec})"


class ScheduleEventKind(models.TextChoices):
    MISSED = "missed", _("missed")  # ticks that fell due while no worker ran, not run (downtime policy)
    CAUGHT_UP = "caught_up", _("caught up")  # late ticks run after downtime (downtime policy)
    SKIPPED = "skipped", _("skipped")  # ticks not run because the previous run was going (overlap)
    QUEUED = "queued", _("queued")  # ticks waiting for the previous run to finish (overlap)
    DROPPED = "dropped", _("dropped")  # queued ticks beyond the bound, not run
    RESTARTED = "restarted", _("restarted")  # the expression changed: ticks restart from now
    CONFLICT = "conflict", _("conflict")  # a tick's key belongs to a job with another payload
    PAUSED = "paused", _("paused")  # an operator paused the schedule
    RESUMED = "resumed", _("resumed")  # an operator resumed it; ticks while paused were not run
    RUN_NOW = "run_now", _("run now")  # an operator submitted a run outside the ticks


class ScheduleEvent(models.Model):
    """A decision about a schedule's ticks, or an operator's action on it: the audit log."""

    schedule = models.ForeignKey(ScheduleState, on_delete=models.CASCADE, related_name="events",
                                 db_index=False, verbose_name=_("schedule"))
    at = models.DateTimeField(_("at"), db_default=Now())
    kind = models.CharField(_("kind"), max_length=max(len(v) for v in ScheduleEventKind.values),
                            choices=ScheduleEventKind.choices)
    tick = models.DateTimeField(_("tick"), null=True, blank=True)
    job = models.CharField(_("job"), max_length=255, blank=True, default="")
    actor = models.CharField(_("who"), max_length=200, blank=True, default="")
    message = models.TextField(_("why"), blank=True, default="")
    data = models.JSONField(_("data"), null=True, blank=True, encoder=DjangoJSONEncoder)

    class Meta:
        verbose_name = _("schedule event")
        verbose_name_plural = _("schedule events")
        ordering = ["schedule", "id"]
        indexes = [models.Index(fields=["schedule", "id"], name="durable_schedule_timeline")]

    def __str__(self):
        return f"{self.schedule_id} {self.kind} {self.tick or ''}".rstrip()
