"""Price each per-step write two ways, the ORM as the runner does it and raw cached SQL.

    python -m bench.ormcost [--n 2000]     (database from the environment, see bench/settings.py)

Every variant runs ``n`` times inside one transaction that is rolled back, so the
figures are CPU plus round trip without the commit (the commit is the same either
way; the ceiling figures price it). The statements are the ones durable sends today
(bench/hotpath.py lists them); the raw variants keep their semantics: the same
compare-and-swap guarded by state, lease token and the database clock.
"""

import argparse
import datetime
import json
import logging
import os
import sys
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def _timed(n, func):
    began = time.perf_counter()
    for i in range(n):
        func(i)
    return (time.perf_counter() - began) / n * 1e6


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    _setup()
    from django.db import connection, transaction
    from django.db.models.functions import Now

    from durable.models import EventKind, Job, JobEvent, StepResult
    from durable.store import locking

    pg = connection.vendor == "postgresql"
    n = args.n
    jobs = [f"oc-{i:06d}" for i in range(n)]
    results = {}

    class Rollback(Exception):
        pass

    def fresh_jobs():
        Job.objects.bulk_create([
            Job(id=j, workflow="bench_noop", state="one_running", payload={}, attempts=1,
                lease_token=1, lease_owner="w",
                lease_until=datetime.datetime(2999, 1, 1, tzinfo=datetime.UTC),
                next_run_at=datetime.datetime(2999, 1, 1, tzinfo=datetime.UTC))
            for j in jobs
        ])

    def measure(name, func):
        try:
            with transaction.atomic():
                fresh_jobs()
                results[name] = _timed(n, func)
                raise Rollback
        except Rollback:
            pass

    until = locking.now_plus(60)
    # 1. The compare-and-swap, as transition() builds it for a step that keeps going.
    def orm_cas(i):
        qs = locking.fenced(Job.objects.filter(pk=jobs[i], state="one_running"), 1)
        assert qs.update(state="two_running", updated=Now(), attempts=1, lease_until=until,
                         next_run_at=until, wake_at=None, last_error="")

    if pg:
        cas_sql = ("UPDATE durable_job SET state = %s, updated = statement_timestamp(), attempts = 1,"
                   " lease_until = statement_timestamp() + %s * interval '1 second',"
                   " next_run_at = statement_timestamp() + %s * interval '1 second',"
                   " wake_at = NULL, last_error = '' WHERE id = %s AND state = %s"
                   " AND lease_token = %s AND lease_until >= statement_timestamp()")
    else:
        cas_sql = ("UPDATE durable_job SET state = %s, updated = strftime('%%Y-%%m-%%d %%H:%%M:%%f','now'),"
                   " attempts = 1,"
                   " lease_until = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '+' || %s || ' seconds'),"
                   " next_run_at = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '+' || %s || ' seconds'),"
                   " wake_at = NULL, last_error = '' WHERE id = %s AND state = %s"
                   " AND lease_token = %s AND lease_until >= strftime('%%Y-%%m-%%d %%H:%%M:%%f','now')")

    def raw_cas(i):
        with connection.cursor() as cur:
            cur.execute(cas_sql, ["two_running", 60.0, 60.0, jobs[i], "one_running", 1])
            assert cur.rowcount == 1

    measure("CAS update: ORM (locking.transition's queryset)", orm_cas)
    measure("CAS update: raw SQL, cached string, Django cursor", raw_cas)

    # 2. The memo row.
    duration = datetime.timedelta(microseconds=120)

    def orm_memo(i):
        StepResult.objects.create(job_id=jobs[i], step="one", output=None, cost=Decimal(0),
                                  duration=duration, attempt=1, workflow="bench_noop")

    if pg:
        memo_sql = ("INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt,"
                    " workflow, at) VALUES (%s, %s, %s, %s, %s, %s, %s, statement_timestamp())")
    else:
        memo_sql = ("INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt,"
                    " workflow, at) VALUES (%s, %s, %s, %s, %s, %s, %s,"
                    " strftime('%%Y-%%m-%%d %%H:%%M:%%f','now'))")
    memo_duration = duration if pg else 120

    def raw_memo(i):
        with connection.cursor() as cur:
            cur.execute(memo_sql, [jobs[i], "one", None, "0", memo_duration, 1, "bench_noop"])

    measure("memo insert: ORM StepResult.objects.create", orm_memo)
    measure("memo insert: raw SQL", raw_memo)

    # 3. The events (two per step today: X_done and the next step's working state).
    data = {"attempt": 1, "cost": "0", "ms": 0.12}

    def orm_events(i):
        JobEvent.objects.bulk_create([
            JobEvent(job_id=jobs[i], kind=EventKind.STEP_DONE, from_state="one_running",
                     to_state="one_done", step="one", actor="w", message="", data=data),
            JobEvent(job_id=jobs[i], kind=EventKind.STEP_DONE, from_state="one_done",
                     to_state="two_running", step="one", actor="w", message="", data=data),
        ])

    now_sql = "statement_timestamp()" if pg else "strftime('%%Y-%%m-%%d %%H:%%M:%%f','now')"
    ev_sql = ("INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor,"
              f" message, data) VALUES (%s, {now_sql}, %s, %s, %s, %s, %s, '', %s)")
    payload = json.dumps(data)

    def raw_events(i):
        with connection.cursor() as cur:
            cur.execute(ev_sql.replace("VALUES (", "VALUES (", 1) + ", (%s, " + now_sql
                        + ", %s, %s, %s, %s, %s, '', %s)",
                        [jobs[i], "step_done", "one_running", "one_done", "one", "w", payload,
                         jobs[i], "step_done", "one_done", "two_running", "one", "w", payload])

    def raw_one_event(i):
        with connection.cursor() as cur:
            cur.execute(ev_sql, [jobs[i], "step_done", "one_running", "two_running", "one", "w",
                                 payload])

    measure("events: ORM bulk_create of 2 rows", orm_events)
    measure("events: raw SQL, 2 rows", raw_events)
    measure("events: raw SQL, 1 row per step (one_running -> two_running)", raw_one_event)

    # 4. All three writes in one statement (PostgreSQL: data-modifying CTEs).
    if pg:
        one_sql = (
            "WITH moved AS (" + cas_sql + " RETURNING id),"
            " memo AS (INSERT INTO durable_stepresult (job_id, step, output, cost, duration,"
            " attempt, workflow, at) SELECT id, %s, NULL, 0, %s, 1, %s, statement_timestamp()"
            " FROM moved),"
            " ev AS (INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step,"
            " actor, message, data) SELECT id, statement_timestamp(), 'step_done', %s, %s, %s,"
            " %s, '', %s FROM moved)"
            " SELECT count(*) FROM moved"
        )

        def one_statement(i):
            with connection.cursor() as cur:
                cur.execute(one_sql, ["two_running", 60.0, 60.0, jobs[i], "one_running", 1,
                                      "one", duration, "bench_noop", "one_running",
                                      "two_running", "one", "w", payload])
                assert cur.fetchone()[0] == 1

        measure("all three writes: one raw statement (CTE), 1 round trip", one_statement)

    # 5. The per-step INFO log line (to a file, as a service's stderr would be).
    log = logging.getLogger("durable.worker")
    sink = open(os.devnull, "w")  # noqa: SIM115
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    saved = log.handlers, log.propagate, log.level
    log.handlers, log.propagate = [handler], False
    log.setLevel(logging.INFO)
    results["log line at INFO (one StreamHandler)"] = _timed(n, lambda i: log.info(
        "%s job=%s step=%s attempt=%d done in %.1fms cost=%s -> %s", "w", jobs[i], "one", 1,
        0.1, 0, "two_running"))
    log.setLevel(logging.WARNING)
    results["log line below the level (DEBUG call, INFO level)"] = _timed(n, lambda i: log.debug(
        "%s job=%s step=%s attempt=%d done in %.1fms cost=%s -> %s", "w", jobs[i], "one", 1,
        0.1, 0, "two_running"))
    log.handlers, log.propagate, _ = saved
    log.setLevel(saved[2])

    width = max(len(k) for k in results)
    print(f"# per-call cost on {connection.vendor}, n={n}, inside one rolled-back transaction")
    for name, us in results.items():
        print(f"{name.ljust(width)}  {us:7.0f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"vendor": connection.vendor, "us": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
