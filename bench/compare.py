"""Two commits measured in one run: no-op drain, ``@task`` jobs and the dispatcher.

    python bench/compare.py --against 74c0adc
    python bench/compare.py --against v0.3 --databases postgres --processes 1,4 --repeat 5
    python bench/compare.py --against HEAD~1 --measure tasks,dispatch --databases sqlite

The other commit is checked out beside this one (``git worktree add --detach`` into
a temporary directory, removed afterwards) and each checkout measures with its own
code, schema and ``bench/phase.py``, with the same virtualenv (this one's). Every
repeat measures the two checkouts back to back, alternating which goes first, per
database, measure and process count, so a drift of the machine hits both; each table
gives the median (min–max) of each and the ratio of the medians (this checkout over
the other). Each checkout gets its own PostgreSQL database and its own SQLite template.

The measures (``--measure``) are bench/run.py's figures of the same names:

- ``drain``: steps/s and CPU µs per step of ``--jobs`` three-step no-op jobs drained
  by ``runworkers --burst -p P`` for P in ``--processes``;
- ``tasks``: jobs/s and CPU µs per job of ``--task-jobs`` no-op ``@task`` calls drained
  by ``runworkers --burst -p P`` for P in ``--task-processes`` (durable only: the peer
  is the same for both commits, so it is not run);
- ``dispatch``: healthy actions/s of ``--dispatch-jobs`` queued actions sent by one
  ``runworkers --dispatcher-only`` to a receiver (this checkout's, in a process of its
  own, for both) that answers after ``--dispatch-latency`` s; no stalled destination.

The defaults suit a 2-core machine. The whole default run was not timed; each of its
measurements was, on a 2-core machine (SQLite / PostgreSQL, one checkout): a drain
4 / 6 s, a @task drain 3 / 6 s, the dispatcher 9 / 12 s, which with the quiet waits of
an idle machine (1-2 s each) make about 7 minutes for both databases and both
checkouts, 3 repeats. While other work keeps the machine busy, each ``--quiet-wait``
may add up to 20 s.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path.pop(0)  # run as a script: import bench.* from the repository, not siblings
sys.path.insert(0, str(ROOT))

from bench import machine  # noqa: E402
from bench.run import Bench, _csv, source_version  # noqa: E402

MEASURES = ("drain", "tasks", "dispatch")


class CheckoutBench(Bench):
    """A Bench whose commands run in ``root`` (another checkout's code and schema)."""

    def __init__(self, args, root, pg_database):
        super().__init__(args)
        self.root = Path(root)
        self.args = argparse.Namespace(**{**vars(args), "pg_database": pg_database})

    def _manage(self, env, *command):
        subprocess.run([sys.executable, str(self.root / "manage.py"), *command], cwd=self.root,
                       env=env, check=True)

    def phase(self, name, env, **params):
        params["log_dir"] = str(self.logs)
        proc = subprocess.run([sys.executable, "-m", "bench.phase", name, json.dumps(params)],
                              cwd=self.root, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"phase {name} in {self.root.name} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def record(self, figure, db, repeat, **fields):
        """The figure alone: the caller keeps the rows and labels them with the checkout."""
        return fields

    def measure(self, which, measure, db, processes, repeat):
        """One figure of this checkout, as bench/run.py's Bench takes it."""
        if measure == "drain":
            threads = self.args.threads if which == "this" else None
            return self.phase("drain", self.fresh(db), jobs=self.args.jobs, processes=processes,
                              threads=threads)
        if measure == "tasks":
            # Bench.tasks' durable half; its peer half is the same code for both commits.
            return self.phase("tasks", self.fresh(db), jobs=self.args.task_jobs,
                              processes=processes)
        # The receiver, the stalled URL and the settings' environment, for this checkout.
        return self.dispatch(db, False, repeat)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="the other commit (any git revision)")
    p.add_argument("--measure", type=_csv(str), default=list(MEASURES),
                   help="comma-separated: drain,tasks,dispatch (default all three)")
    p.add_argument("--databases", type=_csv(str), default=["sqlite", "postgres"])
    p.add_argument("--processes", type=_csv(int), default=[1, 4],
                   help="worker processes for the drain (default 1,4)")
    p.add_argument("--jobs", type=int, default=2000, help="three-step jobs per drain")
    p.add_argument("--task-processes", type=_csv(int), default=[1],
                   help="worker processes for the @task drain (default 1)")
    p.add_argument("--task-jobs", type=int, default=2000, help="no-op @task calls per drain")
    p.add_argument("--dispatch-jobs", type=int, default=1000,
                   help="queued actions the dispatcher sends (default 1000)")
    p.add_argument("--dispatch-latency", type=float, default=0.1,
                   help="seconds the receiver takes to answer (default 0.1)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quiet-wait", type=float, default=20.0)
    p.add_argument("--quiet-threshold", type=float, default=0.25)
    p.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--pg-database", default="durable_bench",
                   help="this checkout's database (the other's gets the suffix _other)")
    p.add_argument("--threads", type=int, default=None,
                   help="runworkers --threads for this checkout's drain (default: the command's"
                        " default; the other checkout, and the other measures, always get the"
                        " command's default)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "compare.json"))
    args = p.parse_args(argv)
    for measure in args.measure:
        if measure not in MEASURES:
            p.error(f"unknown measure {measure!r}: use {','.join(MEASURES)}")
    # What Bench reads and this command does not vary. "tasks" is skipped for Bench.prepare
    # only: it would build the peer's virtualenv, and the peer is not measured here.
    args.sqlite_synchronous = ["FULL"]
    args.skip = ["tasks"]
    args.profile = False
    args.keep = False
    return args


def _spread(values):
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def _cells(args, measure):
    return {"drain": args.processes, "tasks": args.task_processes, "dispatch": [1]}[measure]


def _progress(measure, res):
    if measure == "drain":
        return f"{res['steps_per_s']:.0f} steps/s, {res['cpu_us_per_step']:.0f} us CPU/step"
    if measure == "tasks":
        return f"{res['jobs_per_s']:.0f} @task jobs/s, {res['cpu_us_per_job']:.0f} us CPU/job"
    return f"{res['healthy_actions_per_s']:.0f} actions/s of a bound of {res['bound_per_s']:.0f}"


# Per measure, the table's columns: (heading, field of the phase's result).
COLUMNS = {
    "drain": [("steps/s", "steps_per_s"), ("CPU µs/step", "cpu_us_per_step")],
    "tasks": [("@task jobs/s", "jobs_per_s"), ("CPU µs/job", "cpu_us_per_job")],
    "dispatch": [("actions/s", "healthy_actions_per_s")],
}


def _caption(args, measure):
    if measure == "drain":
        return f"{args.jobs} jobs x 3 no-op steps"
    if measure == "tasks":
        return f"{args.task_jobs} no-op @task calls"
    return (f"{args.dispatch_jobs} actions through one dispatcher, receiver answering after "
            f"{args.dispatch_latency:g} s")


def _label(measure, db, p):
    return db if measure == "dispatch" else f"{db} p={p}"


def main(argv=None):
    args = parse_args(argv)
    other = Path(tempfile.mkdtemp(prefix="durable-compare-")) / "checkout"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), args.against],
                   cwd=ROOT, check=True)
    against = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
    benches = {"this": CheckoutBench(args, ROOT, args.pg_database),
               "other": CheckoutBench(args, other, f"{args.pg_database}_other")}
    rows, errors, failed = [], [], set()
    started = time.time()
    try:
        for bench in benches.values():
            bench.prepare()
        for repeat in range(args.repeat):
            for db in args.databases:
                for measure in args.measure:
                    for p in _cells(args, measure):
                        if (measure, db, p) in failed:
                            continue  # it failed in an earlier repeat: it would fail again
                        order = list(benches.items())
                        if repeat % 2:
                            order.reverse()
                        for which, bench in order:
                            if args.quiet_wait > 0:
                                machine.wait_for_quiet(args.quiet_threshold, args.quiet_wait)
                            what = f"{which} {measure} {_label(measure, db, p)}"
                            try:
                                res = bench.measure(which, measure, db, p, repeat)
                            except Exception as exc:  # noqa: BLE001 - keep the other measures
                                # The other checkout still runs: whether it fails there too
                                # says whose the failure is.
                                errors.append(f"{what}: {exc}")
                                failed.add((measure, db, p))
                                print(f"  ! {what} failed: {exc}", file=sys.stderr)
                                continue
                            rows.append({"checkout": which, "measure": measure, "database": db,
                                         "processes": p, "repeat": repeat, **res})
                            if measure == "drain":  # the line it always printed
                                print(f"  {which} {db} p={p}: {_progress(measure, res)}",
                                      file=sys.stderr)
                            else:
                                print(f"  {what}: {_progress(measure, res)}", file=sys.stderr)
    finally:
        for bench in benches.values():
            bench.cleanup()
        subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)
        shutil.rmtree(other.parent, ignore_errors=True)

    this = source_version()
    sizes = ", ".join(_caption(args, m) for m in args.measure)
    print(f"\n`python bench/compare.py {' '.join(sys.argv[1:] if argv is None else argv)}`: "
          f"{this} against {against}, {sizes}, {args.repeat} repeats, "
          f"{time.time() - started:.0f} s")
    for measure in args.measure:
        columns = COLUMNS[measure]
        if len(args.measure) > 1:
            print(f"\n{measure}: {_caption(args, measure)}")
        print()
        print("| database | " + " | ".join(f"{h} {against} | {h} {this} | ratio"
                                             for h, _ in columns) + " |")
        print("|---|" + "---|---|---|" * len(columns))
        for db in args.databases:
            for p in _cells(args, measure):
                pick = {w: [r for r in rows if r["checkout"] == w and r["measure"] == measure
                            and r["database"] == db and r["processes"] == p] for w in benches}
                if not pick["this"] and not pick["other"] and (measure, db, p) not in failed:
                    continue
                cells = []
                for _, field in columns:
                    values = {w: [r[field] for r in pick[w]] for w in pick}
                    if values["this"] and values["other"]:
                        ratio = statistics.median(values["this"]) / statistics.median(values["other"])
                        ratio = f"{ratio:.2f}"
                    else:
                        ratio = "—"
                    cells += [_spread(values["other"]) if values["other"] else "failed",
                              _spread(values["this"]) if values["this"] else "failed", ratio]
                print(f"| {_label(measure, db, p)} | " + " | ".join(cells) + " |")
    if errors:
        # The whole messages were printed as they happened; here the last line of each.
        print("\nfailed:", file=sys.stderr)
        for error in errors:
            what, _, message = error.partition(": ")
            print(f"  {what}: {message.strip().splitlines()[-1] if message.strip() else ''}",
                  file=sys.stderr)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"this": this, "against": against, "rows": rows,
                                           "errors": errors}, indent=1, default=str))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
