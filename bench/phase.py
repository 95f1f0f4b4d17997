"""One measurement in a Django process of its own: ``python -m bench.phase NAME JSON``.

bench/run.py starts one of these per figure with the database chosen in the
environment (see bench/settings.py), so Django's start-up is never inside a
measurement, and prints the result as the last line of stdout (JSON).
Worker processes are real ``manage.py runworkers`` subprocesses.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NOOP_DONE = "three_done"
NOOP_STEPS = 3


def _setup():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def _log_path(args, name):
    return Path(args["log_dir"]) / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"


def start_workers(args, processes, *, burst, name="workers", dispatcher=False, threads=None,
                  dispatcher_only=False):
    """Start ``manage.py runworkers`` with this phase's settings; output goes to a log file.

    No outbox dispatcher unless asked: the no-op and probe workflows send no actions,
    and the figures are the job workers'. ``threads`` asks for T steps in flight per
    process; None leaves the command's default (``DURABLE["THREADS"]``).
    """
    env = dict(os.environ)
    command = [sys.executable, str(ROOT / "manage.py"), "runworkers"]
    if dispatcher_only:
        command.append("--dispatcher-only")
    else:
        command += ["--processes", str(processes)]
    if threads is not None:
        command += ["--threads", str(threads)]
    if burst:
        command.append("--burst")
    if not dispatcher and not dispatcher_only:
        command.append("--no-dispatcher")
    log = open(_log_path(args, name), "wb")  # noqa: SIM115 - closed by the caller via proc.log
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.log = log
    return proc


def wait_rusage(proc, timeout=None):
    """Reap ``proc`` and return (exit code, rusage of it and every descendant it reaped).

    Past ``timeout`` seconds the process group is killed and the figure fails, rather
    than the whole run waiting on a burst that never ends.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is not None:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            os.wait4(proc.pid, 0)
            proc.log.close()
            raise RuntimeError(f"runworkers did not finish within {timeout}s; see {proc.log.name}")
        time.sleep(0.05)
    else:
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.log.close()
    return proc.returncode, usage


def burst(args, processes, dispatcher=False, threads=None):
    """Drain the queue with ``runworkers --burst``; wall time, CPU and peak RSS of the tree."""
    began = time.perf_counter()
    proc = start_workers(args, processes, burst=True, name=f"burst-p{processes}",
                         dispatcher=dispatcher, threads=threads)
    code, usage = wait_rusage(proc, args.get("burst_timeout", 900))
    wall = time.perf_counter() - began
    if code != 0:
        raise RuntimeError(f"runworkers --burst exited {code}; see {proc.log.name}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "maxrss_kb": usage.ru_maxrss,
            "log": proc.log.name}


def submit_noop(count, prefix="j"):
    from django.db import transaction

    import durable

    # One transaction for the whole batch: the figure is the drain, not the submit.
    with transaction.atomic():
        for i in range(count):
            durable.submit("bench_noop", f"{prefix}-{i:07d}", {"i": i})


def window(prefix=None, workflow=None):
    """First claim to last commit, from the timestamps the workers wrote (seconds)."""
    from django.db.models import Max, Min

    from durable.models import EventKind, JobEvent

    if workflow is not None:
        events = JobEvent.objects.filter(job__workflow=workflow)
    else:
        events = JobEvent.objects.filter(job__id__startswith=f"{prefix}-")
    first = events.filter(kind=EventKind.CLAIMED).aggregate(t=Min("at"))["t"]
    last = events.aggregate(t=Max("at"))["t"]
    return (last - first).total_seconds()


def phase_drain(args):
    """N three-step no-op jobs drained by ``runworkers --burst -p P``."""
    from durable.models import Job

    jobs, processes, threads = args["jobs"], args["processes"], args.get("threads")
    # Start-up of the same command with nothing to do: subtracted from CPU and wall.
    empty = burst(args, processes, threads=threads)
    submit_noop(jobs)
    run = burst(args, processes, threads=threads)
    left = Job.objects.exclude(state=NOOP_DONE).count()
    if left:
        raise RuntimeError(f"{left} of {jobs} jobs did not finish; see {run['log']}")
    steps = jobs * NOOP_STEPS
    seconds = window("j")
    busy_wall = run["wall"] - empty["wall"]
    return {
        "jobs": jobs,
        "processes": processes,
        "threads": threads or 1,
        "steps": steps,
        "db_window_s": seconds,
        "steps_per_s": steps / seconds,
        "jobs_per_s": jobs / seconds,
        "wall_s": run["wall"],
        "startup_wall_s": empty["wall"],
        "wall_minus_startup_steps_per_s": steps / busy_wall if busy_wall > 0 else None,
        "cpu_us_per_step": (run["cpu"] - empty["cpu"]) / steps * 1e6,
        "peak_rss_mb": run["maxrss_kb"] / 1024,
        "startup_peak_rss_mb": empty["maxrss_kb"] / 1024,
    }


def _probe_started(job_id):
    from durable.models import Job, StepResult

    state = Job.objects.filter(pk=job_id).values_list("state", flat=True).first()
    if state != "start_done":
        return None
    return StepResult.objects.get(job_id=job_id, step="start").output["started"]


def _wait_probe(job_id, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = _probe_started(job_id)
        if started is not None:
            return started
        time.sleep(0.002)
    raise RuntimeError(f"probe {job_id} did not run within {timeout}s")


def phase_latency(args):
    """Submit-to-start with idle workers: one submit at a time, then wait for it to run."""
    import durable

    processes, samples = args["processes"], args["samples"]
    proc = start_workers(args, processes, burst=False, name=f"latency-p{processes}")
    try:
        # Warm-up: every worker up, connected and idle before the first sample.
        for i in range(processes * 2):
            durable.submit("bench_probe", f"warm-{i}", {})
        for i in range(processes * 2):
            _wait_probe(f"warm-{i}", timeout=60)
        from_call, from_commit = [], []
        rng = random.Random(7)
        for i in range(samples):
            # Idle gap, long enough for every worker to be back waiting (poll 1 s).
            time.sleep(rng.uniform(0.03, 0.08))
            key = f"probe-{i:05d}"
            t0 = time.time()
            durable.submit("bench_probe", key, {})
            t1 = time.time()
            started = _wait_probe(key)
            from_call.append((started - t0) * 1000)
            from_commit.append((started - t1) * 1000)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        proc.log.close()
    return {"processes": processes, "samples": samples, "from_call_ms": from_call,
            "from_commit_ms": from_commit, "p50_ms": _pct(from_call, 50),
            "p99_ms": _pct(from_call, 99), "p50_from_commit_ms": _pct(from_commit, 50)}


def _pct(values, p):
    values = sorted(values)
    if not values:
        return None
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# Claim time against a big history ----------------------------------------------------

_JOB_COLUMNS = ("id", "workflow", "workflow_version", "queue", "state", "payload", "result",
                "attempts", "next_run_at", "lease_until", "lease_owner", "lease_token", "wake_at",
                "last_error", "submitted_by", "created", "updated")


def _finished_rows(start, stop, stamp):
    for i in range(start, stop):
        yield (f"done-{i:08d}", "bench_noop", 1, "default", NOOP_DONE, f'{{"i": {i}}}', "null",
               0, None, None, None, 1, None, "", "", stamp, stamp)


def bulk_finished(start, stop):
    """Insert finished jobs [start, stop) as fast as the driver allows (COPY / executemany)."""
    from django.db import connection, transaction

    if connection.vendor == "postgresql":
        connection.ensure_connection()
        raw = connection.connection
        with raw.cursor() as cur:
            with cur.copy(f"COPY durable_job ({', '.join(_JOB_COLUMNS)}) FROM STDIN") as copy:
                for row in _finished_rows(start, stop, "2026-01-01 00:00:00+00"):
                    copy.write_row(row)
        raw.commit()
        with connection.cursor() as cur:
            cur.execute("ANALYZE durable_job")
    else:
        stamp = "2026-01-01 00:00:00"
        sql = (f"INSERT INTO durable_job ({', '.join(_JOB_COLUMNS)}) VALUES "
               f"({', '.join('?' for _ in _JOB_COLUMNS)})")
        with transaction.atomic():
            connection.ensure_connection()
            raw = connection.connection
            chunk = 50_000
            for lo in range(start, stop, chunk):
                raw.executemany(sql, _finished_rows(lo, min(stop, lo + chunk), stamp))
        with connection.cursor() as cur:
            cur.execute("ANALYZE")


def explain_claim():
    from django.db import connection, transaction

    from durable.store import database, records, sqlite

    with transaction.atomic():
        with connection.cursor() as cur:
            if connection.vendor == "postgresql":
                statement, params = database.of(connection).claim_statement("bench-explain", 60.0, None, None,
                                                                            None)
                cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params)
            else:
                cur.execute("EXPLAIN QUERY PLAN " + sqlite.PICK_JOB.format(filters=""), [records.claim_reach()])
            plan = "\n".join(" ".join(str(c) for c in row) for row in cur.fetchall())
        # EXPLAIN ANALYZE really ran the UPDATE: leave the table as it was.
        transaction.set_rollback(True)
    return plan


def full_scan_of_job(plan):
    """Whether a plan reads every row of durable_job (rather than the claim index)."""
    for line in plan.splitlines():
        if "Seq Scan on durable_job" in line:
            return True
        # SQLite: "SCAN durable_job" alone is a table scan; "... USING INDEX" is not.
        if "SCAN durable_job" in line and "USING" not in line:
            return True
    return False


def phase_claim(args):
    """Claim time with 10k/100k/1M finished jobs in the table; EXPLAIN of the claim query."""
    from django.db import transaction

    from durable.models import Job
    from durable.store import locking

    sizes, claims, rounds = args["sizes"], args["claims"], args.get("repeat", 3)
    results, have = [], 0
    for size in sizes:
        t = time.perf_counter()
        bulk_finished(have, size)
        insert_s = time.perf_counter() - t
        have = size
        medians, times = [], []
        for r in range(rounds):
            Job.objects.filter(id__startswith="run-").delete()
            submit_noop(claims, prefix=f"run-{size}-{r}")
            these = []
            for _ in range(claims):
                t = time.perf_counter()
                with transaction.atomic():
                    claimed = locking.claim_job("bench-claimer", 60.0)
                these.append((time.perf_counter() - t) * 1e6)
                if claimed is None:
                    raise RuntimeError("claim found nothing to claim")
            medians.append(_pct(these, 50))
            times.extend(these)
        # The plan with runnable work present, as in production.
        Job.objects.filter(id__startswith="run-").delete()
        submit_noop(claims, prefix=f"run-{size}-plan")
        plan = explain_claim()
        results.append({
            "finished_jobs": size, "insert_s": insert_s, "claims": claims,
            "rounds_us": medians, "claim_us_median": _pct(times, 50),
            "claim_us_p90": _pct(times, 90), "plan": plan,
            "seq_scan_on_job": full_scan_of_job(plan),
        })
    return {"sizes": results}


# Actions -------------------------------------------------------------------------------

def phase_actions(args):
    """One-step jobs that each send one action through the dispatcher to a local receiver."""
    from django.db import transaction
    from django.db.models import Max, Min

    import durable
    from durable.models import Outbox

    jobs, processes = args["jobs"], args["processes"]
    with transaction.atomic():
        for i in range(jobs):
            durable.submit("bench_action", f"a-{i:07d}", {"n": i})
    # Workers write the outbox rows; the dispatcher (one process, its default threads)
    # sends them; --burst returns when both have nothing left.
    run = burst(args, processes, dispatcher=True)
    outbox = Outbox.objects.filter(status="succeeded")
    stats = outbox.aggregate(first=Min("sent_at"), last=Max("updated"))
    done = outbox.count()
    seconds = (stats["last"] - stats["first"]).total_seconds() if done > 1 else None
    if done < jobs:
        raise RuntimeError(f"only {done} of {jobs} actions succeeded; see {run['log']}")
    return {"jobs": jobs, "succeeded": done, "wall_s": run["wall"], "db_window_s": seconds,
            "actions_per_s": done / seconds if seconds else None}


# Steps that wait (a model call's shape) ---------------------------------------------------

def phase_io(args):
    """N one-step jobs whose step sleeps (a stand-in for a model call), P processes × T threads."""
    from django.db import transaction

    import durable
    from durable.models import Job

    jobs, processes, seconds = args["jobs"], args["processes"], args["sleep"]
    threads = args.get("threads") or 1
    empty = burst(args, processes, threads=args.get("threads"))
    with transaction.atomic():
        for i in range(jobs):
            durable.submit("bench_sleep", f"s-{i:07d}", {"seconds": seconds})
    run = burst(args, processes, threads=args.get("threads"))
    left = Job.objects.exclude(state="call_done").count()
    if left:
        raise RuntimeError(f"{left} of {jobs} jobs did not finish; see {run['log']}")
    window_s = window("s")
    bound = processes * threads / seconds
    return {
        "jobs": jobs, "processes": processes, "threads": threads, "sleep_s": seconds,
        "db_window_s": window_s, "jobs_per_s": jobs / window_s, "bound_jobs_per_s": bound,
        "ratio_to_bound": jobs / window_s / bound, "wall_s": run["wall"],
        "cpu_us_per_step": (run["cpu"] - empty["cpu"]) / jobs * 1e6,
        "peak_rss_mb": run["maxrss_kb"] / 1024,
    }


# @task calls beside django-tasks-db ----------------------------------------------------------

def phase_tasks(args):
    """N no-op ``@task`` calls through DurableBackend, drained by ``runworkers --burst``."""
    from django.db import connection, transaction

    from bench.peers import xact_commit
    from bench.tasks import noop
    from durable.models import Job

    jobs, processes, threads = args["jobs"], args["processes"], args.get("threads")
    connection.close()
    c0 = xact_commit()
    empty = burst(args, processes, threads=threads)
    c1 = xact_commit()
    with transaction.atomic():
        for _ in range(jobs):
            noop.enqueue()
    connection.close()
    c2 = xact_commit()
    run = burst(args, processes, threads=threads)
    c3 = xact_commit()
    left = Job.objects.filter(workflow="django_task").exclude(state="succeeded").count()
    if left:
        raise RuntimeError(f"{left} of {jobs} task jobs did not succeed; see {run['log']}")
    seconds = window(workflow="django_task")
    result = {"jobs": jobs, "processes": processes, "threads": threads or 1, "db_window_s": seconds,
              "jobs_per_s": jobs / seconds, "wall_s": run["wall"],
              "cpu_us_per_job": (run["cpu"] - empty["cpu"]) / jobs * 1e6,
              "peak_rss_mb": run["maxrss_kb"] / 1024}
    if c0 is not None:
        # Commits the database counted during the drain, less those of the same command
        # on an empty queue (start-up, the last idle claim), per job.
        result["commits_per_job"] = ((c3 - c2) - (c1 - c0)) / jobs
    return result


# The dispatcher: a slow receiver, and a destination that never answers ---------------------

def dispatch_slots(destination):
    """Actions to ``destination`` one dispatcher process may have in flight at once."""
    from durable.engine.dispatch.loop import Dispatcher

    dispatcher = Dispatcher(name="bench-probe")
    limit = getattr(dispatcher, "slots_for", None)
    # Rows claimed ahead of the threads wait for one: the sends in flight are at most threads.
    return min(limit(destination), dispatcher.threads) if limit else dispatcher.threads


def phase_dispatch(args):
    """Queued actions sent by one dispatcher; half go to a stalled destination if asked.

    The workers write the outbox rows first (``--no-dispatcher``); then a dispatcher
    alone sends them, so the figure is the dispatcher's. The healthy receiver answers
    after ``latency`` seconds.
    """
    from django.db import transaction
    from django.db.models import Max, Min

    import durable
    from durable.models import Outbox

    jobs, stalled = args["jobs"], args["stalled"]
    with transaction.atomic():
        for i in range(jobs):
            to = "stalled" if stalled and i % 2 else "bench"
            durable.submit("bench_action", f"a-{i:07d}", {"n": i, "to": to})
    burst(args, 1, threads=args.get("threads"))  # every job now waits in in_flight_send
    healthy = jobs - (jobs // 2 if stalled else 0)
    queued = Outbox.objects.count()
    if queued != jobs:
        raise RuntimeError(f"{queued} of {jobs} actions were queued")
    proc = start_workers(args, 0, burst=False, name="dispatcher", dispatcher_only=True)
    deadline = time.monotonic() + args.get("timeout", 300)
    try:
        while time.monotonic() < deadline:
            done = Outbox.objects.filter(destination="bench", status="succeeded").count()
            if done >= healthy:
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.log.close()
    rows = Outbox.objects.filter(destination="bench", status="succeeded")
    done = rows.count()
    if done < healthy:
        raise RuntimeError(f"only {done} of {healthy} healthy actions succeeded; see {proc.log.name}")
    first = Outbox.objects.aggregate(t=Min("sent_at"))["t"]
    last = rows.aggregate(t=Max("updated"))["t"]
    seconds = (last - first).total_seconds()
    return {"jobs": jobs, "stalled": stalled, "healthy": healthy, "db_window_s": seconds,
            "slots": dispatch_slots("bench"),
            "healthy_actions_per_s": healthy / seconds,
            "stalled_settled": Outbox.objects.filter(destination="stalled").exclude(
                status__in=("pending", "attempted")).count()}


# Memory over a long run ---------------------------------------------------------------

def _children(pid):
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def rss_kb(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def phase_rss(args):
    """One worker drains ``steps`` no-op steps; its RSS sampled against steps done."""
    from django.db import connection

    jobs = -(-args["steps"] // NOOP_STEPS)
    submit_noop(jobs, prefix="r")
    proc = start_workers(args, 1, burst=True, name="rss")
    samples = []
    worker = None
    while proc.poll() is None:
        time.sleep(args.get("interval", 1.0))
        kids = _children(proc.pid)
        worker = kids[0] if kids else worker
        rss = rss_kb(worker) if worker else None
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM durable_stepresult")
            steps = cur.fetchone()[0]
        connection.close()
        if rss:
            samples.append({"steps": steps, "rss_mb": rss / 1024})
    proc.log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"runworkers exited {proc.returncode}")
    return {"steps": jobs * NOOP_STEPS, "samples": samples}


def phase_submit(args):
    """Only submit (for a profiled drain started by the caller)."""
    submit_noop(args["jobs"], prefix=args.get("prefix", "j"))
    return {"jobs": args["jobs"]}


def phase_window(args):
    from durable.models import Job

    left = Job.objects.exclude(state=NOOP_DONE).count()
    return {"db_window_s": window(args.get("prefix", "j")), "left": left}


PHASES = {"submit": phase_submit, "window": phase_window, "drain": phase_drain,
          "latency": phase_latency, "claim": phase_claim, "actions": phase_actions,
          "rss": phase_rss, "io": phase_io, "tasks": phase_tasks, "dispatch": phase_dispatch}


def main():
    name, args = sys.argv[1], json.loads(sys.argv[2])
    _setup()
    result = PHASES[name](args)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
