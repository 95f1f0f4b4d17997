"""Provider limits as the operator reads them: what each allows, its use, who waits on it, its 429s.

The runs write the rows (``durable.store.limits``): a ``Limit`` per declared limit, a
``Reservation`` per model call per limit. This module only reads them, a few aggregate
queries for every limit at once, against one database time; the limits page, the job
page, the dashboard's counter and its alert all read them from here.

A run is *throttled* when it waits its turn under a limit on no thread: its job holds a
reservation still booked (its moment is later) or queued (every call at once is in
flight), holds no lease (no worker has it), and is due again (``next_run_at``). A job
cancelled meanwhile is not due, and its forgotten reservation does not count.
"""

import datetime
import re
from dataclasses import dataclass, field

from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncMinute

from ..conf import durable_settings
from ..core import limits as rules
from ..models import EventKind, JobEvent, Limit, Reservation, ReservationState
from ..store import locking
from ..store.limits import live_calls

# The hour of use is shown in buckets of this many minutes, oldest first.
BUCKET_MINUTES = 5
BUCKETS = 12
# Runs waiting on a limit named one by one, the longest waiting first; beyond, counted.
WAITING_SHOWN = 5
# The use queries find the calls of the hour through the (limit, created) index: a call is
# counted if it was booked at most this long before the hour began. One booked earlier still
# (a schedule booked more than an hour ahead) is left out of the counts, not of the limit.
BOOKED_AHEAD = datetime.timedelta(hours=1)
# How the engine words a throttled run's event (durable.engine.runner): when it is due, the
# calls it had made, and why (the limit, its turn or the provider's pause).
THROTTLED = re.compile(r"^throttled until \S+ after (?P<calls>\d+) recorded calls: (?P<why>.*)$",
                       re.S)
THROTTLED_PREFIX = "throttled until "
# How a run waiting for its concurrency key's turn gives its reason (durable.store.concurrency).
KEY_PREFIX = "concurrency key "
# The limits a throttled run's reason names ("limit a, b: paused 2 s by the provider's 429").
NAMED = re.compile(r"^limit (?P<names>.+?): ")


def declared():
    """The declared limits and what is wrong with the setting ("" when nothing is)."""
    try:
        return rules.parse(durable_settings.LIMITS), ""
    except rules.LimitConfigError as exc:
        return (), str(exc)


def waiting_reservations():
    """Reservations of throttled runs: booked or queued, their job held by no worker and due."""
    return Reservation.objects.filter(state__in=ReservationState.waiting(), job__lease_owner__isnull=True,
                                      job__next_run_at__isnull=False)


def throttled_count(workflow=None):
    """Throttled runs across every limit (a run waiting on two limits counts once)."""
    waiting = waiting_reservations()
    if workflow:
        waiting = waiting.filter(job__workflow=workflow)
    return waiting.values("job_id").distinct().count()


def paused_limits(now=None):
    """The limits a provider's 429 pauses now (the database's clock), the soonest to end first."""
    now = now or locking.db_now()
    return list(Limit.objects.filter(paused_until__gt=now.timestamp()).order_by("paused_until", "name"))


@dataclass
class Bucket:
    """A few minutes of one limit's use: calls answered, their tokens, and 429s."""

    start: datetime.datetime
    requests: int = 0
    tokens: int = 0
    refused: int = 0


@dataclass
class Waiting:
    """A throttled run on a limit: since when it waits and its turn (None: waits for a slot)."""

    job_id: str
    state: str
    since: datetime.datetime
    turn: datetime.datetime | None
    tokens: int


@dataclass
class LimitState:
    """One limit as the page shows it; ``spec`` is None for a row no longer declared."""

    name: str
    spec: rules.LimitSpec | None
    row: Limit | None
    now: datetime.datetime
    calling: int = 0
    requests_last_minute: int = 0
    tokens_last_minute: int = 0
    hour: list = field(default_factory=list)
    waiting: int = 0
    oldest: list = field(default_factory=list)

    @property
    def declared(self):
        return self.spec is not None

    @property
    def allows(self):
        return self.spec.describe() if self.spec else ""

    @property
    def covers(self):
        """Which calls it counts, in words."""
        if self.spec is None:
            return ""
        models = "every model" if self.spec.models == ("*",) else "models " + ", ".join(self.spec.models)
        if self.spec.providers:
            return f"{models} of {', '.join(self.spec.providers)}"
        return models

    @property
    def paused_until(self):
        """The end of the provider's pause, if it is still on (else None)."""
        until = Limit.moment(self.row.paused_until) if self.row else None
        return until if until is not None and until > self.now else None

    @property
    def next_free(self):
        """When a call asking now would go, if not now: the pause's end or the last moment booked."""
        if self.row is None:
            return None
        moments = [self.row.paused_until]
        if self.spec is None or self.spec.requests_per_minute:
            moments.append(self.row.requests_free)
        if self.spec is None or self.spec.tokens_per_minute:
            moments.append(self.row.tokens_free)
        latest = max((m for m in moments if m is not None), default=None)
        moment = Limit.moment(latest)
        return moment if moment is not None and moment > self.now else None

    @property
    def hour_requests(self):
        return sum(b.requests for b in self.hour)

    @property
    def hour_tokens(self):
        return sum(b.tokens for b in self.hour)

    @property
    def hour_refused(self):
        return sum(b.refused for b in self.hour)


def hour_start(now):
    """The start of the hour shown: ``BUCKETS`` whole buckets, the last one holding ``now``."""
    floor = now.replace(second=0, microsecond=0)
    floor -= datetime.timedelta(minutes=floor.minute % BUCKET_MINUTES)
    return floor - datetime.timedelta(minutes=BUCKET_MINUTES * (BUCKETS - 1))


def _use(names, now):
    """Each limit's answered calls, tokens and 429s per minute of the hour, and of the last 60 s.

    One aggregate query for every limit: grouped by limit and minute (at most 60 rows a
    limit), each group also counting what of it was answered in the last 60 seconds, so
    the minute's use and the hour's come from the same rows.
    """
    since = hour_start(now)
    recent = Q(settled_at__gte=now - datetime.timedelta(seconds=60))
    settled = Q(state=ReservationState.SETTLED)
    rows = (Reservation.objects
            .filter(limit__in=names, created__gte=since - BOOKED_AHEAD, settled_at__gte=since,
                    state__in=[ReservationState.SETTLED, ReservationState.REFUSED])
            .annotate(minute=TruncMinute("settled_at", tzinfo=datetime.UTC))
            .values("limit", "minute")
            .annotate(requests=Count("pk", filter=settled), tokens=Sum("used_tokens", filter=settled),
                      refused=Count("pk", filter=Q(state=ReservationState.REFUSED)),
                      recent_requests=Count("pk", filter=settled & recent),
                      recent_tokens=Sum("used_tokens", filter=settled & recent))
            .order_by())
    use = {name: {"hour": [Bucket(since + datetime.timedelta(minutes=BUCKET_MINUTES * i))
                           for i in range(BUCKETS)], "requests": 0, "tokens": 0} for name in names}
    for row in rows:
        mine = use[row["limit"]]
        index = int((row["minute"] - since).total_seconds() // (BUCKET_MINUTES * 60))
        bucket = mine["hour"][min(max(index, 0), BUCKETS - 1)]
        bucket.requests += row["requests"]
        bucket.tokens += row["tokens"] or 0
        bucket.refused += row["refused"]
        mine["requests"] += row["recent_requests"]
        mine["tokens"] += row["recent_tokens"] or 0
    return use


def _oldest_waiting(name):
    rows = (waiting_reservations().filter(limit=name).order_by("created", "pk")
            .values("job_id", "state", "created", "starts_at", "tokens")[:WAITING_SHOWN])
    return [Waiting(r["job_id"], r["state"], r["created"], r["starts_at"] if r["state"] == ReservationState.BOOKED
                    else None, r["tokens"]) for r in rows]


def overview(now=None):
    """Every declared limit, then every row no longer declared: ``([LimitState], problem)``."""
    now = now or locking.db_now()
    specs, problem = declared()
    rows = {row.name: row for row in Limit.objects.all()}
    found = [LimitState(spec.name, spec, rows.pop(spec.name, None), now) for spec in specs]
    found += [LimitState(name, None, rows[name], now) for name in sorted(rows)]
    names = [limit.name for limit in found]
    if not names:
        return [], problem
    calling = dict(live_calls().filter(limit__in=names).values("limit").annotate(n=Count("pk"))
                   .order_by().values_list("limit", "n"))
    waiting = dict(waiting_reservations().filter(limit__in=names).values("limit")
                   .annotate(n=Count("job_id", distinct=True)).order_by().values_list("limit", "n"))
    use = _use(names, now)
    for limit in found:
        limit.calling = calling.get(limit.name, 0)
        limit.requests_last_minute = use[limit.name]["requests"]
        limit.tokens_last_minute = use[limit.name]["tokens"]
        limit.hour = use[limit.name]["hour"]
        limit.waiting = waiting.get(limit.name, 0)
        # Asked only of the limits with runs waiting: most have none most of the time.
        limit.oldest = _oldest_waiting(limit.name) if limit.waiting else []
    return found, problem


def known_names():
    """The names an operator may act on: declared limits and limits with a row."""
    specs, _ = declared()
    return {spec.name for spec in specs} | set(Limit.objects.values_list("name", flat=True))


def latest_throttle(job_id):
    """The job's latest "throttled until" event, parsed: ``(event, calls, why)`` or None.

    An event worded otherwise (an older engine's) is shown whole, its calls unknown.
    """
    event = (JobEvent.objects.filter(job_id=job_id, kind=EventKind.TRANSITION,
                                     message__startswith=THROTTLED_PREFIX).order_by("-id").first())
    if event is None:
        return None
    match = THROTTLED.match(event.message)
    if match is None:
        return event, None, event.message
    return event, int(match["calls"]), match["why"]


def throttled(job, now=None):
    """Why ``job`` waits under a provider limit or its concurrency key now, or None when it does not.

    Its booked or queued reservations say on which limits and until when; its latest
    "throttled until" event says why in the engine's words. The run the provider refused
    (a 429) gave its reservation back: it waits out the pause, due at the end of it, and
    only its event (the job's latest) and ``next_run_at`` tell. So does a run not let in
    under its concurrency key yet (``key``: the key it waits for), until its key wakes it.
    """
    if job.lease_owner or job.next_run_at is None:
        return None
    now = now or locking.db_now()
    held = list(Reservation.objects.filter(job_id=job.pk, state__in=ReservationState.waiting())
                .order_by("limit", "pk"))
    found = latest_throttle(job.pk)
    if not held:
        if found is None or job.next_run_at <= now or \
                JobEvent.objects.filter(job_id=job.pk, pk__gt=found[0].pk).exists():
            return None
    named = NAMED.match(found[2]) if found is not None else None
    names = named["names"].split(", ") if named else []
    rows = {row.name: row for row in Limit.objects.filter(name__in=[r.limit for r in held] + names)}
    limits = []
    why_now = found[2] if found is not None else ""
    for reservation in held:
        row = rows.get(reservation.limit)
        paused = Limit.moment(row.paused_until) if row is not None else None
        # Queued behind other runs for its turn to book (the limit's schedule is full as far
        # ahead as it is booked), not for a call at once: the engine's words say which.
        ahead = re.search(rf"limit {re.escape(reservation.limit)}: (\d+) calls queued before it", why_now)
        limits.append({
            "name": reservation.limit,
            "queued": reservation.state == ReservationState.QUEUED and ahead is None,
            "queued_behind": int(ahead[1]) if ahead and reservation.state == ReservationState.QUEUED else None,
            "turn": reservation.starts_at if reservation.state == ReservationState.BOOKED else None,
            "tokens": reservation.tokens,
            "paused_until": paused if paused is not None and paused > now else None,
        })
    if not held:
        # Refused by the provider: the limits its reason names, with their pause if still on.
        for name in names:
            paused = Limit.moment(rows[name].paused_until) if name in rows else None
            limits.append({"name": name, "queued": False, "queued_behind": None, "turn": None, "tokens": 0,
                           "paused_until": paused if paused is not None and paused > now else None})
    event, calls, why = found if found is not None else (None, None, "")
    # Not let in under its concurrency key yet (``durable.store.concurrency.admit``'s words):
    # no provider refused it; it goes when a job of its key finishes, or looks again then.
    key = job.concurrency_key if not held and job.concurrency_key and why.startswith(
        f"{KEY_PREFIX}{job.concurrency_key} (") else None
    turns = [limit["turn"] for limit in limits if limit["turn"] is not None]
    turn = max(turns) if turns else None
    return {
        "limits": limits,
        # Its turn: the latest of its limits' moments; the job is due a little before it.
        "turn": turn,
        # Waits in a limit's queue for its turn to book (see ``store.limits.HORIZON``).
        "rate_queued": any(limit["queued_behind"] is not None for limit in limits),
        "turn_in": max((turn - now).total_seconds(), 0.0) if turn else None,
        "due": job.next_run_at,
        "due_in": max((job.next_run_at - now).total_seconds(), 0.0),
        "why": why,
        "calls": calls,
        "since": event.at if event is not None else None,
        "refused": not held and key is None,
        "key": key,
    }
