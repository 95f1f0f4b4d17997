"""A fleet under a provider's limit: how near its rate four worker processes run, how often refused.

    python bench/limits.py                                # 1,000 runs at 600 requests/min, both databases
    python bench/limits.py --runs 300 --rpm 1200 --window 6 --databases postgres
    python bench/limits.py --tpm 60000                    # tokens bind instead of requests

A fake OpenAI-compatible server (``durable.testing.FakeModelServer``, a process of its
own) enforces a provider's limits for one API key: ``--rpm`` requests and ``--tpm``
tokens per minute, counted in a sliding window of ``--window`` seconds (60: a minute),
and answers 429 with ``Retry-After`` beyond them, as OpenAI does. The same limits are
declared in ``DURABLE["LIMITS"]``. ``--runs`` agents, each of three model calls and two
read-only tool calls (bench/inflight.py's agent, its model answering after ``--latency``
seconds), are submitted at once and drained by ``runworkers --processes 4``: far more
demand than the limit allows, so every run spends most of its life throttled.

Achieved rate is counted from the server's own log: calls it accepted per second over
the steady window, from the first accepted call plus ``--ramp`` seconds to the last
one, against the rate the server allows (``--rpm`` / 60; with ``--tpm``, the tokens it
counted per second against ``--tpm`` / 60). Refused is the share of requests it
answered 429. The fleet paces at the declared rate less its headroom (3 %), so 0.97x is
the most it aims for.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import inflight  # noqa: E402 - after the path that finds it

PG_DATABASE = inflight.PG_DATABASE


def child_serve(args):
    """The fake model server with the provider's limits until SIGTERM; its log then goes to a file."""
    from durable.testing import FakeModelServer, ProviderLimits

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    limits = ProviderLimits(requests_per_minute=args.rpm, tokens_per_minute=args.tpm, window=args.window)
    with FakeModelServer(inflight.replies(), latency=args.latency, limits=limits) as server:
        print(server.url, flush=True)
        stopping.wait()
        calls = list(server.calls)
        peaks = server.window_peaks()
    rows = [[c.at, c.outcome, getattr(c, "tokens", 0)] for c in calls]
    Path(args.server_log).write_text(json.dumps({"calls": rows, "peaks": peaks}))


def declared(args):
    limit = {"models": ["fake-model"], "requests_per_minute": args.rpm, "window": args.window}
    if args.tpm:
        limit["tokens_per_minute"] = args.tpm
    return {"LIMITS": {"provider": limit}}


def report_states(env):
    done = subprocess.run([sys.executable, __file__, "--role", "report"], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def one(database, args, workdir):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings", "BENCH_DATABASE": database,
           "BENCH_DURABLE": json.dumps(declared(args)), "BENCH_LOG_LEVEL": "WARNING"}
    if database == "sqlite":
        env["BENCH_SQLITE_PATH"] = str(workdir / f"limits-{time.time_ns()}.sqlite3")
    else:
        inflight.drop_database(args.pg_url)
        import psycopg

        with psycopg.connect(args.pg_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{PG_DATABASE}"')
        env["BENCH_POSTGRES_URL"] = args.pg_url.rsplit("/", 1)[0] + "/" + PG_DATABASE
    log = workdir / f"server-{database}.json"
    server = subprocess.Popen([sys.executable, __file__, "--role", "serve", "--server-log", str(log),
                               *_limit_args(args)], stdout=subprocess.PIPE, text=True, env=env)
    url = server.stdout.readline().strip()
    env["BENCH_MODEL_URL"] = url
    env["BENCH_MODEL_LATENCY_HIGH"] = str(args.latency)
    subprocess.run([sys.executable, str(ROOT / "bench" / "inflight.py"), "--role", "submit", "--runs",
                    str(args.runs)], env=env, check=True, capture_output=True, timeout=600)
    began = time.monotonic()
    workers = subprocess.Popen([sys.executable, str(ROOT / "bench" / "inflight.py"), "--role", "workers", "--",
                                "--no-dispatcher", "--processes", "4", "--threads", str(args.threads),
                                "--connections", str(args.connections)],
                               env=env, stdout=open(workdir / f"workers-{database}.log", "w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            time.sleep(2)
            if workers.poll() is not None:
                raise RuntimeError(f"runworkers exited ({workers.returncode}): see {workdir}/workers-{database}.log")
            states = report_states(env)["states"]
            if states.get("done", 0) == args.runs or time.monotonic() - began > args.timeout:
                break
    finally:
        os.kill(workers.pid, signal.SIGTERM)
        workers.wait(60)
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        if database == "postgres":
            inflight.drop_database(args.pg_url)
    kept = json.loads(log.read_text())
    return figures(kept["calls"], kept["peaks"], states, args)


def _limit_args(args):
    out = ["--rpm", str(args.rpm), "--window", str(args.window), "--latency", str(args.latency)]
    return out + (["--tpm", str(args.tpm)] if args.tpm else [])


def figures(calls, peaks, states, args):
    accepted = sorted((at, tokens) for at, outcome, tokens in calls if outcome != "rate_limited")
    refused = sum(1 for _, outcome, _ in calls if outcome == "rate_limited")
    start, end = accepted[0][0] + args.ramp, accepted[-1][0]
    steady = [(at, tokens) for at, tokens in accepted if start <= at <= end]
    seconds = max(end - start, 1e-9)
    rate = (len(steady) - 1) / seconds
    token_rate = sum(tokens for _, tokens in steady) / seconds
    out = {"runs": args.runs, "done": states.get("done", 0), "accepted": len(accepted), "refused": refused,
           "refused_share": refused / max(1, len(calls)), "rate": rate, "allowed": args.rpm / 60,
           "rate_x": rate / (args.rpm / 60), "seconds": accepted[-1][0] - accepted[0][0], "peaks": peaks}
    if args.tpm:
        out.update(token_rate=token_rate, token_allowed=args.tpm / 60, token_x=token_rate / (args.tpm / 60))
    return out


def child_report():
    inflight._setup()
    from django.db.models import Count

    from durable.models import Job

    inflight.register_agent()
    states = dict(Job.objects.filter(workflow=inflight.AGENT).values_list("state").annotate(n=Count("pk")))
    print(json.dumps({"states": states}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--rpm", type=float, default=600)
    p.add_argument("--tpm", type=float, default=None, help="also a token limit (tokens per minute)")
    p.add_argument("--window", type=float, default=60.0, help="the server's sliding window, seconds")
    p.add_argument("--latency", type=float, default=1.0, help="seconds the model takes to answer")
    p.add_argument("--threads", type=int, default=50, help="runworkers --threads, per process (4 processes)")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--ramp", type=float, default=5.0, help="seconds at the start left out of the rate")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--databases", default="sqlite,postgres")
    p.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--server-log", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "serve":
        return child_serve(args)
    if args.role == "report":
        return child_report()
    results = {}
    with tempfile.TemporaryDirectory(prefix="durable-bench-limits-") as tmp:
        for database in args.databases.split(","):
            results[database] = one(database, args, Path(tmp))
            r = results[database]
            line = (f"{database}: {r['accepted']} calls in {r['seconds']:.0f} s; {r['rate']:.2f}/s of "
                    f"{r['allowed']:.2f}/s allowed ({r['rate_x']:.3f}x) over the steady window; "
                    f"{r['refused']} refused ({100 * r['refused_share']:.2f} %); {r['done']}/{r['runs']} runs done;"
                    f" peaks in a window {r['peaks']}")
            if args.tpm:
                line += f"; tokens {r['token_rate']:.0f}/s of {r['token_allowed']:.0f}/s ({r['token_x']:.3f}x)"
            print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
