"""The database's own ceiling: a raw loop of durable's transaction shape, no Django.

One transaction = insert one memo-like row, update one job-like row, commit. The
driver and its settings are the ones durable runs on: the stdlib ``sqlite3`` module
with the project's pragmas (WAL, ``synchronous`` as configured, busy timeout,
``BEGIN IMMEDIATE``), and psycopg 3 on PostgreSQL (a plain connection with psycopg's
defaults: server-side parameters, statements prepared after a few executions). Each
process updates rows of its own, as durable's workers each advance their own jobs.
"""

import json
import multiprocessing
import sqlite3
import time

SQLITE_PRAGMAS = ("journal_mode=WAL", "busy_timeout=30000", "foreign_keys=ON")
ROWS_PER_PROCESS = 1000


def _sqlite_connect(path, synchronous):
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    for pragma in (*SQLITE_PRAGMAS, f"synchronous={synchronous}"):
        conn.execute(f"PRAGMA {pragma}")
    return conn


def _sqlite_setup(path, synchronous, processes):
    conn = _sqlite_connect(path, synchronous)
    conn.executescript(
        """
        DROP TABLE IF EXISTS ceiling_memo;
        DROP TABLE IF EXISTS ceiling_job;
        CREATE TABLE ceiling_job (id TEXT PRIMARY KEY, state TEXT NOT NULL,
                                  n INTEGER NOT NULL, updated TEXT NOT NULL);
        CREATE TABLE ceiling_memo (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL,
                                   step INTEGER NOT NULL, output TEXT, at TEXT NOT NULL);
        CREATE UNIQUE INDEX ceiling_memo_job_step ON ceiling_memo (job_id, step);
        """
    )
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(
        "INSERT INTO ceiling_job VALUES (?, 'pending', 0, strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        [(f"p{p}-{i}",) for p in range(processes) for i in range(ROWS_PER_PROCESS)],
    )
    conn.execute("COMMIT")
    conn.close()


def _pg_setup(url, processes):
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS ceiling_memo, ceiling_job")
        conn.execute(
            "CREATE TABLE ceiling_job (id text PRIMARY KEY, state text NOT NULL,"
            " n integer NOT NULL, updated timestamptz NOT NULL)"
        )
        conn.execute(
            "CREATE TABLE ceiling_memo (id bigserial PRIMARY KEY, job_id text NOT NULL,"
            " step integer NOT NULL, output jsonb, at timestamptz NOT NULL)"
        )
        conn.execute("CREATE UNIQUE INDEX ceiling_memo_job_step ON ceiling_memo (job_id, step)")
        with conn.cursor() as cur:
            with cur.copy("COPY ceiling_job (id, state, n, updated) FROM STDIN") as copy:
                for p in range(processes):
                    for i in range(ROWS_PER_PROCESS):
                        copy.write_row((f"p{p}-{i}", "pending", 0, "now"))
        conn.execute("ANALYZE ceiling_job")


def _loop_sqlite(path, synchronous, index, start, seconds, out):
    conn = _sqlite_connect(path, synchronous)
    output = json.dumps({"ok": True})
    count = 0
    start.wait()
    deadline = time.perf_counter() + seconds
    began = time.perf_counter()
    cpu = time.process_time()
    while time.perf_counter() < deadline:
        job = f"p{index}-{count % ROWS_PER_PROCESS}"
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO ceiling_memo (job_id, step, output, at)"
            " VALUES (?, ?, ?, strftime('%Y-%m-%d %H:%M:%f', 'now'))",
            (job, count, output),
        )
        conn.execute(
            "UPDATE ceiling_job SET state = ?, n = n + 1,"
            " updated = strftime('%Y-%m-%d %H:%M:%f', 'now') WHERE id = ?",
            (f"s{count % 3}", job),
        )
        conn.execute("COMMIT")
        count += 1
    out.put((count, time.perf_counter() - began, time.process_time() - cpu))
    conn.close()


def _loop_pg(url, index, start, seconds, out):
    import psycopg

    conn = psycopg.connect(url)
    output = json.dumps({"ok": True})
    count = 0
    start.wait()
    deadline = time.perf_counter() + seconds
    began = time.perf_counter()
    cpu = time.process_time()
    with conn.cursor() as cur:
        while time.perf_counter() < deadline:
            job = f"p{index}-{count % ROWS_PER_PROCESS}"
            cur.execute(
                "INSERT INTO ceiling_memo (job_id, step, output, at)"
                " VALUES (%s, %s, %s, statement_timestamp())",
                (job, count, output),
            )
            cur.execute(
                "UPDATE ceiling_job SET state = %s, n = n + 1, updated = statement_timestamp()"
                " WHERE id = %s",
                (f"s{count % 3}", job),
            )
            conn.commit()
            count += 1
    out.put((count, time.perf_counter() - began, time.process_time() - cpu))
    conn.close()


# The statements durable's worker sends per step today (see bench/hotpath.py), written
# as raw SQL on durable's own tables: what the engine would reach with no Python cost.
# The gap between this and the minimal shape is the price of the schema and of the
# statement count; the gap between this and durable is the price of Python and the ORM.
_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
_SQLITE_STEP = (
    f"UPDATE durable_job SET state = ?, updated = {_SQLITE_NOW}, attempts = 1,"
    f" lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', '+60 seconds'),"
    f" next_run_at = strftime('%Y-%m-%d %H:%M:%f', 'now', '+60 seconds'), wake_at = NULL,"
    f" last_error = '' WHERE id = ? AND state = ? AND lease_token = 1"
    f" AND lease_until >= {_SQLITE_NOW}",
    "INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt, workflow, at)"
    " VALUES (?, ?, NULL, '0', 100, 1, 'bench_noop', ?)",
    "INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message,"
    " data) VALUES (?, ?, 'step_done', ?, ?, ?, 'w', '', ?), (?, ?, 'step_done', ?, ?, ?, 'w', '', ?)",
)
_PG_STEP = (
    "UPDATE durable_job SET state = %s, updated = statement_timestamp(), attempts = 1,"
    " lease_until = statement_timestamp() + interval '60 seconds',"
    " next_run_at = statement_timestamp() + interval '60 seconds', wake_at = NULL,"
    " last_error = '' WHERE id = %s AND state = %s AND lease_token = 1"
    " AND lease_until >= statement_timestamp()",
    "INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt, workflow, at)"
    " VALUES (%s, %s, NULL, 0, interval '100 microseconds', 1, 'bench_noop', %s)",
    "INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message,"
    " data) VALUES (%s, %s, 'step_done', %s, %s, %s, 'w', '', %s),"
    " (%s, %s, 'step_done', %s, %s, %s, 'w', '', %s)",
)


def _schema_jobs(processes):
    return [f"p{p}-{i}" for p in range(processes) for i in range(ROWS_PER_PROCESS)]


def _schema_setup_sqlite(path, synchronous, processes):
    conn = _sqlite_connect(path, synchronous)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("DELETE FROM durable_jobevent")
    conn.execute("DELETE FROM durable_stepresult")
    conn.execute("DELETE FROM durable_job")
    conn.executemany(
        "INSERT INTO durable_job (id, workflow, workflow_version, queue, state, payload, attempts,"
        " next_run_at, lease_until, lease_owner, lease_token, last_error, submitted_by, created,"
        " updated) VALUES (?, 'bench_noop', 1, 'default', 'a', '{}', 1,"
        " '2999-01-01 00:00:00', '2999-01-01 00:00:00', 'w', 1, '', '',"
        f" {_SQLITE_NOW}, {_SQLITE_NOW})",
        [(j,) for j in _schema_jobs(processes)],
    )
    conn.execute("COMMIT")
    conn.close()


def _schema_setup_pg(url, processes):
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE durable_job, durable_stepresult, durable_jobevent CASCADE")
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO durable_job (id, workflow, workflow_version, queue, state, payload,"
                " attempts, next_run_at, lease_until, lease_owner, lease_token, last_error,"
                " submitted_by, created, updated) VALUES (%s, 'bench_noop', 1, 'default', 'a',"
                " '{}', 1, '2999-01-01', '2999-01-01', 'w', 1, '', '', now(), now())",
                [(j,) for j in _schema_jobs(processes)],
            )
        conn.execute("VACUUM ANALYZE durable_job")


def _schema_params(job, count, state, nxt, stamp, events=2):
    data = '{"attempt": 1}'
    if events == 1:
        event = (job, stamp, state, nxt, f"s{count}", data)
    else:
        event = (job, stamp, state, f"{nxt}x", f"s{count}", data, job, stamp, f"{nxt}x", nxt,
                 f"s{count}", data)
    return (nxt, job, state), (job, f"s{count}", stamp), event


def _event_sql(sql, events):
    """The event INSERT with one row instead of two."""
    return sql if events == 2 else sql[: sql.index("),") + 1]


def _loop_schema_sqlite(path, synchronous, events, index, start, seconds, out):
    conn = _sqlite_connect(path, synchronous)
    event_sql = _event_sql(_SQLITE_STEP[2], events)
    states = {}
    count = 0
    start.wait()
    deadline = time.perf_counter() + seconds
    began = time.perf_counter()
    cpu = time.process_time()
    while time.perf_counter() < deadline:
        job = f"p{index}-{count % ROWS_PER_PROCESS}"
        state = states.get(job, "a")
        nxt = "b" if state == "a" else "a"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        params = _schema_params(job, count, state, nxt, stamp, events)
        conn.execute("BEGIN IMMEDIATE")
        cur = conn.execute(_SQLITE_STEP[0], params[0])
        if cur.rowcount != 1:
            raise RuntimeError("compare-and-swap matched nothing")
        conn.execute(_SQLITE_STEP[1], params[1])
        conn.execute(event_sql, params[2])
        conn.execute("COMMIT")
        states[job] = nxt
        count += 1
    out.put((count, time.perf_counter() - began, time.process_time() - cpu))
    conn.close()


def _loop_schema_pg(url, events, index, start, seconds, out):
    import psycopg

    conn = psycopg.connect(url)
    event_sql = _event_sql(_PG_STEP[2], events)
    states = {}
    count = 0
    start.wait()
    deadline = time.perf_counter() + seconds
    began = time.perf_counter()
    cpu = time.process_time()
    with conn.cursor() as cur:
        while time.perf_counter() < deadline:
            job = f"p{index}-{count % ROWS_PER_PROCESS}"
            state = states.get(job, "a")
            nxt = "b" if state == "a" else "a"
            stamp = time.strftime("%Y-%m-%d %H:%M:%S+00")
            params = _schema_params(job, count, state, nxt, stamp, events)
            cur.execute(_PG_STEP[0], params[0])
            if cur.rowcount != 1:
                raise RuntimeError("compare-and-swap matched nothing")
            cur.execute(_PG_STEP[1], params[1])
            cur.execute(event_sql, params[2])
            conn.commit()
            states[job] = nxt
            count += 1
    out.put((count, time.perf_counter() - began, time.process_time() - cpu))
    conn.close()


def measure(kind, processes, seconds, *, sqlite_path=None, synchronous="FULL", pg_url=None,
            shape="minimal", events=1):
    """Commit a transaction shape from ``processes`` processes for ``seconds``; return rates.

    ``shape="minimal"``: one insert, one update, commit, on two small tables.
    ``shape="durable"``: durable's per-step statements, raw, on durable's own tables
    (which must exist: a migrated database).
    """
    if kind == "sqlite" and shape == "minimal":
        _sqlite_setup(sqlite_path, synchronous, processes)
        target, args = _loop_sqlite, (sqlite_path, synchronous)
    elif kind == "sqlite":
        _schema_setup_sqlite(sqlite_path, synchronous, processes)
        target, args = _loop_schema_sqlite, (sqlite_path, synchronous, events)
    elif shape == "minimal":
        _pg_setup(pg_url, processes)
        target, args = _loop_pg, (pg_url,)
    else:
        _schema_setup_pg(pg_url, processes)
        target, args = _loop_schema_pg, (pg_url, events)
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, i, start, seconds, out)) for i in range(processes)]
    for proc in procs:
        proc.start()
    time.sleep(0.3)  # let every process connect before the clock starts
    start.set()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for proc in procs:
        proc.join()
    count = sum(r[0] for r in results)
    elapsed = max(r[1] for r in results)
    cpu = sum(r[2] for r in results)
    return {
        "tx": count,
        "seconds": elapsed,
        "tx_per_s": count / elapsed,
        "cpu_us_per_tx": cpu / count * 1e6 if count else None,
    }
