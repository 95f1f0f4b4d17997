"""Where a worker's time per step goes: statements per step, commits, and a profile.

    python -m bench.hotpath [--jobs 300] [--profile-jobs 1000] [--out DIR]

Runs in one Django process on the database the environment names (bench/settings.py;
bench/run.py --profile sets it up). The loop is the worker's own (``Worker.runner``:
claim, then run the job's steps under the lease), inline, with its heartbeat thread
running, so the statements and the time are what ``runworkers`` spends per step.
"""

import argparse
import collections
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def _normalise(sql):
    sql = re.sub(r"'[^']*'", "?", sql)
    sql = re.sub(r"\b\d+(\.\d+)?\b", "?", sql)
    sql = re.sub(r"\s+", " ", sql).strip()
    sql = re.sub(r"IN \([?, ]+\)", "IN (...)", sql)
    return sql


class Commits:
    """Counts commits (Django does not log them as queries)."""

    def __init__(self, conn):
        self.conn, self.count = conn, 0
        self._original = conn.commit

        def commit():
            self.count += 1
            return self._original()

        conn.commit = commit

    def close(self):
        self.conn.commit = self._original


class HotStatements:
    """Every statement the worker sends and every commit, including the raw hot path's.

    SQLite: the connection's own trace (what SQLite executed, BEGIN and COMMIT included).
    PostgreSQL: Django's captured queries, plus the statements sent through
    ``PostgresStore.execute``; a commit is an explicit COMMIT or a hot statement sent
    outside a transaction (it commits itself).
    """

    def __init__(self, conn):
        self.conn, self.statements, self.commits = conn, [], 0

    def __enter__(self):
        from django.test.utils import CaptureQueriesContext

        from durable.store.postgres import PostgresStore

        self.conn.ensure_connection()
        if self.conn.vendor == "sqlite":
            def trace(sql):
                self.statements.append(sql)
                if sql.strip().upper() == "COMMIT":
                    self.commits += 1

            self.conn.connection.set_trace_callback(trace)
            return self
        self._explicit = Commits(self.conn)
        self._captured = CaptureQueriesContext(self.conn).__enter__()
        self._pg_execute = original = PostgresStore.execute

        def pg_execute(store, sql, params, db=None):
            self.statements.append(sql)
            if not self.conn.in_atomic_block:
                self.commits += 1
            return original(store, sql, params, db)

        PostgresStore.execute = pg_execute
        return self

    def __exit__(self, *exc):
        from durable.store.postgres import PostgresStore

        if self.conn.vendor == "sqlite":
            self.conn.connection.set_trace_callback(None)
            return False
        PostgresStore.execute = self._pg_execute
        self._captured.__exit__(*exc)
        self._explicit.close()
        self.statements += [q["sql"] for q in self._captured.captured_queries]
        self.commits += self._explicit.count
        return False


def drain_inline(worker):
    steps = 0
    while True:
        started = worker.runner.claim(worker.workflows, worker.queues)
        if started is None:
            return steps
        while started is not None:
            steps += 1
            started = worker.runner.run_step(started)


def count_actions(jobs, out, label):
    """Statements, commits and time per action: worker step then dispatcher, inline, 1 thread."""
    from django.db import connection, connections, transaction
    from django.test.utils import CaptureQueriesContext

    import durable
    from durable.engine.dispatch.loop import Dispatcher
    from durable.engine.worker import Worker
    from durable.models import Outbox

    worker = Worker(name="bench-hotpath", burst=True)
    dispatcher = Dispatcher(name="bench-dispatch", burst=True, threads=1, batch_size=1)
    with transaction.atomic():
        for i in range(jobs):
            durable.submit("bench_action", f"act-{i:06d}", {"n": i})
    results = {}
    for phase, run in (("worker (step returns the Action)", lambda: drain_inline(worker)),
                       ("dispatcher (claim, mark, send, record)", lambda: _dispatch_all(dispatcher))):
        commits = Commits(connections["default"])
        began = time.perf_counter()
        with CaptureQueriesContext(connection) as ctx:
            run()
        elapsed = time.perf_counter() - began
        commits.close()
        by = collections.Counter(_normalise(q["sql"]) for q in ctx.captured_queries)
        results[phase] = (len(ctx.captured_queries), commits.count, elapsed, by)
    done = Outbox.objects.filter(status="succeeded").count()
    lines = [f"# per action on {label}: {jobs} one-step action jobs, inline, one thread; "
             f"{done} succeeded"]
    for phase, (n, commits, elapsed, by) in results.items():
        lines.append(f"## {phase}: {n / jobs:.1f} statements, {commits / jobs:.2f} commits, "
                     f"{elapsed / jobs * 1e6:.0f} us per action (capture on)")
        for sql, k in by.most_common():
            lines.append(f"{k / jobs:6.2f}/action  {sql[:300]}")
    (out / f"statements-actions-{label}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(line for line in lines if line.startswith("#")))


def _dispatch_all(dispatcher):
    while dispatcher.run_once():
        pass


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=200, help="jobs whose statements are counted")
    p.add_argument("--profile-jobs", type=int, default=1000, help="jobs drained under pyinstrument")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--actions", type=int, default=0,
                   help="also count per-action statements for this many action jobs "
                        "(needs BENCH_ACTIONS=1 and BENCH_RECEIVER_URL)")
    args = p.parse_args(argv)
    _setup()
    from django.db import connection, connections

    from bench.phase import submit_noop
    from durable.engine.worker import Worker
    from durable.models import Job

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vendor = connection.vendor
    label = os.environ.get("BENCH_HOTPATH_LABEL", vendor)
    worker = Worker(name="bench-hotpath", burst=True)
    worker.heartbeat.start()

    # Warm up (imports, prepared plans, caches), then count.
    submit_noop(20, prefix="warm")
    drain_inline(worker)
    submit_noop(args.jobs, prefix="count")
    began = time.perf_counter()
    with HotStatements(connections["default"]) as log:
        steps = drain_inline(worker)
    elapsed = time.perf_counter() - began
    assert Job.objects.filter(id__startswith="count-").exclude(state="three_done").count() == 0
    by_statement = collections.Counter(_normalise(sql) for sql in log.statements)
    lines = [f"# statements per step on {vendor}: {args.jobs} jobs, {steps} steps, inline worker loop",
             f"# {len(log.statements)} statements ({len(log.statements) / steps:.2f}/step),"
             f" {log.commits} commits ({log.commits / steps:.2f}/step),"
             f" {elapsed / steps * 1e6:.0f} us/step wall (statement capture on)", ""]
    for sql, n in by_statement.most_common():
        lines.append(f"{n / args.jobs:6.2f}/job {n / steps:5.2f}/step  {sql[:400]}")
    (out / f"statements-{label}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:2]))

    # Time per step without capture, then under pyinstrument.
    submit_noop(args.jobs, prefix="plain")
    began = time.perf_counter()
    cpu = time.process_time()
    steps = drain_inline(worker)
    print(f"# plain inline loop: {(time.perf_counter() - began) / steps * 1e6:.0f} us/step wall, "
          f"{(time.process_time() - cpu) / steps * 1e6:.0f} us/step CPU")
    try:
        from pyinstrument import Profiler
    except ImportError:
        print("pyinstrument is not installed: pip install pyinstrument (not a project dependency)")
        return 0
    submit_noop(args.profile_jobs, prefix="prof")
    profiler = Profiler(interval=0.0002)
    profiler.start()
    steps = drain_inline(worker)
    profiler.stop()
    text = profiler.output_text(unicode=True, color=False, show_all=False)
    (out / f"pyinstrument-{label}.txt").write_text(text)
    (out / f"pyinstrument-{label}.html").write_text(profiler.output_html())
    print(f"# pyinstrument: {steps} steps -> {out}/pyinstrument-{label}.txt")
    worker.heartbeat.stop()
    if args.actions:
        count_actions(args.actions, out, label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
