#!/usr/bin/env python
"""Benchmark durable beside the database's own ceiling, interleaved, in one run.

    python bench/run.py                       # full run, SQLite (FULL and NORMAL) and PostgreSQL
    python bench/run.py --quick               # a small smoke run
    python bench/run.py --databases postgres --repeat 5
    python bench/run.py --long                # also: one worker's RSS over 100,000 steps

For every repeat and database it measures, in this order so that drift hits both
sides alike: the ceiling with P processes, then durable drained by P processes, for
each P; then submit-to-start latency; then (once per database) claim time against a
growing history. Each figure is printed as median, min and max over the repeats and
written to JSON (default bench/results/latest.json); --markdown writes the table.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path.pop(0)  # run as a script: import bench.* from the repository, not siblings
sys.path.insert(0, str(ROOT))

from bench import ceiling, machine  # noqa: E402
from bench.report import render_markdown, render_table, summarise  # noqa: E402

DURABLE_TABLES = ("durable_job", "durable_stepresult", "durable_jobevent", "durable_outbox",
                  "durable_approval", "durable_pause")


def _csv(kind):
    def parse(text):
        return [kind(x) for x in text.split(",") if x.strip()]
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2000, help="three-step jobs per drain (default 2000)")
    p.add_argument("--databases", type=_csv(str), default=["sqlite", "postgres"],
                   help="comma-separated: sqlite,postgres")
    p.add_argument("--sqlite-synchronous", type=_csv(str.upper), default=["FULL", "NORMAL"],
                   help="SQLite synchronous modes to compare (default FULL,NORMAL)")
    p.add_argument("--processes", type=_csv(int), default=[1, 2, 4],
                   help="worker (and ceiling) process counts (default 1,2,4)")
    p.add_argument("--repeat", type=int, default=None, help="repeats of each figure (default 3)")
    p.add_argument("--ceiling-seconds", type=float, default=3.0,
                   help="length of each ceiling measurement")
    p.add_argument("--latency-processes", type=_csv(int), default=[1, 4],
                   help="idle workers during the latency figure (default 1,4)")
    p.add_argument("--latency-samples", type=int, default=100,
                   help="sequential submits per latency measurement")
    p.add_argument("--claim-sizes", type=_csv(int), default=[10_000, 100_000, 1_000_000],
                   help="finished jobs in the table for the claim figure")
    p.add_argument("--claim-databases", type=_csv(str), default=None,
                   help="databases for the claim figure (default: all of --databases)")
    p.add_argument("--claims", type=int, default=200, help="claims timed per size and repeat")
    p.add_argument("--action-jobs", type=int, default=500, help="one-action jobs for the actions figure")
    p.add_argument("--threads", type=_csv(int), default=[1, 8],
                   help="threads per worker process for the no-op drain (default 1,8)")
    p.add_argument("--io-jobs", type=int, default=1000, help="jobs whose one step sleeps (default 1000)")
    p.add_argument("--io-sleep", type=float, default=0.5, help="seconds each of those steps sleeps")
    p.add_argument("--io-processes", type=int, default=2, help="worker processes for that drain")
    p.add_argument("--io-threads", type=_csv(int), default=[1, 8, 32],
                   help="threads per process for that drain (default 1,8,32)")
    p.add_argument("--task-jobs", type=int, default=2000, help="no-op @task calls per drain")
    p.add_argument("--task-processes", type=_csv(int), default=[1, 4],
                   help="worker processes of each backend for the task figure (default 1,4)")
    p.add_argument("--dispatch-jobs", type=int, default=1000,
                   help="queued actions for the dispatcher figure (default 1000)")
    p.add_argument("--dispatch-latency", type=float, default=0.1,
                   help="seconds the healthy receiver takes to answer (default 0.1)")
    p.add_argument("--skip", type=_csv(str), default=[],
                   help="figures to leave out: ceiling,schema,drain,latency,claim,actions,io,tasks,dispatch")
    p.add_argument("--long", action="store_true", help="also measure RSS over --rss-steps steps")
    p.add_argument("--rss-steps", type=int, default=100_000)
    p.add_argument("--quick", action="store_true",
                   help="small run: 300 jobs, 1 repeat, 1 s ceilings, 20 latency samples, 10k/100k claims")
    p.add_argument("--log-level", default="INFO",
                   help="the durable logger's level in workers (the project default is INFO)")
    p.add_argument("--pg-url", default=os.environ.get(
        "BENCH_POSTGRES_ADMIN_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
        help="a PostgreSQL server to create the durable_bench database on")
    p.add_argument("--pg-database", default="durable_bench")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "latest.json"))
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="seconds to wait, before each measurement, for the machine to be idle "
                        "(busy below --quiet-threshold); 0 to not wait")
    p.add_argument("--quiet-threshold", type=float, default=0.25,
                   help="share of all cores busy that counts as idle (default 0.25)")
    p.add_argument("--keep", action="store_true", help="keep the benchmark databases afterwards")
    p.add_argument("--profile", action="store_true",
                   help="instead of the figures: profile a 1-process drain on each database "
                        "(py-spy, needs `pip install py-spy pyinstrument`) and count statements per step")
    p.add_argument("--profile-dir", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.jobs = min(args.jobs, 300)
        args.repeat = args.repeat or 1
        args.ceiling_seconds = 1.0
        args.latency_samples = 20
        args.claim_sizes = [s for s in args.claim_sizes if s <= 100_000]
        args.claims = 50
        args.action_jobs = 100
        args.io_jobs = min(args.io_jobs, 200)
        args.task_jobs = min(args.task_jobs, 300)
        args.dispatch_jobs = min(args.dispatch_jobs, 100)
    args.repeat = args.repeat or 3
    for db in args.databases:
        if db not in ("sqlite", "postgres"):
            p.error(f"unknown database {db!r}: use sqlite and/or postgres")
    for mode in args.sqlite_synchronous:
        if mode not in ("FULL", "NORMAL", "EXTRA", "OFF"):
            p.error(f"unknown SQLite synchronous mode {mode!r}")
    if args.claim_databases is None:
        args.claim_databases = list(args.databases)
    return args


class Bench:
    """Creates the benchmark databases, runs each figure in its own process, collects."""

    def __init__(self, args):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="durable-bench-"))
        self.logs = self.tmp / "logs"
        self.logs.mkdir()
        self.template = self.tmp / "template.sqlite3"
        self.pg_url = None
        self.records = []  # one dict per measurement
        self.errors = []

    # Databases --------------------------------------------------------------------------

    def _bench_pg_url(self):
        base = self.args.pg_url.rsplit("/", 1)[0]
        return f"{base}/{self.args.pg_database}"

    def prepare(self):
        if "sqlite" in self.args.databases:
            self._manage(self._env("sqlite", "FULL", path=self.template), "migrate", "-v0")
        if "postgres" in self.args.databases:
            import psycopg

            name = self.args.pg_database
            with psycopg.connect(self.args.pg_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{name}"')
            self.pg_url = self._bench_pg_url()
            self._manage(self._env("postgres"), "migrate", "-v0")
        if "tasks" not in self.args.skip and not self.args.profile:
            # The peer's tables beside durable's, in the same databases (its own virtualenv).
            from bench import peers

            python = peers.ensure_venv()
            for db in self.args.databases:
                env = self._env(db, "FULL", path=self.template)
                env["DJANGO_SETTINGS_MODULE"] = "bench.peer_settings"
                self._peer(python, env, "migrate")

    def cleanup(self):
        if self.pg_url and not self.args.keep:
            import psycopg

            with psycopg.connect(self.args.pg_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.args.pg_database}" WITH (FORCE)')
        if not self.args.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _env(self, db, synchronous="FULL", path=None, **extra):
        env = dict(os.environ)
        env["DJANGO_SETTINGS_MODULE"] = "bench.settings"
        env["BENCH_DATABASE"] = db
        env["BENCH_LOG_LEVEL"] = self.args.log_level
        env["PYTHONUNBUFFERED"] = "1"
        env["DURABLE_SQLITE_SYNCHRONOUS"] = synchronous
        if db == "sqlite":
            env["BENCH_SQLITE_PATH"] = str(path)
        else:
            env["BENCH_POSTGRES_URL"] = self.pg_url or self._bench_pg_url()
        env.update(extra)
        return env

    def _manage(self, env, *command):
        subprocess.run([sys.executable, str(ROOT / "manage.py"), *command], cwd=ROOT, env=env,
                       check=True)

    def fresh(self, db, synchronous="FULL"):
        """An empty, migrated durable schema for one measurement; returns its env."""
        if db == "sqlite":
            path = self.tmp / f"run-{synchronous.lower()}.sqlite3"
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            shutil.copyfile(self.template, path)
            return self._env(db, synchronous, path=path)
        import psycopg

        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            conn.execute(f"TRUNCATE {', '.join(DURABLE_TABLES)} RESTART IDENTITY CASCADE")
            conn.execute("DROP TABLE IF EXISTS ceiling_memo, ceiling_job")
            conn.execute("VACUUM ANALYZE")
        return self._env(db)

    # Measurements -----------------------------------------------------------------------

    def phase(self, name, env, **params):
        params["log_dir"] = str(self.logs)
        proc = subprocess.run([sys.executable, "-m", "bench.phase", name, json.dumps(params)],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"phase {name} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def quiet(self):
        """Before a measurement: wait a while for other work on the machine to calm down."""
        self.busy_before = None
        if self.args.quiet_wait > 0:
            self.busy_before = machine.wait_for_quiet(self.args.quiet_threshold,
                                                      self.args.quiet_wait)
        self.fsync_before = machine.fsync_ms(self.tmp)

    def record(self, figure, db, repeat, **fields):
        rec = {"figure": figure, "database": db, "repeat": repeat, **fields,
               "busy_before": getattr(self, "busy_before", None),
               "fsync_ms_before": getattr(self, "fsync_before", None), "load1": os.getloadavg()[0]}
        self.records.append(rec)
        # Keep what was measured so far, should a later figure hang or the run be stopped.
        partial = Path(self.args.json).with_suffix(".partial.jsonl")
        partial.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        return rec

    def attempt(self, what, func, *args):
        self.quiet()
        try:
            return func(*args)
        except Exception as exc:  # noqa: BLE001 - one failed figure must not lose the others
            self.errors.append(f"{what}: {exc}")
            print(f"  ! {what} failed: {exc}", file=sys.stderr)
            return None

    def ceiling(self, db, synchronous, processes, repeat, shape="minimal"):
        if db == "sqlite":
            path = self.tmp / f"ceiling-{shape}.sqlite3"
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            if shape == "durable":
                shutil.copyfile(self.template, path)
            res = ceiling.measure("sqlite", processes, self.args.ceiling_seconds,
                                  sqlite_path=str(path), synchronous=synchronous, shape=shape)
        else:
            self.fresh(db)
            res = ceiling.measure("postgres", processes, self.args.ceiling_seconds,
                                  pg_url=self.pg_url, shape=shape)
        label = self.label(db, synchronous)
        print(f"  ceiling ({shape}) {label} p={processes}: {res['tx_per_s']:.0f} tx/s",
              file=sys.stderr)
        return self.record("ceiling", label, repeat, processes=processes, shape=shape, **res)

    def drain(self, db, synchronous, processes, repeat, threads=1):
        env = self.fresh(db, synchronous)
        # Always named: the command's default (DURABLE["THREADS"]) is not 1.
        res = self.phase("drain", env, jobs=self.args.jobs, processes=processes, threads=threads)
        res["threads"] = threads
        label = self.label(db, synchronous)
        print(f"  durable {label} p={processes} t={threads}: {res['steps_per_s']:.0f} steps/s, "
              f"{res['cpu_us_per_step']:.0f} us CPU/step", file=sys.stderr)
        return self.record("drain", label, repeat, **res)

    def io(self, db, synchronous, threads, repeat):
        env = self.fresh(db, synchronous)
        res = self.phase("io", env, jobs=self.args.io_jobs, processes=self.args.io_processes,
                         threads=threads, sleep=self.args.io_sleep)
        label = self.label(db, synchronous)
        print(f"  sleeping steps {label} p={res['processes']} t={threads}: {res['jobs_per_s']:.1f} "
              f"jobs/s of a bound of {res['bound_jobs_per_s']:.0f} ({res['ratio_to_bound']:.2f} x)",
              file=sys.stderr)
        return self.record("io", label, repeat, **res)

    def tasks(self, db, synchronous, processes, repeat):
        """The same no-op @task drained by durable, then by django-tasks-db, on one database."""
        from bench import peers

        label = self.label(db, synchronous)
        env = self.fresh(db, synchronous)
        res = self.phase("tasks", env, jobs=self.args.task_jobs, processes=processes)
        print(f"  @task durable {label} p={processes}: {res['jobs_per_s']:.0f} jobs/s, "
              f"{res.get('commits_per_job', float('nan')):.2f} commits/job", file=sys.stderr)
        self.record("tasks", label, repeat, backend="durable", **res)
        python = peers.ensure_venv()
        self.peer_versions = peers.versions()
        env = self.fresh(db, synchronous)
        env["DJANGO_SETTINGS_MODULE"] = "bench.peer_settings"
        self.quiet()
        peer = self._peer(python, env, "drain", jobs=self.args.task_jobs, processes=processes)
        print(f"  @task django-tasks-db {label} p={processes}: {peer['jobs_per_s']:.0f} jobs/s, "
              f"{peer.get('commits_per_job', float('nan')):.2f} commits/job", file=sys.stderr)
        return self.record("tasks", label, repeat, backend="django-tasks-db", **peer)

    def _peer(self, python, env, name, **params):
        params["log_dir"] = str(self.logs)
        proc = subprocess.run([str(python), "-m", "bench.peers", name, json.dumps(params)], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"peer {name} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def dispatch(self, db, stalled, repeat):
        from durable.testing import Blackhole, ReceiverProcess

        receiver = ReceiverProcess(self.tmp / f"receiver-dispatch-{db}-{repeat}.jsonl").start()
        blackhole = Blackhole()
        try:
            receiver.behave("slow_after_acting", delay=self.args.dispatch_latency)
            env = self.fresh(db)
            env.update(BENCH_ACTIONS="1", BENCH_RECEIVER_URL=receiver.url,
                       BENCH_STALLED_URL=blackhole.url)
            res = self.phase("dispatch", env, jobs=self.args.dispatch_jobs, stalled=stalled)
        finally:
            receiver.stop()
            blackhole.close()
        res["latency_s"] = self.args.dispatch_latency
        res["bound_per_s"] = res["slots"] / self.args.dispatch_latency
        print(f"  dispatcher {db} {'beside a stalled destination' if stalled else 'alone'}: "
              f"{res['healthy_actions_per_s']:.0f} healthy actions/s", file=sys.stderr)
        return self.record("dispatch", db, repeat, **res)

    def latency(self, db, synchronous, processes, repeat):
        env = self.fresh(db, synchronous)
        res = self.phase("latency", env, processes=processes, samples=self.args.latency_samples)
        label = self.label(db, synchronous)
        print(f"  latency {label} p={processes}: p50 {res['p50_ms']:.1f} ms, "
              f"p99 {res['p99_ms']:.1f} ms", file=sys.stderr)
        return self.record("latency", label, repeat, **res)

    def claim(self, db):
        env = self.fresh(db)
        res = self.phase("claim", env, sizes=self.args.claim_sizes, claims=self.args.claims,
                         repeat=self.args.repeat)
        for size in res["sizes"]:
            for r, median in enumerate(size.pop("rounds_us")):
                self.record("claim", db, r, finished_jobs=size["finished_jobs"], claim_us=median)
            print(f"  claim {db} {size['finished_jobs']:>9,} finished: "
                  f"{size['claim_us_median']:.0f} us; seq scan on job: {size['seq_scan_on_job']}",
                  file=sys.stderr)
        self.plans = getattr(self, "plans", {})
        self.plans[db] = res["sizes"]

    def actions(self, db, repeat):
        import importlib.util

        if importlib.util.find_spec("durable.dispatch") is None:
            return None
        from durable.testing import ReceiverProcess

        # The receiver runs in a process of its own, as a remote system would.
        receiver = ReceiverProcess(self.tmp / f"receiver-{db}-{repeat}.jsonl").start()
        try:
            env = self.fresh(db)
            env.update(BENCH_ACTIONS="1", BENCH_RECEIVER_URL=receiver.url)
            res = self.phase("actions", env, jobs=self.args.action_jobs, processes=1)
        finally:
            receiver.stop()
        print(f"  actions {db}: {res['actions_per_s']:.0f} actions/s", file=sys.stderr)
        return self.record("actions", db, repeat, **res)

    def rss(self, db, synchronous):
        env = self.fresh(db, synchronous)
        res = self.phase("rss", env, steps=self.args.rss_steps)
        label = self.label(db, synchronous)
        samples = res["samples"]
        print(f"  rss {label}: {samples[0]['rss_mb']:.1f} MB at {samples[0]['steps']} steps -> "
              f"{samples[-1]['rss_mb']:.1f} MB at {samples[-1]['steps']} steps", file=sys.stderr)
        return self.record("rss", label, 0, **res)

    def profile(self, db, synchronous):
        """py-spy over a real 1-process burst drain, then the inline statement count."""
        out = Path(self.args.profile_dir)
        out.mkdir(parents=True, exist_ok=True)
        label = self.label(db, synchronous)
        env = self.fresh(db, synchronous)
        self.phase("submit", env, jobs=self.args.jobs)
        raw = out / f"py-spy-{label}.txt"
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        command = [spy, "record", "--nonblocking", "-r", "200", "-f", "raw", "-o", str(raw),
                   "--subprocesses", "--", sys.executable, str(ROOT / "manage.py"), "runworkers",
                   "--burst", "--processes", "1"]
        with open(self.logs / f"py-spy-{label}.log", "wb") as log:
            subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                           check=True)
        window = self.phase("window", env)
        steps = self.args.jobs * 3
        from bench import spy as spy_report

        text = spy_report.render(spy_report.summarise(raw), window["db_window_s"], steps)
        header = (f"# py-spy (200 Hz, nonblocking) over `runworkers --burst -p 1`, {label}, "
                  f"{self.args.jobs} jobs x 3 no-op steps: {steps / window['db_window_s']:.0f} "
                  f"steps/s under the profiler\n")
        (out / f"profile-{label}.txt").write_text(header + text + "\n")
        print(header + text, file=sys.stderr)
        from durable.testing import ReceiverProcess

        receiver = ReceiverProcess(self.tmp / f"receiver-profile-{label}.jsonl").start()
        try:
            env = self.fresh(db, synchronous)
            env.update(BENCH_HOTPATH_LABEL=label, BENCH_ACTIONS="1", BENCH_RECEIVER_URL=receiver.url)
            hot = subprocess.run([sys.executable, "-m", "bench.hotpath", "--jobs", "200",
                                  "--profile-jobs", "1000", "--actions", "100", "--out", str(out)],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
        finally:
            receiver.stop()
        print(hot.stdout, file=sys.stderr)
        if hot.returncode != 0:
            raise RuntimeError(hot.stderr[-2000:])
        env = self.fresh(db, synchronous)
        cost = subprocess.run([sys.executable, "-m", "bench.ormcost", "--n", "2000"], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        if cost.returncode != 0:
            raise RuntimeError(cost.stderr[-2000:])
        (out / f"ormcost-{label}.txt").write_text(cost.stdout)
        print(cost.stdout, file=sys.stderr)

    def label(self, db, synchronous):
        return f"sqlite-{synchronous.lower()}" if db == "sqlite" else db

    def variants(self):
        for db in self.args.databases:
            modes = self.args.sqlite_synchronous if db == "sqlite" else ["-"]
            for mode in modes:
                yield db, (mode if db == "sqlite" else "FULL")

    def run(self):
        a, skip = self.args, set(self.args.skip)
        if a.profile:
            for db, sync in self.variants():
                if sync == "FULL":
                    self.attempt(f"profile {db}", self.profile, db, sync)
            return
        for repeat in range(a.repeat):
            print(f"repeat {repeat + 1}/{a.repeat}", file=sys.stderr)
            for db, sync in self.variants():
                label = self.label(db, sync)
                for p in a.processes:
                    if "ceiling" not in skip:
                        self.attempt(f"ceiling {label} p={p}", self.ceiling, db, sync, p, repeat)
                    if "schema" not in skip:
                        self.attempt(f"schema ceiling {label} p={p}", self.ceiling, db, sync, p,
                                     repeat, "durable")
                    if "drain" not in skip:
                        for t in a.threads:
                            self.attempt(f"durable {label} p={p} t={t}", self.drain, db, sync, p,
                                         repeat, t)
                if "io" not in skip and sync == "FULL":
                    for t in a.io_threads:
                        self.attempt(f"sleeping steps {label} t={t}", self.io, db, sync, t, repeat)
                if "tasks" not in skip and sync == "FULL":
                    for p in a.task_processes:
                        self.attempt(f"@task {label} p={p}", self.tasks, db, sync, p, repeat)
                if "dispatch" not in skip and sync == "FULL":
                    for stalled in (False, True):
                        self.attempt(f"dispatcher {label} stalled={stalled}", self.dispatch, db,
                                     stalled, repeat)
                if "latency" not in skip:
                    for p in a.latency_processes:
                        self.attempt(f"latency {label} p={p}", self.latency, db, sync, p, repeat)
                if "actions" not in skip and sync == "FULL":
                    self.attempt(f"actions {label}", self.actions, db, repeat)
        if "claim" not in skip:
            for db in a.claim_databases:
                self.attempt(f"claim {db}", self.claim, db)
        if a.long:
            for db, sync in self.variants():
                if sync == "FULL":
                    self.attempt(f"rss {db}", self.rss, db, sync)


def source_version():
    """The commit measured (and whether the tree had local changes), for the record."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "durable"], cwd=ROOT,
                               check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}{' with local changes to durable/' if dirty else ''}"


def main(argv=None):
    args = parse_args(argv)
    bench = Bench(args)
    started = time.time()
    try:
        bench.prepare()
        pragmas = {"journal_mode": "WAL", "synchronous": args.sqlite_synchronous,
                   "busy_timeout": 30000, "transaction_mode": "IMMEDIATE", "foreign_keys": "ON"}
        info = machine.describe(sqlite_dir=bench.tmp, sqlite_pragmas=pragmas,
                                pg_url=bench.pg_url if "postgres" in args.databases else None)
        bench.run()
    finally:
        bench.cleanup()
    result = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "command": "python bench/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "source": source_version(),
        "options": {k: v for k, v in vars(args).items() if k not in ("pg_url",)},
        "environment": {k: v for k, v in os.environ.items()
                        if k.startswith("BENCH_") or k == "DURABLE_SQLITE_SYNCHRONOUS"},
        "machine": info,
        "records": bench.records,
        "plans": getattr(bench, "plans", {}),
        "peer_versions": getattr(bench, "peer_versions", None),
        "errors": bench.errors,
    }
    result["summary"] = summarise(result)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    Path(args.json).with_suffix(".partial.jsonl").unlink(missing_ok=True)
    print(render_table(result))
    print(f"\nJSON: {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(result))
        print(f"Markdown: {args.markdown}")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
