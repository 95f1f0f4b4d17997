"""What durable's schema costs per step, index by index: the durable-shape ceiling on variants.

    python -m bench.schema [--repeat 3] [--processes 1,4] [--seconds 3] [--json PATH]

The raw per-step transaction of bench/ceiling.py (fenced UPDATE of the job, memo
INSERT, event INSERT, commit), with no Python cost, on durable's migrated tables and
on variants of them, interleaved, so the lead can see what a schema change would buy
before making it:

    as-migrated      the tables exactly as the migrations create them; two events per step
    no-fk-twins      without the single-column job_id indexes Django adds for the
                     StepResult and JobEvent foreign keys (and PostgreSQL's _like copies):
                     (job, step) and (job, id) already lead with job_id
    one-event        no-fk-twins, and one event row per step instead of two
    lean             one-event, and without the indexes no worker query reads
                     (job updated, job workflow+state, event kind+at, memo at+workflow+step)
"""

import argparse
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path.pop(0)
sys.path.insert(0, str(ROOT))

from bench import ceiling  # noqa: E402

FK_TWINS = [("durable_stepresult", r"\(job_id( varchar_pattern_ops)?\)$"),
            ("durable_jobevent", r"\(job_id( varchar_pattern_ops)?\)$")]
UNREAD = [("durable_job", r"\(updated\)$"), ("durable_job", r"\(workflow, state\)$"),
          ("durable_jobevent", r"\(kind, at\)$"), ("durable_stepresult", r"\(at, workflow, step\)$")]
VARIANTS = {
    "as-migrated": ([], 2),
    "no-fk-twins": (FK_TWINS, 2),
    "one-event": (FK_TWINS, 1),
    "lean": (FK_TWINS + UNREAD, 1),
}


def _sqlite_indexes(path):
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT tbl_name, name, sql FROM sqlite_master WHERE type = 'index'"
                        " AND sql IS NOT NULL").fetchall()
    conn.close()
    # Normalise SQLite's DDL to PostgreSQL's shape so one set of patterns serves both.
    return [(t, n, re.sub(r'"', "", sql or "")) for t, n, sql in rows]


def _pg_indexes(url):
    import psycopg

    with psycopg.connect(url) as conn:
        return conn.execute("SELECT tablename, indexname, indexdef FROM pg_indexes"
                            " WHERE tablename LIKE 'durable_%'").fetchall()


def _matching(indexes, rules):
    names = []
    for table, name, sql in indexes:
        for rule_table, pattern in rules:
            if table == rule_table and re.search(pattern, sql.strip()):
                names.append(name)
    return names


def _migrate(env):
    subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"], cwd=ROOT, env=env,
                   check=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--processes", default="1,4")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--databases", default="sqlite-full,sqlite-normal,postgres")
    p.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "schema.json"))
    args = p.parse_args(argv)
    processes = [int(x) for x in args.processes.split(",")]
    databases = args.databases.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="durable-schema-"))
    base_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings"}
    template = tmp / "template.sqlite3"
    pg_base = args.pg_url.rsplit("/", 1)[0]
    results = []
    try:
        if any(d.startswith("sqlite") for d in databases):
            _migrate({**base_env, "BENCH_DATABASE": "sqlite", "BENCH_SQLITE_PATH": str(template)})
        if "postgres" in databases:
            import psycopg

            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                for name in ("durable_bench_schema", "durable_bench_schema_tpl"):
                    conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                conn.execute("CREATE DATABASE durable_bench_schema_tpl")
            _migrate({**base_env, "BENCH_DATABASE": "postgres",
                      "BENCH_POSTGRES_URL": f"{pg_base}/durable_bench_schema_tpl"})
        for repeat in range(args.repeat):
            for db in databases:
                for variant, (rules, events) in VARIANTS.items():
                    dropped = prepare(db, rules, tmp, template, args.pg_url, pg_base)
                    for n in processes:
                        if db.startswith("sqlite"):
                            res = ceiling.measure(
                                "sqlite", n, args.seconds, sqlite_path=str(tmp / "v.sqlite3"),
                                synchronous=db.split("-")[1].upper(), shape="durable",
                                events=events)
                        else:
                            res = ceiling.measure("postgres", n, args.seconds, shape="durable",
                                                  pg_url=f"{pg_base}/durable_bench_schema",
                                                  events=events)
                        print(f"{repeat + 1} {db:13} {variant:12} p={n}: {res['tx_per_s']:7.0f} tx/s"
                              f" ({len(dropped)} indexes dropped)", file=sys.stderr)
                        results.append({"repeat": repeat, "database": db, "variant": variant,
                                        "processes": n, "dropped": dropped, **res})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if "postgres" in databases:
            import psycopg

            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                for name in ("durable_bench_schema", "durable_bench_schema_tpl"):
                    conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(render(results))


def prepare(db, rules, tmp, template, admin_url, pg_base):
    """A fresh copy of the migrated schema with the variant's indexes dropped."""
    if db.startswith("sqlite"):
        path = tmp / "v.sqlite3"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(template, path)
        names = _matching(_sqlite_indexes(path), rules)
        conn = sqlite3.connect(path)
        for name in names:
            conn.execute(f'DROP INDEX "{name}"')
        conn.commit()
        conn.close()
        return names
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS durable_bench_schema WITH (FORCE)")
        conn.execute("CREATE DATABASE durable_bench_schema TEMPLATE durable_bench_schema_tpl")
    url = f"{pg_base}/durable_bench_schema"
    names = _matching(_pg_indexes(url), rules)
    with psycopg.connect(url, autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP INDEX "{name}"')
    time.sleep(0.5)
    return names


def render(results):
    groups = {}
    for r in results:
        groups.setdefault((r["database"], r["processes"], r["variant"]), []).append(r["tx_per_s"])
    lines = ["database       P  variant       tx/s median (min-max)   vs as-migrated"]
    for (db, n, variant), values in groups.items():
        base = statistics.median(groups[(db, n, "as-migrated")])
        med = statistics.median(values)
        lines.append(f"{db:13} {n:2}  {variant:12} {med:7.0f} ({min(values):.0f}-{max(values):.0f})"
                     f"   x{med / base:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
