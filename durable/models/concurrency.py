"""Concurrency keys: a row per key jobs were submitted under, with the jobs that hold it.

``durable.core.concurrency`` says what a key allows; ``durable.store.concurrency`` writes
these rows. Models of the ``durable`` app like those of ``durable.models``, which imports
them (use them from there).
"""

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class ConcurrencyKey(models.Model):
    """One key's turn-taking: the jobs that hold it, the order later ones are submitted in.

    ``holders`` are the jobs let in (their keys, each with the ``interrupt_seq`` it was let
    in under: a later interrupt stops it); one that has finished no longer counts, and the
    next job takes its place. ``version`` moves on with every change, so that two
    workers letting jobs in at once cannot both take the last place (a compare-and-swap).
    ``last_seq`` numbers the key's jobs in the order submitted; ``interrupt_seq`` is the
    number of the last job whose workflow interrupts the key's active runs.
    """

    key = models.CharField(_("key"), max_length=200, primary_key=True)
    limit = models.PositiveIntegerField(_("jobs at once"), default=1)
    holders = models.JSONField(_("active jobs"), default=dict)
    version = models.PositiveBigIntegerField(_("version"), default=0)
    last_seq = models.PositiveBigIntegerField(_("jobs submitted"), default=0)
    interrupt_seq = models.PositiveBigIntegerField(_("interrupted by job number"), default=0)
    updated = models.DateTimeField(_("updated"), db_default=Now())

    class Meta:
        verbose_name = _("concurrency key")
        verbose_name_plural = _("concurrency keys")

    def __str__(self):
        return self.key
