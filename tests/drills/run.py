"""Run the drills and print the table of counts.

    python -m tests.drills.run --size small|release --database sqlite|postgres [--only NAME] [--threads N]

Each drill runs on a fresh database of its own (created here and dropped at the end).
``--restart-postgres`` adds the PostgreSQL restart to the small size (the release size
always includes it); it restarts the local cluster, so never point it at a shared server.
The exit status is 1 when any row misses its targets.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

DRILLS = [
    "faults", "matrix", "random", "storm", "paused", "terminate", "restart", "skew", "busy", "busy-deferred",
    "partition",
    "schedules",
]


def plan(size, database, only, restart):
    """The drills to run, as (name, callable(lab) -> [Counts] or reason to skip)."""
    from . import drills as d

    steps = []
    if "faults" in only:
        for point in d.wired_points():
            if point in d.JOB_POINTS:
                steps.append((f"faults:{point}",
                              lambda lab, p=point: [d.fault_point_once(lab, p, size)]))
            elif point in d.ACTION_POINTS:
                steps.append((f"faults:{point}",
                              lambda lab, p=point: [d.action_fault_once(lab, p, size)]))
            elif point in d.APPROVAL_POINTS:
                steps.append((f"faults:{point}",
                              lambda lab, p=point: [d.approval_fault_once(lab, p, size)]))
    if "matrix" in only:
        steps.append(("matrix", lambda lab: d.receiver_matrix(lab, size)))
    if "random" in only and size.random_jobs:
        steps.append(("random", lambda lab: [d.random_fault_kills(lab, size)]))
    if "storm" in only:
        steps.append(("storm", lambda lab: [d.kill_storm(lab, size)]))
    if "paused" in only:
        steps.append(("paused", lambda lab: [d.paused_holder(lab, size)]))
    if "schedules" in only:
        from . import schedules as sd

        steps.append(("schedules", lambda lab: [sd.steady_and_outage(lab, size)]))
        if database == "postgres" and d.faketime_library():
            steps.append(("schedules-skew", lambda lab: [sd.skewed_firer(lab, size, d.skewed_env)]))
    if database == "postgres":
        if "terminate" in only:
            steps.append(("terminate", lambda lab: [d.terminated_connections(lab, size)]))
        if "restart" in only and (size.restart_postgres or restart):
            steps.append(("restart", lambda lab: [d.postgres_restart(lab, size)]))
        if "skew" in only:
            if d.faketime_library():
                steps.append(("skew", lambda lab: [d.clock_skew(lab, size)]))
                steps.append(("skew-approvals", lambda lab: [d.clock_skew_approvals(lab, size)]))
            else:
                steps.append(("skew", "libfaketime is not installed"
                                      " (sh scripts/system.sh, or apt-get install faketime)"))
        if "partition" in only:
            from . import netlab

            reason = netlab.unavailable()
            steps.append(("partition", reason or (lambda lab: _partition(lab, size))))
    else:
        if "partition" in only:
            steps.append(("partition", "several hosts share one PostgreSQL; a SQLite file "
                                       "cannot be shared across machines"))
        if "skew" in only:
            steps.append(("skew", "SQLite has no server clock: each process reads its own, so "
                                  "a skewed process on one machine is not a supported setup"))
        if "busy" in only:
            steps.append(("busy", lambda lab: [d.sqlite_contention(lab, size)]))
        if "busy-deferred" in only:
            steps.append(("busy-deferred",
                          lambda lab: [d.sqlite_contention(lab, size, "DEFERRED")]))
    return steps


def _partition(lab, size):
    """The partition drill builds its own hosts and cluster, in a process of its own."""
    from .partition import run_in_subprocess

    rows, skipped = run_in_subprocess(size.name, lab.workdir, threads=lab.threads,
                                      connections=lab.connections)
    if skipped:
        raise RuntimeError(skipped)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.drills.run", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["small", "release"], default="small")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--only", action="append", choices=DRILLS,
                        help="run only this drill (repeatable)")
    parser.add_argument("--restart-postgres", action="store_true",
                        help="include the PostgreSQL restart in the small size")
    parser.add_argument("--keep", action="store_true", help="keep the logs directory")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="list every duplicate execution and what allowed it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads per worker process (default: the setting's default)")
    parser.add_argument("--connections", type=int, default=None,
                        help="database connections per worker process (default: the setting's)")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="durable-drills-"))
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["DURABLE_TEST_DATABASE"] = args.database
    if args.database == "postgres":
        os.environ["DURABLE_TEST_DB_NAME"] = f"durable_drill_{os.getpid()}"
    else:
        os.environ["DURABLE_TEST_SQLITE"] = str(workdir / "drill.sqlite3")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import setup_databases, teardown_databases

    from .counts import table
    from .drills import SIZES
    from .lab import Lab

    size = SIZES[args.size]
    only = set(args.only or DRILLS)
    old = setup_databases(verbosity=0, interactive=False)
    rows, skipped, failed = [], [], []
    began = time.monotonic()
    try:
        for name, drill in plan(size, args.database, only, args.restart_postgres):
            if isinstance(drill, str):
                skipped.append(f"{name}: {drill}")
                continue
            call_command("flush", interactive=False, verbosity=0)
            lab = Lab(workdir / name.replace(":", "-"), seed=args.seed, threads=args.threads,
                      connections=args.connections)
            print(f"... {name}", file=sys.stderr, flush=True)
            try:
                rows.extend(drill(lab))
            except Exception as exc:  # noqa: BLE001 - report and go on with the next drill
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
            finally:
                lab.close()
    finally:
        connection.close()
        teardown_databases(old, verbosity=0)

    print(f"durable drills: size={args.size} database={args.database} "
          f"({time.monotonic() - began:.0f}s)")
    print(table(rows))
    status = 0
    for row in rows:
        # Only the blind receiver's ambiguous sends are meant to wait for a person.
        problems = row.problems(parked_ok=bool(row.extra.get("blind")))
        figures = ", ".join(f"{k}={v}" for k, v in row.extra.items())
        print(f"- {row.drill}: {figures}")
        for note in row.notes:
            print(f"    note: {note}")
        if args.verbose:
            for line in row.duplicates:
                print(f"    duplicate: {line}")
        if problems or _drill_specific(row):
            status = 1
            print(f"    MISSED: {'; '.join(problems + _drill_specific(row))}")
    for line in skipped:
        print(f"- skipped {line}")
    for line in failed:
        status = 1
        print(f"- ERROR {line}")
    if args.keep:
        print(f"logs: {workdir}")
    return status


def _drill_specific(row):
    """Targets beyond the common columns."""
    from .drills import locked_errors, matrix_problems

    out = []
    if row.drill.startswith("receiver "):
        out.extend(matrix_problems(row))
    if row.drill.startswith("fault ") and not row.extra.get("fired"):
        out.append("the fault point never fired")
    if row.drill == "sqlite busy (immediate)" and locked_errors(row):
        out.append(f"{locked_errors(row)} 'database is locked' errors")
    if row.drill == "sqlite busy (deferred)" and not locked_errors(row):
        out.append("DEFERRED showed no 'database is locked': the drill cannot see the errors")
    if row.extra.get("expired_early") or row.extra.get("all_refunded") is False:
        out.append("approvals expired early under a skewed clock")
    if row.drill == "paused holder" and not row.extra.get("returned_to_commit"):
        out.append("the paused holders never reached their commit")
    if row.drill.startswith("partition"):
        from .partition import problems

        out.extend(problems(row))
    if row.extra.get("worker_restarts"):
        out.append("workers had to be restarted")
    return out


if __name__ == "__main__":
    sys.exit(main())
