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


def measure(kind, processes, seconds, *, sqlite_path=None, synchronous="FULL", pg_url=None):
    """Commit the transaction shape from ``processes`` processes for ``seconds``; return rates."""
    if kind == "sqlite":
        _sqlite_setup(sqlite_path, synchronous, processes)
        target, args = _loop_sqlite, (sqlite_path, synchronous)
    else:
        _pg_setup(pg_url, processes)
        target, args = _loop_pg, (pg_url,)
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
