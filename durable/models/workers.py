"""The processes that run: one row per worker, dispatcher or supervisor process.

Models of the ``durable`` app like those of ``durable.models``, which imports them (use
them from there); ``durable.engine.presence`` writes them on each process's heartbeat and the
console's workers page reads them.
"""

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class ProcessRole(models.TextChoices):
    SUPERVISOR = "supervisor", _("supervisor")  # starts, watches and replaces the others
    WORKER = "worker", _("worker")  # claims jobs and runs their steps in slots (threads)
    DISPATCHER = "dispatcher", _("dispatcher")  # sends the outbox's actions


class WorkerProcess(models.Model):
    """A running process as it last said: where it runs, since when, what each slot does.

    The process rewrites its own row every few seconds (one UPDATE, never one per step);
    a row whose heartbeat is old belongs to a process that died without saying so, and
    is deleted after a while by any live process.
    """

    # host:pid:role:random, unique even when an operating system reuses a pid.
    id = models.CharField(_("id"), max_length=200, primary_key=True)
    role = models.CharField(_("role"), max_length=max(len(v) for v in ProcessRole.values),
                            choices=ProcessRole.choices)
    host = models.CharField(_("host"), max_length=255)
    pid = models.PositiveIntegerField(_("pid"))
    # The supervisor that started it ("" for one started alone).
    parent = models.CharField(_("supervisor"), max_length=200, blank=True, default="")
    name = models.CharField(_("name"), max_length=200, blank=True, default="")
    started_at = models.DateTimeField(_("started"), db_default=Now())
    heartbeat_at = models.DateTimeField(_("heartbeat"), db_default=Now())
    draining_since = models.DateTimeField(_("draining since"), null=True, blank=True)
    # What each slot does now: [{"slot", "job", "step", "kind", "since"}], written with the
    # heartbeat from what the process keeps in memory.
    slots = models.JSONField(_("slots"), default=list, blank=True)
    # Workflows and queues it serves, slot count, version: what the page shows beside it.
    info = models.JSONField(_("info"), default=dict, blank=True)

    class Meta:
        verbose_name = _("worker process")
        verbose_name_plural = _("worker processes")
        # The clean-up of rows whose heartbeat stopped, and the page's order.
        indexes = [models.Index(fields=["heartbeat_at"], name="durable_process_heartbeat")]

    def __str__(self):
        return f"{self.role} {self.host}:{self.pid}"
