"""Provider limits in the database: book a call's moment, start it, settle it, pause on a 429.

Every worker on every host paces its model calls by the same ``Limit`` rows, each
written in a short transaction that locks the limit's row (``SELECT ... FOR UPDATE`` on
PostgreSQL; SQLite's IMMEDIATE transaction holds its one write lock): two workers never
book the same moment. The arithmetic is ``durable.core.limits``'s; here it meets the
database clock, and each call's share of each limit is a ``Reservation`` row:

- ``reserve`` books the call's moment on each limit that covers it (or finds the one it
  booked before it was throttled) and says when it may go; a call whose limits have
  room now starts at once (its reservations turn ``calling``);
- ``settle`` records the reply's usage (tokens booked and not used come back), ``refuse``
  a 429 (the limit pauses for every worker until its Retry-After), ``release`` a call
  that failed otherwise;
- a concurrent slot is held by a ``calling`` reservation only while its job holds the
  lease it was taken under, so a run that dies gives its slot back when its lease
  passes; a slot given back wakes the run that has queued longest for one.
"""

import datetime
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Exists, F, OuterRef
from django.db.models.functions import Now

from ..core import limits as rules
from ..models import Job, Limit, Reservation, ReservationState
from . import database

# A booked moment this late is still used; one later belongs to a run that was away
# (killed, drained): the moment passed unused and the call books a new one.
STALE_SECONDS = 2.0
# Seconds a run waits for a concurrent slot before it looks again, if no slot given back
# wakes it first.
QUEUED_RECHECK = 5.0


@dataclass(frozen=True)
class Decision:
    """What ``reserve`` decided: go at ``at`` (now or within moments), or wait until ``at``."""

    go: bool
    at: datetime.datetime
    now: datetime.datetime  # the database's clock when it was decided
    why: str = ""  # for a wait: which limit, and what it waits for
    ids: tuple = ()  # the call's reservations (for start / settle / refuse / release)
    queued: bool = False  # waits for a concurrent slot, not for a moment


def _epoch(moment):
    return None if moment is None else moment.timestamp()


def _moment(seconds):
    return None if seconds is None else datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)


def _locked(name):
    """The limit's row, locked for this transaction (created on its first use)."""
    Limit.objects.get_or_create(name=name)
    return Limit.objects.select_for_update().get(name=name)


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


def reserve(specs, job_id, lease_token, key, tokens, priority=0):
    """Book a call of ``tokens`` on every limit in ``specs``; a ``Decision`` on when it may go.

    A run that comes back for a call it booked before finds its moment; one that comes
    back after its moment passed (it was killed or drained meanwhile) books a new one.
    Booked calls go in the order they booked; a call waiting for a concurrent slot is
    queued and woken when one is given back.
    """
    with transaction.atomic():
        now = database.current().now()
        mine = {r.limit: r for r in Reservation.objects.select_for_update().filter(
            job_id=job_id, key=key, state__in=[*ReservationState.waiting(), ReservationState.CALLING])}
        at, waits, ids, slots_full = now, [], [], None
        for spec in sorted(specs, key=lambda spec: spec.name):
            limit = _locked(spec.name)
            held = mine.get(spec.name)
            if held is not None and held.state == ReservationState.CALLING:
                # Taken by an earlier attempt (under an older lease) that never settled.
                held.state, held.settled_at = ReservationState.RELEASED, now
                held.save(update_fields=["state", "settled_at"])
                held = None
            if held is not None and held.state == ReservationState.BOOKED and held.starts_at is not None \
                    and (now - held.starts_at).total_seconds() > STALE_SECONDS:
                held.state, held.settled_at = ReservationState.RELEASED, now
                held.save(update_fields=["state", "settled_at"])
                held = None
            if spec.concurrent and _free_slots(spec, now) <= 0:
                slots_full = spec
                if held is None:
                    held = Reservation.objects.create(limit=spec.name, job_id=job_id, key=key,
                                                      state=ReservationState.QUEUED, tokens=tokens,
                                                      lease_token=lease_token, priority=priority)
                ids.append(held.pk)
                continue
            if held is None or held.state == ReservationState.QUEUED:
                start, schedule = rules.book(spec, rules.Schedule(
                    _epoch(limit.requests_at), _epoch(limit.tokens_at), _epoch(limit.paused_until)),
                    now.timestamp(), tokens)
                limit.requests_at, limit.tokens_at = _moment(schedule.requests_at), _moment(schedule.tokens_at)
                limit.updated = now
                limit.save(update_fields=["requests_at", "tokens_at", "updated"])
                if held is None:
                    held = Reservation(limit=spec.name, job_id=job_id, key=key, priority=priority)
                held.state, held.starts_at, held.tokens = ReservationState.BOOKED, _moment(start), tokens
                held.lease_token = lease_token
                held.save()
            ids.append(held.pk)
            if held.starts_at > at:
                at = held.starts_at
                waits.append(f"limit {spec.name}: its turn at {held.starts_at.isoformat()}"
                             + (" (paused by the provider's 429)" if limit.paused_until
                                and limit.paused_until >= held.starts_at - datetime.timedelta(seconds=1)
                                else f" ({spec.describe()})"))
        if slots_full is not None:
            # Wait for a slot; the calls' booked moments (if any) are given back: they would
            # pass while the run waits, and it books new ones when it has a slot.
            Reservation.objects.filter(pk__in=ids, state=ReservationState.BOOKED).update(
                state=ReservationState.QUEUED, starts_at=None)
            return Decision(False, now + datetime.timedelta(seconds=QUEUED_RECHECK), now,
                            why=f"limit {slots_full.name}: all {slots_full.concurrent} calls at once are"
                                " in flight; waiting for one to finish", ids=tuple(ids), queued=True)
        go = at <= now
        if go:
            Reservation.objects.filter(pk__in=ids).update(state=ReservationState.CALLING,
                                                          lease_token=lease_token)
        return Decision(go, at, now, why="; ".join(waits[-1:]), ids=tuple(ids))


def start(ids, lease_token):
    """The call goes now: its reservations (booked moments that came) turn ``calling``."""
    return Reservation.objects.filter(pk__in=ids, state=ReservationState.BOOKED).update(
        state=ReservationState.CALLING, lease_token=lease_token)


def _close(ids, state, specs, *, used=None, pause=None, message=""):
    """End the call's reservations in ``state``; with ``used``, settle its tokens; with ``pause``, pause."""
    specs = {spec.name: spec for spec in specs}
    with transaction.atomic():
        now = database.current().now()
        rows = list(Reservation.objects.select_for_update().filter(
            pk__in=ids, state__in=[*ReservationState.waiting(), ReservationState.CALLING]))
        woken = []
        # Limits locked in name order, as ``reserve`` does: two calls never wait on each other.
        for row in sorted(rows, key=lambda r: r.limit):
            limit = _locked(row.limit)
            spec = specs.get(row.limit)
            fields = ["updated"]
            if used is not None and spec is not None and limit.tokens_at is not None \
                    and row.state == ReservationState.CALLING:
                limit.tokens_at = _moment(rules.give_back(spec, _epoch(limit.tokens_at), row.tokens, used))
                fields.append("tokens_at")
            if pause is not None:
                until = now + datetime.timedelta(seconds=max(0.0, float(pause)))
                if limit.paused_until is None or limit.paused_until < until:
                    limit.paused_until = until
                limit.refused_at, limit.refusal = now, message[:500]
                limit.refusals = F("refusals") + 1
                fields += ["paused_until", "refused_at", "refusal", "refusals"]
            limit.updated = now
            limit.save(update_fields=fields)
            if row.state == ReservationState.CALLING and spec is not None and spec.concurrent:
                woken.append(row.limit)
        Reservation.objects.filter(pk__in=[r.pk for r in rows]).update(
            state=state, used_tokens=used, settled_at=now)
        for name in woken:
            wake_queued(name)
    return len(rows)


def settle(ids, used_tokens, specs):
    """The call was answered: its tokens are the reply's usage, what it booked beyond comes back."""
    return _close(ids, ReservationState.SETTLED, specs, used=int(used_tokens))


def refuse(ids, retry_after, message, specs):
    """The provider answered 429: pause the call's limits for every worker until ``retry_after``.

    Nothing was used: the tokens the call booked come back.
    """
    return _close(ids, ReservationState.REFUSED, specs, used=0, pause=retry_after, message=message)


def release(ids, specs):
    """The call failed otherwise (timeout, cut, 5xx): its booking stays spent, its slot comes back."""
    return _close(ids, ReservationState.RELEASED, specs)


def wake_queued(name):
    """Make the job that queued longest for a slot of limit ``name`` due now (highest priority first)."""
    head = (Reservation.objects.filter(limit=name, state=ReservationState.QUEUED)
            .order_by("-priority", "created", "pk").values_list("job_id", flat=True).first())
    if head is not None:
        Job.objects.filter(pk=head, lease_owner__isnull=True, next_run_at__isnull=False).update(
            next_run_at=Now())


def now_plus_seconds(seconds):
    """The database's clock ``seconds`` from now, as an aware datetime."""
    return database.current().now() + datetime.timedelta(seconds=float(seconds))


def unpause(name):
    """An operator lifts a provider's pause now (the limits page)."""
    return Limit.objects.filter(name=name).update(paused_until=None, updated=Now())
