"""The model-call cache: replies (and read-only tools' results) other jobs reuse, and what it saved.

Opt-in per call site (``ctx.model(..., cache=True)``, or seconds to keep it), per workflow
(``cache = True``) or per tool (``@tool(cache=True)``). A call is identified by what it
asks: the sha256 of its kind and its input fingerprint (the model, the canonical messages,
the tools and the sampling parameters; a tool: its name and arguments). A hit is the
run's memo at cost 0 and records the cost it saved; it reserves nothing and waits for no
limit. Entries expire after their TTL (``DURABLE["CACHE_TTL"]``); purge deletes them.

Two runs missing the same entry at once both pay, and the later write wins: the cache
saves money, it does not serialise calls.
"""

import datetime
import hashlib
from decimal import Decimal

from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Now

from ..conf import durable_settings
from ..models import CachedCall, StepResult


def key_for(kind, name, fingerprint):
    """The cache key of a call: its kind, its name and the fingerprint of what it asks."""
    return hashlib.sha256(f"{kind}\x00{name}\x00{fingerprint}".encode()).hexdigest()


def ttl_of(cache):
    """Seconds an entry is kept, from a call site's ``cache`` (True: the setting; a number: that)."""
    if cache is True:
        return float(durable_settings.CACHE_TTL)
    if isinstance(cache, bool) or not isinstance(cache, int | float) or cache <= 0:
        raise ValueError(f"cache must be True or a number of seconds above 0, not {cache!r}")
    return float(cache)


def lookup(key):
    """The live entry at ``key`` as ``(output, cost, model)``, or None."""
    row = (CachedCall.objects.filter(key=key, expires_at__gt=Now())
           .values_list("output", "cost", "model").first())
    return row


def keep(key, *, kind, name, output, cost, input_tokens=0, output_tokens=0, model="", job="", ttl):
    """Keep a paid call's result under ``key`` for ``ttl`` seconds (replacing an expired one)."""
    fields = {"kind": kind, "name": name[:100], "output": output, "cost": Decimal(cost),
              "input_tokens": int(input_tokens or 0), "output_tokens": int(output_tokens or 0),
              "model": (model or "")[:100], "job": str(job)[:200],
              "expires_at": Now() + datetime.timedelta(seconds=ttl)}
    try:
        with transaction.atomic():
            if not CachedCall.objects.filter(key=key).update(**fields, created=Now(), hits=0, saved=0):
                CachedCall.objects.create(key=key, **fields)
    except IntegrityError:  # another run kept it first: theirs stands
        pass


def record_hit(key, job_id, memo_key, saved):
    """In the memo's transaction: the memo at ``memo_key`` saved ``saved``; the entry counts the hit."""
    StepResult.objects.filter(job_id=job_id, step=memo_key).update(cost_saved=saved)
    CachedCall.objects.filter(key=key).update(hits=F("hits") + 1, saved=F("saved") + saved)


def purge_expired(now=None):
    """Delete the entries that expired; how many."""
    rows = CachedCall.objects.filter(expires_at__lte=now or Now())
    return rows.delete()[0]


__all__ = ["key_for", "keep", "lookup", "purge_expired", "record_hit", "ttl_of"]
