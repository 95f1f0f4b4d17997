"""Roll-ups done on the write side, so that the console's pages only read.

Two tables summarise what would otherwise be read row by row on every page view:

- ``CostMinute``: memo costs per minute (``durable.store.ledger.roll_up_costs``; mark: ``CostMark`` row 1);
- ``MoveMinute``: state moves per minute, from the event log (``roll_up_moves``; mark:
  ``CostMark.moves_through``),
  kept for ``MOVES_KEPT``: the dashboard's trend reads at most its longest window back.

Both are incremental and idempotent, under a row lock, and roll up only minutes that
closed at least ``MARGIN`` ago (rows are stamped with their transaction's start and
become visible at commit). ``RollUps.maybe_run`` is what a worker calls from its loop:
at most one pass per ``DURABLE["ROLLUP_INTERVAL"]`` seconds, the first one a random
part of that interval after the worker starts. ``manage.py durable purge`` and
``manage.py durable rollup`` run a pass too. A page never writes: it reads the rolled
minutes up to the mark and the rows after it (``moves_since``, ``ledger.spent``), so a
mark that lags (no worker running) makes a page slower, never wrong.
"""

import datetime
import logging
import random
import time

from django.db import DatabaseError, InterfaceError, connection, transaction
from django.db.models import Count, F, Sum

from ..models import CostMark, EventKind, Job, JobEvent, MoveMinute
from . import budgets, database, ledger, locking

logger = logging.getLogger("durable.rollups")

MARGIN = ledger.MARGIN
# The dashboard's longest trend window is six hours; a few minutes more are kept.
MOVES_KEPT = datetime.timedelta(hours=6, minutes=10)
# One pass rolls up at most this much of the event log (a short transaction even when
# catching up); a worker behind the clock runs the next pass at once.
PASS_LENGTH = datetime.timedelta(hours=1)

def _minute(moment):
    return moment.replace(second=0, microsecond=0)


def moves_mark():
    """The moment events are rolled up to (events before it are in MoveMinute), or None."""
    return CostMark.objects.filter(pk=1).values_list("moves_through", flat=True).first()


def _events(start, end=None, *, after=False):
    """Events that moved a job, from ``start`` (or just after it) to before ``end``."""
    # Naming every kind lets the (kind, at) index serve a time range.
    events = JobEvent.objects.filter(kind__in=EventKind.values,
                                     **{"at__gt" if after else "at__gte": start})
    if end is not None:
        events = events.filter(at__lt=end)
    return events.exclude(from_state=F("to_state")).order_by()


def roll_up_moves(now=None):
    """Add the state moves of the minutes closed (less MARGIN) since the mark; return the mark.

    At most PASS_LENGTH per call (call again while the mark is behind ``caught_up``).
    The first pass starts MOVES_KEPT back; every pass drops the minutes older than that.
    """
    now = now or locking.db_now()
    end = _minute(now - MARGIN)
    with transaction.atomic():
        current, _ = CostMark.objects.select_for_update().get_or_create(pk=1)
        start = current.moves_through
        if start is not None and start >= end:
            return start
        # Minutes older than MOVES_KEPT would be dropped at once: not read at all.
        start = max(start or end - MOVES_KEPT, end - MOVES_KEPT)
        upto = min(end, start + PASS_LENGTH)
        groups = (
            _events(start, upto)
            .annotate(bucket=_bucket())
            .values("bucket", "job__workflow", "from_state", "to_state")
            .annotate(n=Count("pk"))
            .order_by()
        )
        existing = {(r.minute, r.workflow, r.from_state, r.to_state): r
                    for r in MoveMinute.objects.filter(minute__gte=_minute(start), minute__lt=upto)}
        fresh = []
        for g in groups:
            key = (_as_minute(g["bucket"]), g["job__workflow"], g["from_state"], g["to_state"])
            if key in existing:
                MoveMinute.objects.filter(pk=existing[key].pk).update(moves=F("moves") + g["n"])
            else:
                fresh.append(MoveMinute(minute=key[0], workflow=key[1], from_state=key[2],
                                        to_state=key[3], moves=g["n"]))
        MoveMinute.objects.bulk_create(fresh, batch_size=1000)
        MoveMinute.objects.filter(minute__lt=end - MOVES_KEPT).delete()
        CostMark.objects.filter(pk=1).update(moves_through=upto)
    return upto


def _bucket():
    """The minute of an event's ``at``, computed natively by the database (text on SQLite)."""
    return database.of(connection).minute_of("at")


def _as_minute(value):
    if isinstance(value, str):
        return datetime.datetime.strptime(value[:16], "%Y-%m-%d %H:%M").replace(tzinfo=datetime.UTC)
    return value


def caught_up(mark, now):
    """Whether a roll-up mark is as far as a pass at ``now`` would move it."""
    return mark is not None and mark >= _minute(now - MARGIN)


def moves_since(moment, workflow=None):
    """``({(workflow, state): moves in}, {(workflow, state): moves out})`` after ``moment``.

    Every change of state writes an event in the transaction that makes it, and every
    job is created with its "submitted" event (a move into its first state), so the
    state counts at ``moment`` are the counts now, less what moved in since, plus what
    moved out. Read from the whole minutes rolled up since ``moment`` and the events of
    the minute it falls in and after the mark (two ranges of the (kind, at) index).
    """
    through = moves_mark()
    head = _minute(moment) + datetime.timedelta(minutes=1)
    moved_in, moved_out = {}, {}
    # The oldest minute kept (one probe of the (minute, …) index): a window that starts
    # before it is read from the event log alone.
    floor = MoveMinute.objects.order_by("minute").values_list("minute", flat=True).first()

    def add(wf, frm, to, n):
        if to:
            moved_in[wf, to] = moved_in.get((wf, to), 0) + n
        if frm:
            moved_out[wf, frm] = moved_out.get((wf, frm), 0) + n

    if through is None or through <= head or floor is None or head < floor:
        _add_events(add, moment, None, workflow, after=True)
        return moved_in, moved_out
    rolled = MoveMinute.objects.filter(minute__gte=head, minute__lt=through)
    if workflow:
        rolled = rolled.filter(workflow=workflow)
    for r in rolled.values("workflow", "from_state", "to_state").annotate(n=Sum("moves")).order_by():
        add(r["workflow"], r["from_state"], r["to_state"], r["n"])
    _add_events(add, moment, head, workflow, after=True)
    _add_events(add, through, None, workflow)
    return moved_in, moved_out


def _add_events(add, start, end, workflow, *, after=False):
    """Moves of the events in ``(start, end)``, grouped by the workflow of their job.

    The events are read first (the (kind, at) index), their jobs by key: on SQLite the
    join is written so that the planner cannot start from the job table.
    """
    events = _events(start, end, after=after)
    sql, params = events.values("job_id", "from_state", "to_state").query.sql_with_params()
    job = connection.ops.quote_name(Job._meta.db_table)
    join = database.of(connection).ordered_join
    query = (f"SELECT j.workflow, e.from_state, e.to_state, COUNT(*) FROM ({sql}) e {join} {job} j"
             f" ON j.id = e.job_id{' WHERE j.workflow = %s' if workflow else ''}"
             " GROUP BY j.workflow, e.from_state, e.to_state")
    with connection.cursor() as cursor:
        cursor.execute(query, [*params, *([workflow] if workflow else [])])
        for wf, frm, to, n in cursor.fetchall():
            add(wf, frm, to, n)


def roll_up(now=None, *, catch_up=True):
    """Every roll-up: memo costs, then state moves (all passes the moves need, or one); and the
    budget holds of runs that died during their call, written off once their lease passed
    (until then they stay reserved: the budget's room is the same either way)."""
    now = now or locking.db_now()
    costs = ledger.roll_up_costs(now)
    moves = roll_up_moves(now)
    while catch_up and not caught_up(moves, now):
        moves = roll_up_moves(now)
    budgets.write_off_dead()
    return {"costs": costs, "moves": moves}


class RollUps:
    """What a worker calls from its loop: at most one roll-up pass per ``interval`` seconds.

    The first pass comes a random part of the interval after the worker starts: a fleet
    started by one deploy spreads its passes instead of all taking the write lock at the
    moment each claims its first jobs (on SQLite that would queue every claim behind them).
    """

    def __init__(self, interval):
        self.interval = interval
        self._next = time.monotonic() + random.uniform(0, interval)
        self.passes = 0

    def maybe_run(self):
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.interval
        try:
            done = roll_up(catch_up=False)
            if not caught_up(done["moves"], locking.db_now()):
                self._next = now  # behind the clock: the next pass at the next turn
        except (DatabaseError, InterfaceError):
            raise  # the worker's loop reconnects
        except Exception:  # noqa: BLE001 - a roll-up's bug must not stop the worker running jobs
            logger.exception("rolling up costs and moves failed; the worker goes on running jobs")
            return None
        self.passes += 1
        return done
