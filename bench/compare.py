"""The no-op drain of two commits, measured in one run: steps/s and CPU per step.

    python bench/compare.py --against 74c0adc
    python bench/compare.py --against v0.3 --databases postgres --processes 1,4 --repeat 5

The other commit is checked out beside this one (``git worktree add --detach`` into
a temporary directory, removed afterwards) and each checkout drains from its own
code, schema and ``bench/phase.py``, with the same virtualenv (this one's). Every
repeat measures the two checkouts back to back, alternating which goes first, per
database and process count, so a drift of the machine hits both; the table gives
the median (min–max) of each and the ratio of the medians (this checkout over the
other). Each checkout gets its own PostgreSQL database and its own SQLite template.
"""

import argparse
import json
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="the other commit (any git revision)")
    p.add_argument("--databases", type=_csv(str), default=["sqlite", "postgres"])
    p.add_argument("--processes", type=_csv(int), default=[1, 4])
    p.add_argument("--jobs", type=int, default=2000, help="three-step jobs per drain")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quiet-wait", type=float, default=20.0)
    p.add_argument("--quiet-threshold", type=float, default=0.25)
    p.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--pg-database", default="durable_bench",
                   help="this checkout's database (the other's gets the suffix _other)")
    p.add_argument("--threads", type=int, default=None,
                   help="runworkers --threads for this checkout (default: the command's default;"
                        " the other checkout always gets its command's default)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "compare.json"))
    args = p.parse_args(argv)
    # What Bench reads and this command does not vary.
    args.sqlite_synchronous = ["FULL"]
    args.skip = ["tasks"]
    args.profile = False
    args.keep = False
    return args


def _spread(values):
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def main(argv=None):
    args = parse_args(argv)
    other = Path(tempfile.mkdtemp(prefix="durable-compare-")) / "checkout"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), args.against],
                   cwd=ROOT, check=True)
    against = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
    benches = {"this": CheckoutBench(args, ROOT, args.pg_database),
               "other": CheckoutBench(args, other, f"{args.pg_database}_other")}
    rows = []
    started = time.time()
    try:
        for bench in benches.values():
            bench.prepare()
        for repeat in range(args.repeat):
            for db in args.databases:
                for p in args.processes:
                    order = list(benches.items())
                    if repeat % 2:
                        order.reverse()
                    for which, bench in order:
                        if args.quiet_wait > 0:
                            machine.wait_for_quiet(args.quiet_threshold, args.quiet_wait)
                        threads = args.threads if which == "this" else None
                        res = bench.phase("drain", bench.fresh(db), jobs=args.jobs, processes=p,
                                          threads=threads)
                        rows.append({"checkout": which, "database": db, "processes": p,
                                     "repeat": repeat, **res})
                        print(f"  {which} {db} p={p}: {res['steps_per_s']:.0f} steps/s, "
                              f"{res['cpu_us_per_step']:.0f} us CPU/step", file=sys.stderr)
    finally:
        for bench in benches.values():
            bench.cleanup()
        subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)

    this = source_version()
    print(f"\n`python bench/compare.py {' '.join(sys.argv[1:] if argv is None else argv)}`: "
          f"{this} against {against}, {args.jobs} jobs x 3 no-op steps, {args.repeat} repeats, "
          f"{time.time() - started:.0f} s\n")
    print(f"| database | steps/s {against} | steps/s {this} | ratio | CPU µs/step {against} "
          f"| CPU µs/step {this} | ratio |")
    print("|---|---|---|---|---|---|---|")
    for db in args.databases:
        for p in args.processes:
            pick = {w: [r for r in rows if r["checkout"] == w and r["database"] == db
                        and r["processes"] == p] for w in benches}
            if not pick["this"] or not pick["other"]:
                continue
            rate = {w: [r["steps_per_s"] for r in pick[w]] for w in pick}
            cpu = {w: [r["cpu_us_per_step"] for r in pick[w]] for w in pick}
            print(f"| {db} p={p} | {_spread(rate['other'])} | {_spread(rate['this'])} | "
                  f"{statistics.median(rate['this']) / statistics.median(rate['other']):.2f} | "
                  f"{_spread(cpu['other'])} | {_spread(cpu['this'])} | "
                  f"{statistics.median(cpu['this']) / statistics.median(cpu['other']):.2f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"this": this, "against": against, "rows": rows},
                                          indent=1, default=str))


if __name__ == "__main__":
    main()
