"""Concurrency keys as the operator reads them: the busy keys, who holds each, who waits.

The runs write the rows (``durable.store.concurrency``): a ``ConcurrencyKey`` per key with
the jobs let in (``holders``), and on every job its key and its number under it. A job of
a key is *active* while it is a holder and unfinished (a holder that finished no longer
counts), and *waiting* while it is unfinished and not let in. Only keys with unfinished
jobs are shown, the busiest first and at most ``KEYS_SHOWN`` of them, each from a few
queries for all the keys at once; the limits page and the job page read them from here.
"""

from dataclasses import dataclass, field

from django.db.models import Count, Min, Q

from ..conf import durable_settings
from ..core import concurrency as rules
from ..models import ConcurrencyKey, Job
from ..store.concurrency import unfinished
from ..store.wakeups import settled_q

covering = rules.covering

# The busiest keys shown (most unfinished jobs first); the others are only counted.
KEYS_SHOWN = 50
# Active jobs named per key (a key may allow many at once); beyond, counted.
ACTIVE_SHOWN = 10
# The columns read of a job of a key.
MEMBER = ("pk", "concurrency_key", "concurrency_seq", "state", "created")


def declared():
    """The declared patterns ``((pattern, limit), ...)`` and what is wrong with the setting ("" if nothing)."""
    try:
        return rules.parse(durable_settings.CONCURRENCY), ""
    except rules.ConcurrencyConfigError as exc:
        return (), str(exc)


@dataclass(frozen=True)
class Member:
    """A job of a key: its number under the key, its state, when it was submitted."""

    job_id: str
    seq: int | None
    state: str
    created: object

    @classmethod
    def of(cls, row):
        return cls(row["pk"], row["concurrency_seq"], row["state"], row["created"])


@dataclass
class KeyState:
    """One busy key as the pages show it.

    ``limit`` is what the key's row enforces (set from the setting at each submit); ``pattern``
    and ``declared_limit`` are what ``DURABLE["CONCURRENCY"]`` says now ("" and None: no
    pattern covers the key any more).
    """

    key: str
    limit: int
    unfinished: int
    pattern: str = ""
    declared_limit: int | None = None
    active: list = field(default_factory=list)
    oldest: Member | None = None

    @property
    def waiting(self):
        return self.unfinished - len(self.active)

    @property
    def free(self):
        return max(self.limit - len(self.active), 0)

    @property
    def changed(self):
        """The setting now allows a different number than the row: the key takes it at its next submit."""
        return self.declared_limit is not None and self.declared_limit != self.limit


@dataclass
class Busy:
    """The busy keys shown, how many more there are, and the setting (with what is wrong with it)."""

    keys: list
    more: int
    patterns: tuple
    problem: str


def _keyed():
    """Every unfinished job that has a key (the same "unfinished" as ``store.concurrency``'s)."""
    return Job.objects.filter(concurrency_key__isnull=False).exclude(settled_q())


def waiting_total():
    """Jobs waiting for their concurrency key: unfinished and not let in (three queries)."""
    keyed = _keyed()
    total = keyed.count()
    if not total:
        return 0
    holders = set()
    for held in ConcurrencyKey.objects.filter(key__in=keyed.values("concurrency_key")).values_list("holders",
                                                                                                   flat=True):
        holders.update(held or {})
    return total - (keyed.filter(pk__in=sorted(holders)).count() if holders else 0)


def busy():
    """The keys with unfinished jobs, the busiest first (``KEYS_SHOWN`` at most): a ``Busy``.

    Six queries whatever the number of keys and jobs: the busiest keys with their counts,
    how many keys are busy in all (only when more are busy than shown), the keys' rows,
    their holders still unfinished (a key holds about as many as it allows at once), the
    first number waiting under each key, and those jobs.
    """
    patterns, problem = declared()
    top = list(_keyed().values("concurrency_key").annotate(n=Count("pk"))
               .order_by("-n", "concurrency_key")[:KEYS_SHOWN])
    more = 0
    if len(top) == KEYS_SHOWN:
        more = _keyed().values("concurrency_key").distinct().count() - KEYS_SHOWN
    names = [row["concurrency_key"] for row in top]
    if not names:
        return Busy([], 0, patterns, problem)
    rows = {row["key"]: row for row in ConcurrencyKey.objects.filter(key__in=names).values("key", "limit", "holders")}
    holders = {key: set(row["holders"] or {}) for key, row in rows.items()}
    every_holder = sorted(set().union(*holders.values())) if holders else []
    active = {}
    if every_holder:
        for row in (_keyed().filter(concurrency_key__in=names, pk__in=every_holder)
                    .order_by("concurrency_key", "concurrency_seq", "pk").values(*MEMBER)):
            # A holder is one of its own key's jobs; a stale name in another key's row is not.
            if row["pk"] in holders.get(row["concurrency_key"], ()):
                active.setdefault(row["concurrency_key"], []).append(Member.of(row))
    active_ids = [m.job_id for members in active.values() for m in members]
    firsts = (_keyed().filter(concurrency_key__in=names).exclude(pk__in=active_ids)
              .values("concurrency_key").annotate(first=Min("concurrency_seq")).order_by()
              .values_list("concurrency_key", "first"))
    wanted = Q(pk__in=[])
    for key, seq in firsts:
        wanted |= Q(concurrency_key=key, concurrency_seq=seq)
    oldest = {}
    for row in _keyed().filter(wanted).exclude(pk__in=active_ids).order_by("pk").values(*MEMBER):
        oldest.setdefault(row["concurrency_key"], Member.of(row))
    found = []
    for row in top:
        key = row["concurrency_key"]
        covered = covering(key, patterns)
        limit = rows[key]["limit"] if key in rows else (covered[1] if covered else 1)
        found.append(KeyState(key, limit, row["n"], pattern=covered[0] if covered else "",
                              declared_limit=covered[1] if covered else None,
                              active=active.get(key, []), oldest=oldest.get(key)))
    return Busy(found, more, patterns, problem)


def of_job(job):
    """The job's concurrency key as its page shows it, or None when it has none.

    Whether the job is active (let in, unfinished), waiting (unfinished, not let in: how many
    of the key's jobs submitted before it wait too, and whether a place is free) or finished;
    the key's active jobs, its limit and the pattern that covers it.
    """
    key = job.concurrency_key
    if key is None:
        return None
    patterns, _ = declared()
    covered = covering(key, patterns)
    row = ConcurrencyKey.objects.filter(key=key).values("limit", "holders").first()
    limit = row["limit"] if row else (covered[1] if covered else 1)
    holders = list((row or {}).get("holders") or {})
    active = [Member.of(r) for r in unfinished(key).filter(pk__in=holders)
              .order_by("concurrency_seq", "pk").values(*MEMBER)] if holders else []
    active_ids = [m.job_id for m in active]
    others = [m for m in active if m.job_id != job.pk]
    ahead = 0
    if job.pk not in active_ids and not unfinished(key).filter(pk=job.pk).exists():
        status = "finished"
    elif job.pk in active_ids:
        status = "active"
    else:
        status = "waiting"
        if job.concurrency_seq is not None:
            ahead = (unfinished(key).filter(concurrency_seq__lt=job.concurrency_seq).exclude(pk__in=active_ids)
                     .count())
    return {
        "key": key,
        "seq": job.concurrency_seq,
        "limit": limit,
        "pattern": covered[0] if covered else "",
        "declared_limit": covered[1] if covered else None,
        "status": status,
        "active": active,
        # The key's other active jobs, the first ``ACTIVE_SHOWN`` of them named, the rest counted.
        "others_active": others[:ACTIVE_SHOWN],
        "more_active": max(len(others) - ACTIVE_SHOWN, 0),
        "free": max(limit - len(active), 0),
        "ahead": ahead,
        # Every job of the key that is unfinished and not let in, this one included if it waits.
        "waiting": unfinished(key).exclude(pk__in=active_ids).count(),
    }
