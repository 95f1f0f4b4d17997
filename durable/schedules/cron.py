"""Declaring schedules, and the ticks they make: pure, no database.

    class Nightly(Workflow):
        name = "nightly"
        schedule = Schedule(cron="0 3 * * *", timezone="Europe/Berlin")

or in settings, for workflows (or ``@task`` functions) a project does not own::

    DURABLE = {"SCHEDULES": {"heartbeat": {"TASK": "myapp.tasks.ping", "EVERY": 60}}}

A cron expression is read by ``cronsim``, which follows Debian cron across daylight
saving changes: an expression with a fixed minute and hour ("30 2 * * *") runs once on
the night the clocks go back (at the first 02:30) and, on the night they go forward, at
the first minute after the gap (03:00 instead of the missing 02:30). Expressions with a
wildcard minute or hour follow absolute time: the repeated hour does happen twice, and
each of its ticks runs once. An interval (``every``) is absolute time, ticking at whole
multiples of itself since 1970-01-01 UTC, so every process computes the same ticks.

``plan()`` decides what one pass of the firer does with the ticks that fell due: which
run, which were missed (downtime), which are skipped or queued (overlap). The firer in
``durable.schedules.firing`` applies the plan under a row lock. A pass that comes late finds
several ticks due at once; each is judged against the runs that were going at its own
time, not against the run the pass itself starts for an earlier one.
"""

import datetime
import json
import zoneinfo
from dataclasses import dataclass, field

from django.core.exceptions import ImproperlyConfigured

UTC = datetime.UTC
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=UTC)

CATCH_UP = ("all", "latest", "none")
OVERLAP = ("skip", "queue", "allow")
# Ticks enumerated at most in one pass; beyond it, missed ticks are counted as "at least".
SCAN_LIMIT = 10_000
# A schedule's name is part of its jobs' keys (255 characters at most).
NAME_MAX = 100


@dataclass(frozen=True)
class Schedule:
    """When to submit a workflow: a cron expression or an interval, with its policies."""

    cron: str | None = None
    # Seconds (whole, at least 1) or a timedelta.
    every: float | datetime.timedelta | None = None
    # The IANA zone the cron expression is read in (intervals are absolute time).
    timezone: str = "UTC"
    # The job's payload (JSON), the same for every tick.
    payload: dict = field(default_factory=dict)
    # Unique among schedules; default: the workflow's name. It is part of each job's key.
    name: str = ""
    # After downtime: run every missed tick (at most max_catch_up), only the latest, or none.
    catch_up: str = "latest"
    max_catch_up: int = 10
    # A tick fired within this many seconds of its time is on time, not missed.
    grace: float = 60.0
    # While the previous run is still going: skip the tick, queue it, or allow a second run.
    overlap: str = "skip"
    queue: str = "default"
    # Set when the schedule is bound to what it runs.
    workflow: str = ""
    task: str = ""

    # Binding and validation -----------------------------------------------------------

    def bound(self, *, workflow="", task="", default_name="", where=""):
        """A copy bound to its target, validated; ImproperlyConfigured names what is wrong."""
        import dataclasses

        bound = dataclasses.replace(self, workflow=workflow or self.workflow,
                                    task=task or self.task, name=self.name or default_name)
        bound.validate(where or bound.name)
        return bound

    def validate(self, where):
        """Raise ImproperlyConfigured naming the first thing wrong with the declaration."""
        for problem in self._problems():
            raise ImproperlyConfigured(f"Schedule {where}: {problem}")

    def _problems(self):
        """What is wrong with the declaration, one sentence each, in the order validate() checks it."""
        if not isinstance(self.name, str) or not self.name or len(self.name) > NAME_MAX:
            yield f"the name must be a non-empty string of at most {NAME_MAX} characters"
        yield from self._when_problems()
        yield from self._policy_problems()
        yield from self._payload_problems()
        if bool(self.workflow) == bool(self.task):
            yield "it must run exactly one workflow or one task"

    def _when_problems(self):
        """Exactly one of a valid cron expression or a whole interval, read in an IANA zone."""
        if (self.cron is None) == (self.every is None):
            yield "declare exactly one of cron= (an expression) or every= (seconds)"
        elif self.cron is not None:
            yield from self._cron_problems()
        elif self.interval_seconds is None:
            yield f"every must be a whole number of seconds of at least 1, not {self.every!r}"
        try:
            self.zone  # noqa: B018 - validates the zone name
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
            yield f"the time zone {self.timezone!r} is not an IANA zone name such as 'Europe/Berlin'"

    def _cron_problems(self):
        """The cron expression is a string cronsim can read."""
        if not isinstance(self.cron, str):
            yield f"cron must be a string, not {self.cron!r}"
            return
        from cronsim import CronSim, CronSimError

        try:
            CronSim(self.cron, datetime.datetime(2000, 1, 1, tzinfo=UTC))
        except CronSimError as exc:
            yield f"the cron expression {self.cron!r} is not valid ({exc})"

    def _policy_problems(self):
        """catch_up and overlap are known and compatible; max_catch_up and grace are in range."""
        if self.catch_up not in CATCH_UP:
            yield f"catch_up must be one of {', '.join(CATCH_UP)}, not {self.catch_up!r}"
        if self.overlap not in OVERLAP:
            yield f"overlap must be one of {', '.join(OVERLAP)}, not {self.overlap!r}"
        if self.catch_up == "all" and self.overlap == "skip":
            yield ("catch_up='all' runs every missed tick, but overlap='skip' allows one run at a"
                   " time and would skip them: choose overlap='queue' (one after another) or"
                   " 'allow' (side by side)")
        if not _whole(self.max_catch_up) or self.max_catch_up < 1:
            yield f"max_catch_up must be a whole number of at least 1, not {self.max_catch_up!r}"
        if isinstance(self.grace, bool) or not isinstance(self.grace, int | float) or not self.grace >= 0:
            yield f"grace must be a number of seconds, not {self.grace!r}"

    def _payload_problems(self):
        """The payload is a dict that JSON can hold (no NaN, no objects)."""
        if not isinstance(self.payload, dict):
            yield f"the payload must be a dict, not {type(self.payload).__name__}"
            return
        try:
            json.dumps(self.payload, allow_nan=False)
        except (TypeError, ValueError) as exc:
            yield f"the payload is not JSON: {exc}"

    @property
    def zone(self):
        return UTC if self.timezone in ("UTC", None, "") else zoneinfo.ZoneInfo(self.timezone)

    @property
    def interval_seconds(self):
        value = self.every
        if isinstance(value, datetime.timedelta):
            value = value.total_seconds()
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if value < 1 or value != int(value):
            return None
        return int(value)

    @property
    def target(self):
        return self.workflow or self.task

    @property
    def spec(self):
        """The declaration that decides ticks; a change of it restarts the schedule's clock."""
        if self.cron is not None:
            return f"cron {self.cron} {self.timezone or 'UTC'}"
        return f"every {self.interval_seconds}s"

    def in_words(self):
        """The expression in ordinary language ("At 03:00 every day (Europe/Berlin)")."""
        if self.cron is None:
            return f"Every {_duration(self.interval_seconds)}"
        from cronsim import CronSim

        text = CronSim(self.cron, datetime.datetime(2000, 1, 1, tzinfo=UTC)).explain()
        return f"{text} ({self.timezone or 'UTC'})"

    # Ticks --------------------------------------------------------------------------

    def ticks(self, after, until, limit=SCAN_LIMIT):
        """The ticks in ``(after, until]`` as UTC datetimes, earliest first, at most ``limit``."""
        if until <= after:
            return []
        seconds = self.interval_seconds
        if seconds is not None:
            first = _interval_index(after, seconds) + 1
            last = _interval_index(until, seconds)
            count = min(max(0, last - first + 1), limit)
            return [EPOCH + datetime.timedelta(seconds=(first + i) * seconds) for i in range(count)]
        from cronsim import CronSim

        found = []
        it = CronSim(self.cron, after.astimezone(self.zone))
        while len(found) < limit:
            try:
                tick = next(it).astimezone(UTC)
            except StopIteration:
                break
            if tick > until:
                break
            if tick > after:  # cronsim works in whole seconds
                found.append(tick)
        return found

    def next_tick(self, after):
        """The first tick strictly after ``after`` (None: the expression never fires again)."""
        seconds = self.interval_seconds
        if seconds is not None:
            return EPOCH + datetime.timedelta(seconds=(_interval_index(after, seconds) + 1) * seconds)
        from cronsim import CronSim

        it = CronSim(self.cron, after.astimezone(self.zone))
        for _ in range(4):
            try:
                tick = next(it).astimezone(UTC)
            except StopIteration:
                return None
            if tick > after:
                return tick
        return None

    def latest_ticks(self, until, count):
        """The ``count`` latest ticks at or before ``until``, earliest first."""
        seconds = self.interval_seconds
        if seconds is not None:
            last = _interval_index(until, seconds)
            return [EPOCH + datetime.timedelta(seconds=(last - i) * seconds)
                    for i in reversed(range(count))]
        from cronsim import CronSim

        found = []
        it = CronSim(self.cron, until.astimezone(self.zone) + datetime.timedelta(seconds=1),
                     reverse=True)
        while len(found) < count:
            try:
                tick = next(it).astimezone(UTC)
            except StopIteration:
                break
            if tick <= until:
                found.append(tick)
        return sorted(set(found))

    def job_key(self, tick):
        """The idempotency key of the job for ``tick``: one job per tick, in every process."""
        return f"schedule:{self.name}:{tick.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def tick_of(job_key):
    """The tick (UTC) a scheduled job's key names, or None for another key (or a run now)."""
    try:
        stamp = str(job_key).rsplit(":", 3)
        return datetime.datetime.strptime(":".join(stamp[-3:]), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None


def _whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _interval_index(moment, seconds):
    """How many whole intervals fit between the epoch and ``moment`` (floor)."""
    delta = moment - EPOCH
    micro = (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
    return micro // (seconds * 1_000_000)


def _duration(seconds):
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds % size == 0 and seconds >= size:
            n = seconds // size
            return unit if n == 1 else f"{n} {unit}s"
    return "second" if seconds == 1 else f"{seconds} seconds"


# One pass's decisions ------------------------------------------------------------------


@dataclass
class Plan:
    """What one pass does: ticks to submit now, and the ticks it decided not to run."""

    fire: list = field(default_factory=list)  # ticks whose job is submitted now
    missed: list = field(default_factory=list)  # late ticks the downtime policy drops
    missed_more: int = 0  # missed ticks beyond those listed (a scan that hit its limit)
    at_least: bool = False  # the scan hit its limit: more ticks than counted were missed
    caught_up: list = field(default_factory=list)  # late ticks that run anyway (a subset of fire)
    skipped: list = field(default_factory=list)  # ticks skipped because a run was going
    queued: list = field(default_factory=list)  # the queue after this pass (ticks waiting)
    newly_queued: list = field(default_factory=list)
    dropped: list = field(default_factory=list)  # queued ticks beyond max_catch_up
    last_tick: datetime.datetime | None = None  # the latest tick decided
    # Ticks after last_tick are due but undecided: nothing ran at their time, and a run
    # fired after them is going now (overlap "skip"); a pass decides them when it ends.
    held: bool = False

    @property
    def missed_count(self):
        return len(self.missed) + self.missed_more


def plan(schedule, *, last_tick, now, previous_going, queued=(), runs=None):
    """Decide one pass: the ticks in ``(last_tick, now]``, the queue, and the policies.

    ``previous_going`` says whether the schedule's previous run is still unfinished.
    ``runs`` are ``(started, ended)`` of the schedule's runs that may have been going at
    the due ticks (``ended`` None: still going); without them, a run still going is taken
    to have been going at every due tick. Pure: the same inputs give the same plan in
    every process.
    """
    result = Plan(last_tick=last_tick, queued=list(queued))
    due = schedule.ticks(last_tick, now) if last_tick is not None else []
    if len(due) >= SCAN_LIMIT and due[-1] < now:
        # A long outage of a frequent schedule: keep the latest ticks (every on-time one
        # and max_catch_up late ones); the scanned ones before them are counted as missed,
        # and the total is a lower bound ("at least").
        latest = schedule.latest_ticks(now, schedule.max_catch_up + _on_time_span(schedule, now))
        result.missed_more = sum(1 for t in due if t < latest[0]) if latest else len(due)
        result.at_least = True
        due = latest
    if due:
        result.last_tick = due[-1]
    horizon = now - datetime.timedelta(seconds=schedule.grace)
    on_time = [t for t in due if t >= horizon]
    late = [t for t in due if t < horizon]
    if schedule.catch_up == "all":
        keep = late[-schedule.max_catch_up:]
    elif schedule.catch_up == "latest":
        keep = [] if on_time else late[-1:]
    else:
        keep = []
    result.missed = [t for t in late if t not in keep]
    result.caught_up = list(keep)
    chosen = keep + on_time

    if schedule.overlap == "allow":
        result.fire = chosen
    elif schedule.overlap == "skip":
        _skip(result, due, chosen, now, last_tick, previous_going,
              list(runs) if runs is not None else [(None, None)] if previous_going else [])
    else:  # queue: ticks wait their turn, one run at a time, at most max_catch_up waiting
        waiting = result.queued + [t for t in chosen if t not in result.queued]
        if not previous_going and waiting:
            result.fire, waiting = waiting[:1], waiting[1:]
        result.newly_queued = [t for t in chosen if t in waiting]
        if len(waiting) > schedule.max_catch_up:
            cut = len(waiting) - schedule.max_catch_up
            result.dropped, waiting = waiting[:cut], waiting[cut:]
        result.queued = waiting
        result.caught_up = [t for t in result.caught_up if t in result.fire]
    return result


def _skip(result, due, chosen, now, last_tick, going, runs):
    """Overlap "skip", one tick at a time: skipped only if a run was going at its time.

    A tick at which nothing ran fires, unless a run fired after it (by this pass, or a
    late earlier one) is going now: then it and the ticks after it wait undecided
    (``held``) until that run ends, so one run at a time holds without calling a tick
    skipped for a run that had not started.
    """
    for tick in chosen:
        if any((start is None or start <= tick) and (end is None or tick < end)
               for start, end in runs):
            result.skipped.append(tick)
        elif going:
            result.held = True
            earlier = [t for t in due if t < tick]
            result.last_tick = earlier[-1] if earlier else last_tick
            break
        else:
            result.fire.append(tick)
            runs.append((now, None))
            going = True
    result.caught_up = [t for t in result.caught_up if t in result.fire]


def _on_time_span(schedule, now):
    seconds = schedule.interval_seconds
    if seconds is not None:
        return int(schedule.grace // seconds) + 1
    return len(schedule.ticks(now - datetime.timedelta(seconds=schedule.grace), now))
