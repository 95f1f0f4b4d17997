"""Provider limits in the database: book a call's moment, settle it, pause on a 429.

Every worker on every host paces its model calls by the same ``Limit`` rows. A booking
is one UPDATE of the limit's row that does its arithmetic on the row it locked
(``durable.core.limits`` says what it computes): two workers never get the same moment,
and a row is locked only for the length of one statement, so hundreds of runs booking
at once queue on it for microseconds, not for round trips. Each call's share of each
limit is a ``Reservation`` row, written by the run alone:

- ``reserve`` books the call's moment on each limit that covers it (or finds the one it
  booked before it was throttled) and says when it may go; a call whose turn is now, or
  soon enough to wait for in its thread, is in flight (``calling``) from there;
- ``settle`` records the reply's usage (tokens booked and not used come back, and the
  limit learns how its estimate compares with the provider's count), ``refuse`` a 429
  (the limit pauses for every worker until its Retry-After), ``release`` a call that
  failed otherwise;
- a concurrent slot is held by a ``calling`` reservation only while its job holds the
  lease it was taken under, so a run that dies gives its slot back when its lease
  passes; a slot given back wakes the run that has queued longest for one.
"""

import datetime
import time
from dataclasses import dataclass

from django.db import connection, transaction
from django.db.models import Exists, F, Max, OuterRef, Q
from django.db.models.functions import Now

from ..core import limits as rules
from ..models import Job, Limit, Reservation, ReservationState
from . import database
from .wakeups import wake_parked

# A booked moment missed by more than its limit allows (``LimitSpec.late_allowed``: the
# slack its headroom leaves in the provider's window) passed unused: the run was away
# (killed, drained, or claimed late on a busy machine) and the call books a new one.
# Sent that late, it would go out together with the calls booked after it, and a
# provider counts its window by arrivals.

# Seconds a run waits for a concurrent slot before it looks again, if no slot given back
# wakes it first.
QUEUED_RECHECK = 5.0
# The least a run queued for its turn to book waits before it looks again.
QUEUED_MIN = 1.0

# Seconds of a limit's schedule booked ahead at most. Beyond, a call does not book: it is
# queued by priority (then age), and a call that goes or books with room left wakes the
# first queued run to book the moment freed. A run of a higher priority asking while
# hundreds wait is next, not behind them; the order is fair (oldest first) within a
# priority. Short: a woken run books a moment it mostly waits for in its thread
# (``steps.limits.SHORT_WAIT``), one claim per call as without a queue; long enough for a
# woken run to be claimed before the booked moments run out. Measured with
# bench/limits.py (1,000 runs, 4 processes): 10 s kept more runs parking twice per call,
# 0.91-0.94x of the rate; 3 s, 0.95x on both databases.
HORIZON = 3.0

# One booking, on the row it locks (PostgreSQL re-reads a row updated concurrently before
# it computes the new one; SQLite's IMMEDIATE transaction holds the write lock). The
# moment is the latest of now, the end of a pause and the next free moment of each rate
# the limit has; the call's tokens are its estimate times the learnt ratio, plus its
# output cap; each rate's next free moment moves on by what the call takes. No row when
# that moment is more than the horizon away: the call queues instead.
BOOK = {
    "postgresql": """
UPDATE durable_limit AS l
SET booked = GREATEST(extract(epoch FROM statement_timestamp())::float8, l.paused_until,
                      CASE WHEN %(per_request)s::float8 IS NOT NULL THEN l.requests_free END,
                      CASE WHEN %(per_token)s::float8 IS NOT NULL THEN l.tokens_free END),
    booked_tokens = ceil(%(estimate)s * l.token_ratio)::bigint + %(out)s,
    requests_free = CASE WHEN %(per_request)s::float8 IS NULL THEN l.requests_free ELSE
        GREATEST(extract(epoch FROM statement_timestamp())::float8, l.paused_until, l.requests_free,
                 CASE WHEN %(per_token)s::float8 IS NOT NULL THEN l.tokens_free END)
        + %(per_request)s::float8 END,
    tokens_free = CASE WHEN %(per_token)s::float8 IS NULL THEN l.tokens_free ELSE
        GREATEST(extract(epoch FROM statement_timestamp())::float8, l.paused_until, l.tokens_free,
                 CASE WHEN %(per_request)s::float8 IS NOT NULL THEN l.requests_free END)
        + %(per_token)s::float8 * (ceil(%(estimate)s * l.token_ratio)::bigint + %(out)s) END,
    updated = statement_timestamp()
WHERE l.name = %(name)s
  AND GREATEST(extract(epoch FROM statement_timestamp())::float8, l.paused_until,
               CASE WHEN %(per_request)s::float8 IS NOT NULL THEN l.requests_free END,
               CASE WHEN %(per_token)s::float8 IS NOT NULL THEN l.tokens_free END)
      <= extract(epoch FROM statement_timestamp())::float8 + %(horizon)s::float8
RETURNING l.booked, l.booked_tokens, extract(epoch FROM statement_timestamp())::float8, l.paused_until
""",
    # SQLite has no ceil() in every build: a positive x rounds up as CAST(x) + (x > CAST(x)).
    "sqlite": """
UPDATE durable_limit
SET booked = MAX(%(now)s, COALESCE(paused_until, %(now)s),
                 CASE WHEN %(per_request)s IS NOT NULL THEN COALESCE(requests_free, %(now)s) ELSE %(now)s END,
                 CASE WHEN %(per_token)s IS NOT NULL THEN COALESCE(tokens_free, %(now)s) ELSE %(now)s END),
    booked_tokens = CAST(%(estimate)s * token_ratio AS INTEGER)
        + (%(estimate)s * token_ratio > CAST(%(estimate)s * token_ratio AS INTEGER)) + %(out)s,
    requests_free = CASE WHEN %(per_request)s IS NULL THEN requests_free ELSE
        MAX(%(now)s, COALESCE(paused_until, %(now)s), COALESCE(requests_free, %(now)s),
            CASE WHEN %(per_token)s IS NOT NULL THEN COALESCE(tokens_free, %(now)s) ELSE %(now)s END)
        + %(per_request)s END,
    tokens_free = CASE WHEN %(per_token)s IS NULL THEN tokens_free ELSE
        MAX(%(now)s, COALESCE(paused_until, %(now)s), COALESCE(tokens_free, %(now)s),
            CASE WHEN %(per_request)s IS NOT NULL THEN COALESCE(requests_free, %(now)s) ELSE %(now)s END)
        + %(per_token)s * (CAST(%(estimate)s * token_ratio AS INTEGER)
                           + (%(estimate)s * token_ratio > CAST(%(estimate)s * token_ratio AS INTEGER)) + %(out)s) END
WHERE name = %(name)s
  AND MAX(%(now)s, COALESCE(paused_until, %(now)s),
          CASE WHEN %(per_request)s IS NOT NULL THEN COALESCE(requests_free, %(now)s) ELSE %(now)s END,
          CASE WHEN %(per_token)s IS NOT NULL THEN COALESCE(tokens_free, %(now)s) ELSE %(now)s END)
      <= %(now)s + %(horizon)s
RETURNING booked, booked_tokens, %(now)s, paused_until
""",
}


@dataclass(frozen=True)
class Decision:
    """What ``reserve`` decided: go at ``at`` (now or within moments), or wait until ``at``."""

    go: bool
    at: datetime.datetime
    now: datetime.datetime  # the database's clock when it was decided
    why: str = ""  # for a wait: which limit, and what it waits for
    ids: tuple = ()  # the call's reservations (for settle / refuse / release)
    queued: bool = False  # waits for a concurrent slot, not for a moment


def _book(spec, estimate, max_tokens):
    """Book the next free moment of ``spec``'s limit: (moment, tokens, now, paused_until), epochs;
    None when that moment is more than ``HORIZON`` away (the call queues)."""
    params = {"name": spec.name, "per_request": spec.seconds_per_request(), "per_token": spec.seconds_per_token(),
              "estimate": int(estimate), "out": rules.tokens_to_reserve(0, 0, max_tokens, spec.default_max_tokens),
              "horizon": HORIZON}
    vendor = connection.vendor
    if vendor not in BOOK:
        Limit.objects.get_or_create(name=spec.name)
        return _book_by_orm(spec, params)
    params["now"] = time.time()  # SQLite's clock is this machine's (PostgreSQL reads its own)
    with connection.cursor() as cursor:
        cursor.execute(BOOK[vendor], params)
        booked = cursor.fetchone()
    if booked is None:
        _, made = Limit.objects.get_or_create(name=spec.name)
        if made:  # the limit's first call: its row is made, then booked
            return _book(spec, estimate, max_tokens)
    return booked


def _book_by_orm(spec, params):
    """The same booking for any other database: the row locked, the arithmetic in Python."""
    with transaction.atomic():
        limit = Limit.objects.select_for_update().get(name=spec.name)
        now = database.current().now().timestamp()
        tokens = rules.tokens_to_reserve(params["estimate"], limit.token_ratio) + params["out"]
        start, schedule = rules.book(spec, rules.Schedule(limit.requests_free, limit.tokens_free,
                                                          limit.paused_until), now, tokens)
        if start > now + params["horizon"]:
            return None
        Limit.objects.filter(name=spec.name).update(booked=start, booked_tokens=tokens, updated=Now(),
                                                    requests_free=schedule.requests_at, tokens_free=schedule.tokens_at)
    return start, tokens, now, limit.paused_until


def live_calls():
    """``calling`` reservations whose job still holds the lease they were taken under."""
    alive = Job.objects.filter(pk=OuterRef("job_id"), lease_token=OuterRef("lease_token"),
                               lease_until__gt=Now())
    return Reservation.objects.filter(state=ReservationState.CALLING).filter(Exists(alive))


def _free_slots(spec, now):
    """Concurrent slots of ``spec`` free now; calls whose lease passed are given back first."""
    calling = Reservation.objects.filter(limit=spec.name, state=ReservationState.CALLING)
    dead = calling.exclude(pk__in=live_calls().filter(limit=spec.name).values("pk"))
    dead.update(state=ReservationState.RELEASED, settled_at=now)
    return spec.concurrent - calling.count()


def _usable(held, now, spec):
    """The run's reservation of a call if it can still use it; else it is given back (None)."""
    if held is None:
        return None
    # A limit no longer declared; a call taken by an earlier attempt (under an older lease)
    # that never settled; a moment that passed while the run was away (killed, drained):
    # none of them is the call's now.
    gone = spec is None or held.state == ReservationState.CALLING or (
        held.state == ReservationState.BOOKED and held.starts_at is not None
        and (now - held.starts_at).total_seconds() > spec.late_allowed())
    if not gone:
        return held
    Reservation.objects.filter(pk=held.pk).update(state=ReservationState.RELEASED, settled_at=now)
    return None


def _queued_for_slot(spec, held, job_id, key, estimate, lease_token, priority, now):
    """``held``, or a new reservation, waiting for a concurrent slot of ``spec``: its id."""
    if held is None:
        return Reservation.objects.create(limit=spec.name, job_id=job_id, key=key, state=ReservationState.QUEUED,
                                          estimate=estimate, lease_token=lease_token, priority=priority).pk
    if held.state == ReservationState.BOOKED:
        # Its moment would pass while it waits: it books a new one once it has a slot.
        Reservation.objects.filter(pk=held.pk).update(state=ReservationState.QUEUED, starts_at=None)
    return held.pk


def _slot_of(specs, mine, job_id, key, estimate, lease_token, priority, now):
    """The first limit of ``specs`` whose concurrent slots are all taken, and the call's queued
    reservation on it; (None, None) when every limit has a slot for the call. Runs inside
    ``reserve``'s transaction, which holds the limits' rows: two runs never both see the
    last slot free."""
    for spec in specs:
        if spec.concurrent and _free_slots(spec, now) <= 0:
            return spec, _queued_for_slot(spec, mine.get(spec.name), job_id, key, estimate, lease_token,
                                          priority, now)
    return None, None


def reserve(specs, job_id, lease_token, key, estimate, max_tokens=None, priority=0, soon=0.0):
    """Book a call on every limit in ``specs``; a ``Decision`` on when it may go (see ``_reserve``).

    Under a limit of concurrent calls, counting its slots and taking one are one
    transaction that holds the rows of every limit of the call (locked in name order, so
    two calls never wait on each other); rates alone need no transaction: each booking is
    one statement.
    """
    specs = sorted(specs, key=lambda spec: spec.name)
    if not any(spec.concurrent for spec in specs):
        return _reserve(specs, job_id, lease_token, key, estimate, max_tokens, priority, soon)
    for spec in specs:
        Limit.objects.get_or_create(name=spec.name)
    with transaction.atomic():
        list(Limit.objects.select_for_update().filter(name__in=[spec.name for spec in specs]).order_by("name"))
        return _reserve(specs, job_id, lease_token, key, estimate, max_tokens, priority, soon)


def _reserve(specs, job_id, lease_token, key, estimate, max_tokens, priority, soon):
    """Book a call on every limit in ``specs``; a ``Decision`` on when it may go.

    ``estimate`` is the request's tokens estimated from its characters; the call reserves
    that times the limit's learnt ratio, plus ``max_tokens`` (the most it may write). A
    call whose turn is at most ``soon`` seconds away goes (its caller sleeps until then).
    A run that comes back for a call it booked before finds its moment; one that comes
    back after its moment passed (it was killed or drained meanwhile) books a new one.
    Booked calls go in the order they booked; a call waiting for a concurrent slot is
    queued and woken when one is given back.
    """
    # The run's own rows (nobody else writes them), each with the database's clock; a run's
    # first call has none, and its booking reads the clock.
    mine = {r.limit: r for r in Reservation.objects.filter(
        job_id=job_id, key=key, state__in=[*ReservationState.waiting(), ReservationState.CALLING],
    ).annotate(db_now=Now())}
    now = next(iter(mine.values())).db_now if mine else None
    by_name = {spec.name: spec for spec in specs}
    mine = {name: held for name, held in ((n, _usable(h, now, by_name.get(n))) for n, h in mine.items())
            if held is not None}
    if any(spec.concurrent for spec in specs) and now is None:
        now = database.current().now()
    full, queued = _slot_of(specs, mine, job_id, key, estimate, lease_token, priority, now)
    if full is not None:
        return Decision(False, now + datetime.timedelta(seconds=QUEUED_RECHECK), now, ids=(queued,), queued=True,
                        why=f"limit {full.name}: all {full.concurrent} calls at once are in flight;"
                            " waiting for one to finish")
    at, why, rows, wake = None, "", [], []
    for spec in specs:
        held = mine.get(spec.name)
        if held is None or held.state == ReservationState.QUEUED:
            ahead = _queued_ahead(spec, held, priority) if spec.paced() else 0
            booked = None if ahead else _book(spec, estimate, max_tokens)
            if booked is None:
                now = now or database.current().now()
                _write(rows, ReservationState.BOOKED, job_id, key, lease_token, priority)
                return _queue_for_rate(spec, held, ahead, job_id, key, estimate, lease_token, priority, now)
            start, tokens, now_, paused = booked
            now = Limit.moment(now_) if now is None else max(now, Limit.moment(now_))
            moment = Limit.moment(start)
            rows.append((held, spec, {"starts_at": moment, "tokens": tokens, "estimate": estimate}))
            if spec.paced() and start + 2 * spec.spacing(tokens) <= now_ + HORIZON:
                wake.append(spec.name)  # room is left in the horizon: the next queued run books too
            if moment > now:
                pause = paused is not None and paused >= start - 1
                why = f"limit {spec.name}: its turn at {moment.isoformat()}" + (
                    " (paused by the provider's 429)" if pause else f" ({spec.describe()})")
        else:
            moment = held.starts_at
            rows.append((held, spec, {}))
            if moment > now:
                why = f"limit {spec.name}: its turn at {moment.isoformat()} ({spec.describe()})"
        at = moment if at is None else max(at, moment)
    # Its turn is now, or ``soon`` enough that the caller sleeps until it in its thread: the
    # call is in flight from here (no second write before it goes).
    at = max(at, now)
    go = at <= now + datetime.timedelta(seconds=soon)
    ids = _write(rows, ReservationState.CALLING if go else ReservationState.BOOKED, job_id, key, lease_token,
                 priority)
    if go:  # a moment of each paced limit is used: the first run queued behind books the one freed
        wake += [spec.name for spec in specs if spec.paced()]
    for name in dict.fromkeys(wake):
        wake_queued(name)
    return Decision(go, at, now, why=why, ids=tuple(ids))


def _write(rows, state, job_id, key, lease_token, priority):
    """Write the call's reservations ``rows`` (held or new, with their fields) in ``state``: their ids."""
    ids = []
    for held, spec, fields in rows:
        fields.update(state=state, lease_token=lease_token)
        if held is None:
            ids.append(Reservation.objects.create(limit=spec.name, job_id=job_id, key=key, priority=priority,
                                                  **fields).pk)
        else:
            Reservation.objects.filter(pk=held.pk).update(**fields)
            ids.append(held.pk)
    return ids


def _queued_ahead(spec, held, priority):
    """Runs queued on ``spec``'s limit before this call: of a higher priority, or as high and older.

    Only runs parked until their turn count: a job finished or waiting for a person has no
    turn; one already due (woken, or looking again) is on its way to book, and whichever
    of those asks first books; a woken run that yielded to them would break the chain of
    wakes that keeps the horizon booked.
    """
    # Age is the reservation's number: ids grow as rows are written, on every database (a
    # stamp to the millisecond would tie, and SQLite compares its stamps as text).
    before = Q(priority__gt=priority) | (Q(priority=priority, pk__lt=held.pk) if held else Q(priority=priority))
    return Reservation.objects.filter(before, limit=spec.name, state=ReservationState.QUEUED,
                                      job__lease_owner__isnull=True, job__next_run_at__gt=Now()).count()


def _queue_for_rate(spec, held, ahead, job_id, key, estimate, lease_token, priority, now):
    """The call waits in its limit's queue (see ``HORIZON``): its reservation queued, a ``Decision``.

    Its run parks until about when its turn to book comes (the runs ahead of it, each one
    call's spacing, after the horizon's end), or until a call going before wakes it.
    """
    if held is None:
        held_id = Reservation.objects.create(limit=spec.name, job_id=job_id, key=key, state=ReservationState.QUEUED,
                                             estimate=estimate, lease_token=lease_token, priority=priority).pk
    else:
        held_id = held.pk
        Reservation.objects.filter(pk=held.pk).update(lease_token=lease_token)
    limit = Limit.objects.filter(name=spec.name).values("requests_free", "tokens_free", "paused_until",
                                                         "booked_tokens").first() or {}
    ends = max([now.timestamp(), *(v for k, v in limit.items() if k != "booked_tokens" and v is not None)])
    # Room to book comes when the schedule's end is within the horizon, one call's spacing
    # later for each run before it.
    wait = max(0.0, ends - now.timestamp() - HORIZON) + ahead * spec.spacing(limit.get("booked_tokens") or 0)
    paused = (limit.get("paused_until") or 0) > now.timestamp() + HORIZON
    return Decision(False, now + datetime.timedelta(seconds=max(QUEUED_MIN, wait)), now, ids=(held_id,), queued=True,
                    why=f"limit {spec.name}: {ahead} calls queued before it, of its priority ({priority}) or higher"
                        + ("; paused by the provider's 429" if paused else f" ({spec.describe()})"))


SETTLE = """
UPDATE durable_limit
SET tokens_free = CASE WHEN tokens_free IS NULL THEN NULL ELSE tokens_free - %s * (%s - %s) END,
    token_ratio = token_ratio * %s + %s,
    updated = CURRENT_TIMESTAMP
WHERE name = %s
"""


def _close(ids, state, specs, *, used=None, input_tokens=0, pause=None, message=""):
    """End the call's reservations in ``state``; with ``used``, settle its tokens; with ``pause``, pause."""
    specs = {spec.name: spec for spec in specs}
    now = database.current().now() if pause is not None else Now()
    rows = list(Reservation.objects.filter(
        pk__in=ids, state__in=[*ReservationState.waiting(), ReservationState.CALLING]))
    woken = []
    for row in sorted(rows, key=lambda r: r.limit):
        spec = specs.get(row.limit)
        calling = row.state == ReservationState.CALLING
        per_token = spec.seconds_per_token() if spec is not None else None
        # The provider's count beside the estimate teaches the limit its ratio.
        keep, seen = rules.learning(row.estimate, input_tokens) if calling else (1.0, 0.0)
        if calling and ((used is not None and per_token is not None) or seen):
            with connection.cursor() as cursor:
                cursor.execute(SETTLE, [per_token or 0.0, row.tokens, row.tokens if used is None else used,
                                        keep, seen, row.limit])
        if pause is not None:
            until = now.timestamp() + max(0.0, float(pause))
            Limit.objects.filter(name=row.limit).update(refused_at=now, refusal=message[:500],
                                                        refusals=F("refusals") + 1, updated=now)
            # The later of two pauses wins, whichever worker records it last.
            Limit.objects.filter(Q(paused_until__isnull=True) | Q(paused_until__lt=until),
                                 name=row.limit).update(paused_until=until)
        if calling and spec is not None and spec.concurrent:
            woken.append(row.limit)
    Reservation.objects.filter(pk__in=[r.pk for r in rows]).update(state=state, used_tokens=used, settled_at=now)
    for name in woken:
        wake_queued(name)
    return len(rows)


def settle(ids, input_tokens, output_tokens, specs):
    """The call was answered: its tokens are the reply's usage, what it booked beyond comes back.

    Its input tokens teach the limit how far the estimate from characters is from the
    provider's count.
    """
    return _close(ids, ReservationState.SETTLED, specs, used=int(input_tokens) + int(output_tokens),
                  input_tokens=int(input_tokens))


def refuse(ids, retry_after, message, specs):
    """The provider answered 429: pause the call's limits for every worker until ``retry_after``.

    Nothing was used: the tokens the call booked come back.
    """
    return _close(ids, ReservationState.REFUSED, specs, used=0, pause=retry_after, message=message)


def release(ids, specs):
    """The call failed otherwise (timeout, cut, 5xx): its booking stays spent, its slot comes back."""
    return _close(ids, ReservationState.RELEASED, specs)


def wake_queued(name):
    """Make the job that queued longest for limit ``name`` due now (highest priority first)."""
    # Only a run still parked: a job cancelled or finished meanwhile keeps its row but no turn,
    # and one already due (woken by the call before) is not woken twice.
    head = (Reservation.objects.filter(limit=name, state=ReservationState.QUEUED, job__lease_owner__isnull=True,
                                       job__next_run_at__gt=Now())
            .order_by("-priority", "pk").values_list("job_id", "job__workflow").first())
    if head is not None:
        wake_parked(*head)


def paused_until(names):
    """The end of the latest pause of the limits ``names`` (an epoch on the database's clock), or None."""
    return Limit.objects.filter(name__in=names).aggregate(until=Max("paused_until"))["until"]


def now_plus_seconds(seconds):
    """The database's clock ``seconds`` from now, as an aware datetime."""
    return database.current().now() + datetime.timedelta(seconds=float(seconds))


def unpause(name):
    """An operator lifts a provider's pause now (the limits page)."""
    return Limit.objects.filter(name=name).update(paused_until=None, updated=Now())
