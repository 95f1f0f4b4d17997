"""The drills. Each takes a Lab and a Size and returns rows of counts.

Every drill ends the same way: the faulty processes are stopped, clean workers run
until every job is settled (the quiet period), and the counts are taken from the
database, the executions log and the receiver.
"""

import glob
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from django.db import connection

import durable
from durable import faults
from durable.models import EventKind, JobEvent

from .counts import count
from .lab import ROOT, Pool, sigkill_deaths


@dataclass(frozen=True)
class Size:
    """How big each drill is: ``small`` runs in CI, ``release`` before a release."""

    name: str
    fault_jobs: int  # jobs per fault point, each point fired once
    random_jobs: int  # jobs under random fault-point kills (0: skip)
    random_probability: float  # chance of a kill at each fault point reached
    random_workers: int
    storm_jobs: int  # kill storm: jobs of four steps
    storm_workers: int
    storm_kill_every: float  # seconds between random worker kills
    hold_jobs: int  # paused lease holders
    terminate_jobs: int  # jobs running while connections are terminated
    terminate_every: float  # mean seconds between rounds of pg_terminate_backend
    terminate_rounds: int
    restart_postgres: bool
    skew_jobs: int
    contention_jobs: int
    contention_workers: int
    matrix_jobs: int  # jobs per cell of the receiver matrix
    settle_timeout: float


SIZES = {
    "small": Size(
        name="small", fault_jobs=4, random_jobs=0, random_probability=0.0, random_workers=2,
        storm_jobs=400, storm_workers=4, storm_kill_every=0.5, hold_jobs=2,
        terminate_jobs=80, terminate_every=0.5, terminate_rounds=8, restart_postgres=False,
        skew_jobs=10, contention_jobs=120, contention_workers=4, matrix_jobs=2,
        settle_timeout=60,
    ),
    "release": Size(
        name="release", fault_jobs=20, random_jobs=4000, random_probability=0.02,
        random_workers=4, storm_jobs=10_000, storm_workers=8, storm_kill_every=3.0, hold_jobs=6,
        terminate_jobs=1500, terminate_every=1.0, terminate_rounds=120, restart_postgres=True,
        skew_jobs=100, contention_jobs=2000, contention_workers=4, matrix_jobs=25,
        settle_timeout=300,
    ),
}

_QUOTED = re.compile(r"""["'](\w+)["']""")


def wired_points():
    """Fault points the engine (and the drill workflow, for mid_step) actually reaches."""
    source = Path(faults.__file__).parent
    found = {"mid_step"}  # called by the drill workflow's step bodies
    for path in source.rglob("*.py"):
        for line in path.read_text().splitlines():
            if "faults.point(" in line and "def point" not in line:
                found.update(_QUOTED.findall(line))
    return [p for p in faults.POINTS if p in found]


# Points a plain four-step job reaches; the others need actions or approvals.
JOB_POINTS = (
    "after_claim", "before_step", "mid_step", "after_step_before_commit", "after_commit",
    "before_final_transition", "after_final_transition", "during_backoff",
)


def _wait(predicate, timeout, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


# 1. Every fault point, once ----------------------------------------------------------


def fault_point_once(lab, point, size):
    """SIGKILL a runworkers child the first time it reaches ``point``, then settle and count."""
    began = time.monotonic()
    payload = {"fail_once": "b"} if point == "during_backoff" else {}
    lab.submit(size.fault_jobs, prefix=point.replace("_", "-"), **payload)
    proc = lab.runworkers(1, fault=f"{point}@1")
    _wait(lambda: sigkill_deaths(lab.output(proc), False) or lab.unsettled() == 0, 30)
    fired = bool(sigkill_deaths(lab.output(proc), False))
    lab.stop(proc)
    settled = lab.settle(size.settle_timeout)
    row = count(lab, f"fault {point}", began=began)
    if not fired:
        row.notes.append(f"the fault point {point} was never reached")
    if not settled:
        row.notes.append("the quiet period ended with unsettled jobs")
    row.extra["fired"] = fired
    return row


# 1b. Random kills at every fault point ----------------------------------------------


def random_fault_kills(lab, size, points=JOB_POINTS):
    """Kill workers at random fault points, thousands of times (bare workers, replaced at once)."""
    began = time.monotonic()
    spec = ",".join(f"{p}~{size.random_probability}" for p in points if p in wired_points())
    lab.submit(size.random_jobs, prefix="random", fail_once="c")
    pool = Pool(lab, size.random_workers, fault=spec)
    deadline = time.monotonic() + max(120, size.random_jobs * 0.5)
    try:
        while time.monotonic() < deadline and lab.unsettled():
            pool.tick()
            time.sleep(0.05)
    finally:
        pool.stop()
    settled = lab.settle(size.settle_timeout, processes=size.random_workers)
    row = count(lab, "random fault kills", began=began)
    if not settled:
        row.notes.append("the quiet period ended with unsettled jobs")
    return row


# 2. Kill storm ------------------------------------------------------------------------


def kill_storm(lab, size):
    """N runworkers children on four-step jobs; SIGKILL a random one every few seconds."""
    began = time.monotonic()
    lab.submit(size.storm_jobs, prefix="storm", work=0.002)
    proc = lab.runworkers(size.storm_workers)
    lab.wait_for_workers(proc, size.storm_workers)
    deadline = time.monotonic() + max(120, size.storm_jobs * 0.2)
    next_kill = time.monotonic() + size.storm_kill_every
    while time.monotonic() < deadline and lab.unsettled():
        if time.monotonic() >= next_kill:
            lab.kill_random_worker(proc)
            next_kill = time.monotonic() + size.storm_kill_every
        time.sleep(0.05)
    lab.stop(proc)
    settled = lab.settle(size.settle_timeout)
    row = count(lab, f"kill storm x{size.storm_workers}", began=began)
    if not settled:
        row.notes.append("the quiet period ended with unsettled jobs")
    return row


# 3. Paused lease holder ---------------------------------------------------------------


def paused_holder(lab, size):
    """SIGSTOP workers inside a step past their lease, let others finish, SIGCONT: no commit."""
    began = time.monotonic()
    keys = lab.submit(size.hold_jobs, prefix="hold", workflow="drill_hold",
                      hold={"step": "b", "seconds": 1.0, "attempt": 1})
    holder = lab.runworkers(size.hold_jobs)
    inside = {}

    def holders_inside():
        for line in _lines(lab.exec_log):
            kind, job, step, attempt, pid = line
            if kind == "exec" and step == "b" and attempt == "1":
                inside[job] = int(pid)
        return len(inside) == len(keys)

    if not _wait(holders_inside, 30, 0.02):
        raise RuntimeError(f"holders never reached step b:\n{lab.output(holder)}")
    repauses = _pause_outside_write_lock(lab, set(inside.values()))
    # Others take over once the lease passes, and finish the jobs.
    others = lab.runworkers(2)
    finished = _wait(lambda: lab.done(keys) == len(keys), 60)
    resumed_at = JobEvent.objects.filter(job_id__in=keys).order_by("-id").values_list(
        "id", flat=True).first() or 0
    paused = set(inside.values())
    for pid in paused:
        lab.resume(pid)
    # The paused holders come back inside step b, finish it and try to commit.
    returned = _wait(lambda: all(
        ("done", job, "b", "1", str(pid)) in set(_lines(lab.exec_log)) for job, pid in inside.items()
    ), 15)
    time.sleep(1.0)  # room for a wrong commit to land, if fencing failed
    # What the paused holders wrote on these jobs once resumed: each write is one their
    # lost leases should have refused (the other workers' writes are theirs to make).
    late_events = sum(
        1 for actor in JobEvent.objects.filter(job_id__in=keys, id__gt=resumed_at)
        .values_list("actor", flat=True)
        if any(f":{pid}:" in actor for pid in paused)
    )
    lab.stop(others)
    lab.stop(holder)
    row = count(lab, "paused holder", began=began)
    # paused: the held steps whose process was paused (with threads, one process may hold
    # several of them); paused_processes: the processes.
    row.extra.update(paused=len(inside), paused_processes=len(paused), finished=finished,
                     returned_to_commit=returned, late_events=late_events, repauses=repauses)
    if not finished:
        row.notes.append("the other workers did not finish the held jobs")
    if not returned:
        row.notes.append("the paused holders never got back to their commit: drill proved nothing")
    if late_events:
        row.stale += late_events
        row.notes.append(f"the paused holders wrote {late_events} events once resumed")
    return row


def _pause_outside_write_lock(lab, pids, tries=20):
    """SIGSTOP ``pids`` at a moment none of them holds SQLite's write lock; return the retries.

    With threads, a holder paused inside its step may have another thread inside a
    transaction (a lease renewal, a claim). SQLite has one write lock for the whole
    database, so that frozen transaction would stall every other writer: the takeover
    this drill is about could not happen at all (the README says so under its limits). PostgreSQL's row
    locks confine such a stall to the frozen rows, so there the first pause stands.
    """
    for retry in range(tries):
        for pid in pids:
            lab.pause(pid)
        if connection.vendor != "sqlite" or _sqlite_writable(connection.settings_dict["NAME"]):
            return retry
        for pid in pids:
            lab.resume(pid)
        time.sleep(0.02)
    raise RuntimeError(f"the paused holders held SQLite's write lock {tries} times in a row")


def _sqlite_writable(path, wait=0.5):
    import sqlite3

    probe = sqlite3.connect(path, timeout=wait, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


def _lines(path):
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [tuple(line.split()) for line in text.splitlines() if len(line.split()) == 5]


# 5. Database connections killed, PostgreSQL restarted ----------------------------------


def _terminate_backends(window=1.0):
    """Kill worker connections: one caught inside a transaction if one shows up in ``window``
    seconds, else every worker connection (the next query of each finds it dead).

    Returns ``(mid_transaction, other)`` counts of terminated backends.
    """
    base = ("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'")
    deadline = time.monotonic() + window
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(base + " AND xact_start IS NOT NULL")
            caught = cursor.fetchone()[0]
            if caught:
                return caught, 0
        cursor.execute(base)
        return 0, cursor.fetchone()[0]


def _worker_restarts(lab, proc):
    return len(re.findall(r"died \(exit code", lab.output(proc)))


def terminated_connections(lab, size):
    """Kill worker connections mid-transaction over and over: workers reconnect on their own."""
    began = time.monotonic()
    lab.submit(size.terminate_jobs, prefix="term", work=0.05)
    proc = lab.runworkers(3)
    lab.wait_for_workers(proc, 3)
    mid = idle = rounds = 0
    while rounds < size.terminate_rounds and lab.unsettled():
        time.sleep(lab.rng.uniform(0.5, 1.5) * size.terminate_every)
        caught, other = _terminate_backends()
        mid, idle, rounds = mid + caught, idle + other, rounds + 1
    # The same workers, never restarted, must finish everything.
    recovered = lab.wait_settled(max(60, size.terminate_jobs * 0.2), proc)
    restarts = _worker_restarts(lab, proc)
    lab.stop(proc)
    settled = lab.settle(size.settle_timeout)
    row = count(lab, "pg_terminate_backend", began=began,
                extra={"mid_transaction": mid, "between_transactions": idle, "rounds": rounds,
                       "worker_restarts": restarts,
                       "recovered": recovered})
    if not recovered:
        row.notes.append("the workers did not finish the jobs on their own")
    if restarts:
        row.notes.append(f"{restarts} worker processes died and were replaced")
    if not settled:
        row.notes.append("the quiet period ended with unsettled jobs")
    return row


def postgres_cluster():
    """(version, name) of the local PostgreSQL cluster, or None."""
    if not shutil.which("pg_lsclusters"):
        return None
    out = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == str(connection.settings_dict.get("PORT") or 5432):
            return parts[0], parts[1]
    return None


def _ensure_postgres_running(cluster):
    version, name = cluster
    for _ in range(3):
        status = subprocess.run(["pg_lsclusters", "--no-header", version, name],
                                capture_output=True, text=True).stdout
        if "online" in status:
            return True
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, name, "start"],
                       capture_output=True)
        time.sleep(1)
    return False


def postgres_restart(lab, size):
    """Restart PostgreSQL under load: workers recover without a restart of their own."""
    cluster = postgres_cluster()
    if cluster is None:
        raise RuntimeError("no local PostgreSQL cluster to restart (pg_lsclusters)")
    began = time.monotonic()
    lab.submit(size.terminate_jobs, prefix="restart", work=0.01)
    proc = lab.runworkers(3)
    lab.wait_for_workers(proc, 3)
    _wait(lambda: lab.done() > 0, 30)
    version, name = cluster
    try:
        result = subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", version, name, "restart", "-m", "fast"],
            capture_output=True, text=True, timeout=120,
        )
    finally:
        running = _ensure_postgres_running(cluster)
    connection.close()
    if not running:
        raise RuntimeError("PostgreSQL did not come back after the restart")
    _wait(lambda: lab.unsettled() == 0, max(90, size.terminate_jobs * 0.3))
    restarts = _worker_restarts(lab, proc)
    lab.stop(proc)
    settled = lab.settle(size.settle_timeout)
    row = count(lab, "postgres restart", began=began,
                extra={"restart_rc": result.returncode, "worker_restarts": restarts})
    if result.returncode:
        row.notes.append(f"pg_ctlcluster restart failed: {result.stderr.strip()}")
    if restarts:
        row.notes.append(f"{restarts} worker processes died and were replaced")
    if not settled:
        row.notes.append("the quiet period ended with unsettled jobs")
    return row


# 6. Clock skew ------------------------------------------------------------------------

def faketime_library():
    """Debian's libfaketime (package faketime), where ``scripts/system.sh`` looks for it too."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1")) + sorted(
        glob.glob("/usr/lib/faketime/libfaketimeMT.so.1"))
    return found[0] if found else None


def skewed_env(offset):
    """Environment that shifts a process's wall clock by ``offset`` ("+1h", "-1h")."""
    library = faketime_library()
    if library is None:
        raise RuntimeError("libfaketime is not installed: run `sh scripts/system.sh` as root,"
                           " or `apt-get install faketime`")
    # Monotonic time stays real: only the wall clock is wrong, as on a badly synced host.
    return {"LD_PRELOAD": library, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1"}


def clock_skew(lab, size):
    """Workers an hour ahead and an hour behind steal no lease and wake no timer early."""
    from django.db.models import F

    began = time.monotonic()
    # A holder with a true clock works a step longer than the lease (renewing it). One
    # thread each: a process with idle slots beside the held step would claim the jobs
    # meant for the skewed workers, and the drill would exercise nobody's wrong clock.
    one_thread = ("--threads", "1")
    held = lab.submit(1, prefix="skew-held", workflow="drill_hold",
                      hold={"step": "b", "seconds": lab.lease * 2, "attempt": 1})
    holder = lab.runworkers(1, *one_thread)
    if not _wait(lambda: any(line[0] == "exec" and line[2] == "b" for line in _lines(lab.exec_log)),
                 30, 0.02):
        raise RuntimeError(f"the holder never reached step b:\n{lab.output(holder)}")
    # Meanwhile workers whose clocks are an hour off claim everything else.
    ahead = lab.runworkers(2, *one_thread, env=skewed_env("+1h"))
    behind = lab.runworkers(1, *one_thread, env=skewed_env("-1h"))
    ahead_pids = lab.wait_for_workers(ahead, 2)
    behind_pids = lab.wait_for_workers(behind, 1)
    plain = lab.submit(size.skew_jobs, prefix="skew")
    timers = [f"skew-timer-{i}" for i in range(3)]
    for key in timers:
        durable.submit("wait_until", key, {"seconds": 3})
    lab.submitted.extend(timers)
    submitted_at = time.monotonic()
    woke = {}

    def settled():
        for key in timers:
            if key not in woke and lab.done([key]):
                woke[key] = time.monotonic() - submitted_at
        return lab.unsettled() == 0

    _wait(settled, 60, 0.05)
    for proc in (ahead, behind, holder):
        lab.stop(proc)
    lab.settle(size.settle_timeout)

    def claims(pids):
        return sum(JobEvent.objects.filter(job_id__in=plain + timers, kind=EventKind.CLAIMED,
                                           actor__contains=f":{pid}:").count() for pid in pids)

    stolen = JobEvent.objects.filter(job_id__in=held, kind=EventKind.RECLAIMED).count()
    runs_of_held = sum(1 for line in _lines(lab.exec_log)
                       if line[0] == "exec" and line[1] in held and line[2] == "b")
    early = sorted(round(s, 2) for s in woke.values() if s < 3.0)
    # Timestamps a skewed worker wrote itself (not with the database clock): an hour off.
    skewed_actors = [f":{pid}:" for pid in ahead_pids + behind_pids]
    stamped = JobEvent.objects.filter(job_id__in=plain + timers).annotate(
        created=F("job__created")).values_list("actor", "at", "created")
    off_by_an_hour = sum(1 for actor, at, created in stamped
                         if any(a in actor for a in skewed_actors)
                         and abs((at - created).total_seconds()) > 1800)
    row = count(lab, "clock skew +-1h", began=began, extra={
        "stolen_leases": stolen, "held_step_runs": runs_of_held, "early_timers": len(early),
        "timer_seconds": sorted(round(s, 2) for s in woke.values()),
        "claims_ahead": claims(ahead_pids), "claims_behind": claims(behind_pids),
        "events_stamped_by_skewed_clock": off_by_an_hour,
    })
    if stolen or runs_of_held != 1:
        row.notes.append(f"a skewed worker stole the held lease ({stolen} reclaims, "
                         f"{runs_of_held} runs of the held step)")
        row.stale += stolen
    if early:
        row.notes.append(f"timers woke early: {early}")
    if not row.extra["claims_ahead"] or not row.extra["claims_behind"]:
        row.notes.append("a skewed worker claimed nothing: the drill did not exercise it")
    return row


# 7. SQLite under contention -----------------------------------------------------------


# The console's operations before any worker starts (it is up and working), and beside
# the workers' writes (counted from when every worker process has claimed a job until
# the last job settles): the workers are kept busy until the console has done these.
CONSOLE_WARM_OPS = 20
CONSOLE_OVERLAP_OPS = 200


def sqlite_contention(lab, size, transaction_mode="IMMEDIATE"):
    """Four workers and a busy console on SQLite; count 'database is locked' wherever it shows.

    The console starts first and the workers only once it is working; more jobs are
    submitted while it has done fewer than CONSOLE_OVERLAP_OPS operations beside the
    workers, so its load overlaps their writes however fast either side runs.
    """
    from durable.models import EventKind, Job, JobEvent

    began = time.monotonic()
    mode = transaction_mode.lower()
    env = {"DURABLE_SQLITE_TRANSACTION_MODE": transaction_mode}
    batch = size.contention_jobs
    lab.submit(batch, prefix=f"busy-{mode}", work=0.001)
    console_log = lab.workdir / f"console-{mode}.json"
    progress = lab.workdir / f"console-{mode}.ops"
    with open(lab.workdir / "console.log", "wb") as err:
        console = subprocess.Popen(
            [sys.executable, "-m", "tests.drills.console", str(console_log), str(lab.exec_log),
             str(progress)],
            cwd=ROOT, env=lab.env(**env), stdout=err, stderr=subprocess.STDOUT,
        )

    seen = [0]

    def console_ops():
        try:  # a read in the middle of the console's rewrite is no figure: the last one stands
            seen[0] = max(seen[0], int(progress.read_text()))
        except (FileNotFoundError, ValueError):
            pass
        return seen[0]

    if not _wait(lambda: console_ops() >= CONSOLE_WARM_OPS or console.poll() is not None, 120, 0.05) \
            or console.poll() is not None:
        console.kill()
        raise RuntimeError("the console did not start working:\n"
                           + (lab.workdir / "console.log").read_text(errors="replace")[-3000:])
    proc = lab.runworkers(size.contention_workers, env=env)
    started, more = {}, [0]

    def keep_busy():
        # Jobs waiting for every worker while the console has not done its share beside them.
        if lab.unsettled() < batch // 2:
            more[0] += 1
            lab.submit(batch, prefix=f"busy-{mode}-more{more[0]}", work=0.001)

    def writing():
        actors = JobEvent.objects.filter(kind=EventKind.CLAIMED).values_list("actor", flat=True)
        return len({actor.split(":")[1] for actor in actors.distinct()}) >= size.contention_workers

    def finished():
        if "ops" not in started:
            keep_busy()
            if writing():
                started["ops"] = console_ops()
            return False
        if console_ops() - started["ops"] < CONSOLE_OVERLAP_OPS:
            keep_busy()
            return False
        return lab.unsettled() == 0

    # DEFERRED only has to show its errors; its workers then back off for long, so the
    # contention phase is cut short and the (IMMEDIATE) quiet period finishes the jobs.
    limit = max(60, size.contention_jobs * 0.5) if transaction_mode == "IMMEDIATE" else 10
    _wait(finished, limit, 0.05)
    overlap = console_ops() - started["ops"] if "ops" in started else 0
    console.terminate()
    try:
        console.wait(40)  # an operation may be waiting out the busy timeout
    except subprocess.TimeoutExpired:
        console.kill()
        console.wait()
    lab.stop(proc)
    report = json.loads(console_log.read_text()) if console_log.exists() else {}
    lab.submitted.extend(report.get("submitted", []))
    settled = lab.settle(size.settle_timeout)
    worker_locked = lab.output(proc).count("database is locked")
    jobs_locked = Job.objects.filter(last_error__contains="database is locked").count()
    row = count(lab, f"sqlite busy ({mode})", began=began, extra={
        "locked_in_workers": worker_locked, "locked_in_console": report.get("locked", 0),
        "jobs_failed_locked": jobs_locked, "console_ops": overlap,
        "console_ops_in_all": report.get("ops", 0), "console_errors": report.get("errors", 0),
        "batches_of_jobs": 1 + more[0],
    })
    if not settled:
        row.notes.append("the quiet period ended with unsettled jobs")
    return row


def locked_errors(row):
    return (row.extra["locked_in_workers"] + row.extra["locked_in_console"]
            + row.extra["jobs_failed_locked"])


# 4. The receiver matrix, and the dispatcher's fault points -----------------------------

ACTION_POINTS = ("after_mark_attempted", "after_send_before_record")
# (mode of the receiver's first reply to each action, what it stands for)
RECEIVER_MODES = (
    ("hang_before_acting", "no reply"),
    ("drop_after_acting", "reply lost after acting"),
    ("error_after_acting", "500 after acting"),
    ("slow_after_acting", "reply slower than our timeout"),
)
READ_TIMEOUT = 1.0


def receiver_env(receiver, read_timeout=READ_TIMEOUT):
    """Point the ``test_receiver`` destination of worker processes at ``receiver``."""
    return {
        "DURABLE_TEST_RECEIVER_URL": receiver.url,
        "DURABLE_TEST_RECEIVER_IDEMPOTENT": "1" if receiver.idempotent else "0",
        "DURABLE_TEST_RECEIVER_LOOKUP": "1" if receiver.lookup else "0",
        "DURABLE_TEST_RECEIVER_READ_TIMEOUT": str(read_timeout),
    }


def _effects(receiver, keys=None):
    """(job, kind) of every action the receiver applied (the ticket's customer is its job)."""
    out = []
    for action in receiver.actions:
        job = (action.get("body") or {}).get("values", action.get("body") or {}).get("customer")
        if keys is None or job in keys:
            out.append((job, "create_ticket"))
    return out


def _posts_per_key(receiver, keys):
    from collections import Counter

    from durable.models import Outbox

    wanted = set(Outbox.objects.filter(job_id__in=keys).values_list("idempotency_key", flat=True))
    return Counter(e["key"] for e in receiver.log
                   if e["method"] == "POST" and e["path"].startswith("/actions") and e["key"] in wanted)


def action_fault_once(lab, point, size):
    """SIGKILL the dispatcher at ``point`` while it sends ticket actions; settle and count."""
    from durable.testing import Receiver

    began = time.monotonic()
    with Receiver(idempotent=True, lookup=True) as receiver:
        env = receiver_env(receiver)
        keys = [f"{point.replace('_', '-')}-{i:05d}" for i in range(size.fault_jobs)]
        for key in keys:
            durable.submit("ticket", key, {"customer": key})
        lab.submitted.extend(keys)
        proc = lab.runworkers(1, fault=f"{point}@1", env=env)
        _wait(lambda: sigkill_deaths(lab.output(proc), False) or lab.unsettled() == 0, 30)
        fired = bool(sigkill_deaths(lab.output(proc), False))
        lab.stop(proc)
        settled = lab.settle(size.settle_timeout, env=env)
        row = count(lab, f"fault {point}", began=began, effects=_effects(receiver, set(keys)))
        row.extra["fired"] = fired
        row.extra["receiver_posts"] = sum(_posts_per_key(receiver, keys).values())
    if not fired:
        row.notes.append(f"the fault point {point} was never reached")
    if not settled:
        row.notes.append("the quiet period ended with unsettled jobs")
    return row


def receiver_matrix(lab, size):
    """Idempotent or not x lookup or not x four ambiguous replies: count effects and resends.

    Four receivers run side by side, one per destination of the matrix, served by one
    runworkers; the modes run one after another, each spoiling the first send of
    every job of that round.
    """
    import copy

    from durable.models import Outbox, OutboxStatus
    from durable.testing import Receiver
    from tests.testapp.drill_workflows import MATRIX

    began = time.monotonic()
    receivers = {name: Receiver(idempotent=i, lookup=lk).start()
                 for name, (i, lk) in MATRIX.items()}
    env = {f"DURABLE_DRILL_RECEIVER_{name.upper()}": r.url for name, r in receivers.items()}
    proc = lab.runworkers(2, env=env)
    rows = []
    try:
        cells = {}
        for mode, _ in RECEIVER_MODES:
            round_keys = []
            for name, receiver in receivers.items():
                keys = [f"matrix-{name}-{mode}-{i:03d}".replace("_", "-")
                        for i in range(size.matrix_jobs)]
                receiver.behave(mode, times=size.matrix_jobs, delay=READ_TIMEOUT * 2)
                for key in keys:
                    durable.submit("ticket", key, {"customer": key, "destination": name})
                cells[(name, mode)] = keys
                round_keys.extend(keys)
            _wait(lambda keys=round_keys: lab.unsettled_among(keys) == 0, 60, 0.1)
        lab.stop(proc)
        lab.submitted = [k for keys in cells.values() for k in keys]
        lab.settle(size.settle_timeout, env=env)
        for (name, mode), keys in cells.items():
            receiver = receivers[name]
            idem, look = MATRIX[name]
            cell = copy.copy(lab)
            cell.submitted = keys
            label = (f"receiver {'idempotent' if idem else 'plain'}{' + lookup' if look else ''}:"
                     f" {dict(RECEIVER_MODES)[mode]}")
            effects = _effects(receiver, set(keys))
            row = count(cell, label, began=began, effects=effects)
            posts = _posts_per_key(receiver, keys)
            queue = Outbox.objects.filter(job_id__in=keys, status=OutboxStatus.UNKNOWN,
                                          next_attempt_at=None).count()
            row.extra.update(
                applied=len(effects), resends=sum(n - 1 for n in posts.values() if n > 1),
                reconciliation_queue=queue, done=lab.done(keys), blind=not (idem or look),
            )
            rows.append(row)
    finally:
        for receiver in receivers.values():
            receiver.stop()
    return rows


def matrix_problems(row):
    """What a receiver-matrix row must show beyond the common targets."""
    out = []
    if row.extra["blind"]:
        # Neither idempotency nor lookup: never resend, every job waits for a person.
        if row.extra["resends"]:
            out.append(f"{row.extra['resends']} automatic resends to a receiver without "
                       "idempotency or lookup")
        if row.extra["reconciliation_queue"] != row.jobs:
            out.append(f"only {row.extra['reconciliation_queue']} of {row.jobs} ambiguous sends "
                       "reached the reconciliation queue")
    elif row.extra["done"] != row.jobs:
        out.append(f"only {row.extra['done']} of {row.jobs} jobs settled automatically")
    return out


# Approvals: a worker killed while its job waits for a person; a skewed dispatcher ----

APPROVAL_POINTS = ("during_approval_wait",)
# The refunds destination allows a 3 s exchange; the lease must stay above it.
APPROVAL_ENV_LEASE = 5.0


def _refund_jobs(lab, prefix, count_):
    """Submit ``refund_review`` jobs, each with an order record of its own."""
    from tests.testapp.approval_workflows import write_order

    keys, orders = [], {}
    for i in range(count_):
        path = lab.workdir / f"{prefix}-order-{i}.json"
        order = write_order(path, id=7000 + i, amount="12.50", currency="EUR")
        key = f"{prefix}-{i:05d}"
        durable.submit("refund_review", key, {"order_file": str(path)})
        keys.append(key)
        orders[order["id"]] = key
    lab.submitted.extend(keys)
    return keys, orders


def approve_all(keys, user="drill-operator"):
    """Approve every open proposal of ``keys`` as an operator would, bound to its hash."""
    from durable.actions.approvals import approve
    from durable.models import Approval, ApprovalStatus

    approved = 0
    for approval in Approval.objects.filter(job_id__in=keys, status=ApprovalStatus.REQUESTED):
        approve(approval.pk, approval.proposal_hash, user, "drill")
        approved += 1
    return approved


def _refund_effects(receiver, orders):
    return [(orders.get((a.get("body") or {}).get("order")), "refund") for a in receiver.actions]


def _awaiting_approval(keys):
    from durable.models import Approval, ApprovalStatus

    return Approval.objects.filter(job_id__in=keys, status=ApprovalStatus.REQUESTED).count()


def approval_fault_once(lab, point, size):
    """Kill the worker right after it proposes; approve; every refund is sent exactly once."""
    from durable.testing import Receiver

    began = time.monotonic()
    with Receiver(idempotent=True, lookup=True) as receiver:
        env = {"DURABLE_TEST_REFUNDS_URL": receiver.url, "DURABLE_LEASE_SECONDS": APPROVAL_ENV_LEASE}
        keys, orders = _refund_jobs(lab, point.replace("_", "-"), size.fault_jobs)
        proc = lab.runworkers(1, fault=f"{point}@1", env=env)
        _wait(lambda: sigkill_deaths(lab.output(proc), False) or lab.unsettled() == 0, 30)
        fired = bool(sigkill_deaths(lab.output(proc), False))
        lab.stop(proc)
        lab.settle(size.settle_timeout, env=env)  # every job proposes and waits for a person
        proposals = _awaiting_approval(keys)
        approved = approve_all(keys)
        settled = lab.settle(size.settle_timeout, env=env)
        row = count(lab, f"fault {point}", began=began,
                    effects=_refund_effects(receiver, orders),
                    extra={"fired": fired, "proposals": proposals, "approved": approved,
                           "refunds_applied": len(receiver.actions)})
    if not fired:
        row.notes.append(f"the fault point {point} was never reached")
    if not settled:
        row.notes.append("the quiet period ended with unsettled jobs")
    return row


def clock_skew_approvals(lab, size):
    """A worker and dispatcher an hour ahead expire no ten-minute approval early."""
    from durable.models import Approval, ApprovalStatus
    from durable.testing import Receiver

    began = time.monotonic()
    with Receiver(idempotent=True, lookup=True) as receiver:
        env = {"DURABLE_TEST_REFUNDS_URL": receiver.url, "DURABLE_LEASE_SECONDS": APPROVAL_ENV_LEASE,
               **skewed_env("+1h")}
        keys, orders = _refund_jobs(lab, "skew-approval", max(2, size.skew_jobs // 5))
        proc = lab.runworkers(1, env=env)
        _wait(lambda: _awaiting_approval(keys) == len(keys), 30)
        approved = approve_all(keys)
        done = _wait(lambda: lab.done(keys) == len(keys), 30)
        lab.stop(proc)
        expired = Approval.objects.filter(job_id__in=keys, status=ApprovalStatus.EXPIRED).count()
        row = count(lab, "clock skew +1h: approvals", began=began,
                    effects=_refund_effects(receiver, orders),
                    extra={"approved": approved, "expired_early": expired,
                           "refunds_applied": len(receiver.actions), "all_refunded": done})
    if expired or not done:
        row.notes.append(f"{expired} ten-minute approvals expired under a clock an hour ahead")
    return row
