"""A thousand model calls in flight: agents waiting on a slow model, two worker processes.

    python bench/inflight.py --quick                     # 50 runs in flight, 0.5 s model, both databases
    python bench/inflight.py                             # 100:1, 1000:5 and 3000:10 (N in flight : latency s)
    python bench/inflight.py --sizes 200:1 --databases postgres --connections 8
    python bench/inflight.py --sizes 1000 --spread 2:10  # latency uniform in 2-10 s
    python bench/inflight.py --quick --peers             # also Procrastinate's async worker (PostgreSQL)

An agent's run spends nearly all its time waiting on the model. What durable must do is
keep N runs in flight with few processes and few database connections, and add little
between one call's reply and the next call. For each database and each N:L:

- a fake OpenAI-compatible server (``durable.testing.FakeModelServer``) in a process of
  its own, answering every completion after L seconds, so that its CPU is counted apart;
- an agent workflow of exactly three model calls and two read-only tool calls per run
  (the model asks for one tool, then another, then answers), through durable's OpenAI
  adapter (``durable.llm.OpenAIChat``, the ``openai`` client) at the fake server;
- ``--runs-per-slot`` x N runs (default 3) submitted, then drained by ``runworkers
  --burst --processes 2 --threads ceil(N/2)``, so N runs are in flight until the queue
  is empty; on a fresh SQLite file, or the database ``durable_bench_inflight`` created
  and dropped on ``--pg-url``.

Model calls/s is counted from the fake server's own request log, over the steady window:
from the moment the N-th run made its first call (the fleet is full) to the moment the
last run made its first call (the queue is empty; the fleet shrinks after). The bound
is N / L: each run in flight has at most one model call outstanding. Every 0.2 s the
bench samples the workers' process tree (CPU ticks in /proc/<pid>/stat, VmRSS of each
worker process), the fake server's CPU, and on PostgreSQL the connections to the
benchmark database (pg_stat_activity). CPU per model call is the CPU spent over the
steady window divided by the calls that arrived in it, so neither start-up nor the
ramp is counted. "Between calls" is, per run, the time from a model reply leaving the
server to the same run's next model request arriving: the model call's memo, the tool
call and its memo, as seen from outside. The memo commit's own latency is not measured
here (bench/agents.py times each commit of one run).

``--peers`` adds Procrastinate's async worker (PostgreSQL only) at the same concurrency
(two worker processes of ceil(N/2) concurrent jobs each), on the same server, for the
same shape of work: one job per run making the same three model calls, through the
``openai`` package's async client, to a fake server with the same latency (its tools
return at once and it records nothing between calls: it is the floor of a queue that
keeps no memo). It runs in a virtualenv of its own, ``bench/.venv-procrastinate``,
made on first use; when that cannot be made, the table says so and the bench goes on.
"""

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.phase import rss_kb  # noqa: E402 - after the path that finds it

AGENT = "bench_inflight_agent"
PG_DATABASE = "durable_bench_inflight"
PEER_VENV = ROOT / "bench" / ".venv-procrastinate"
PEER_REQUIREMENTS = ["procrastinate>=3,<4", "openai>=1.40,<4", "psycopg[binary,pool]>=3.1,<4"]
MODEL_CALLS_PER_RUN = 3
TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_EVERY = 0.2


def replies():
    """The model's side of one run, by turn: a tool, another tool, then the answer."""
    from durable.testing import reply, tool_call

    return [
        reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-1"})], usage=(800, 20)),
        reply(tool_calls=[tool_call("lookup_customer", {"customer_id": "C-1"})], usage=(900, 20)),
        reply("The refund is on its way.", usage=(1000, 15)),
    ]


# Child processes ------------------------------------------------------------------------

def _setup():
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()


def register_agent():
    """Define the benchmark's agent in this process (runworkers' children are forked from it)."""
    from durable.agents import AgentWorkflow, tool
    from durable.llm import OpenAIChat

    high = float(os.environ.get("BENCH_MODEL_LATENCY_HIGH", "1"))

    @tool
    def lookup_order(ctx, order_id: str) -> dict:
        """Look an order up by its id."""
        return {"order_id": order_id, "amount": 250, "status": "delivered"}

    @tool
    def lookup_customer(ctx, customer_id: str) -> dict:
        """Look a customer up by their id."""
        return {"customer_id": customer_id, "tier": "gold"}

    class InflightAgent(AgentWorkflow):
        name = AGENT
        # One adapter per process, as the README says; a reply slower than the latency
        # times out well before a test of patience does.
        model = OpenAIChat("fake-model", base_url=os.environ.get("BENCH_MODEL_URL"), api_key="bench",
                           timeout=max(60.0, 4 * high), prices={})
        tools = [lookup_order, lookup_customer]
        max_turns = 5
        call_timeout = max(30.0, 4 * high)

        def run(self, ctx, payload):
            chat = [{"role": "user", "content": payload["message"]}]
            for turn in ctx.turns():
                answer = turn.model(chat)
                chat.append(answer.message)
                if not answer.tool_calls:
                    return {"answer": answer.text}
                chat.extend(turn.call_tools(answer))

    return InflightAgent


def child_submit(runs):
    """Migrate the fresh database and submit ``runs`` runs in one transaction."""
    _setup()
    from django.core.management import call_command
    from django.db import transaction

    import durable

    register_agent()
    call_command("migrate", verbosity=0)
    with transaction.atomic():
        for index in range(runs):
            # The run's key is in its first message, so the server's log tells runs apart.
            durable.submit(AGENT, f"run-{index:06d}", {"message": f"Where is the refund of run-{index:06d}?"})
    print(json.dumps({"submitted": runs}))


def child_workers(argv):
    """``manage.py runworkers ARGV`` with the benchmark's agent registered before the fork."""
    _setup()
    from django.core.management import execute_from_command_line

    register_agent()
    record_memo_commits(os.environ.get("BENCH_COMMITS_LOG"))
    execute_from_command_line([str(ROOT / "manage.py"), "runworkers", *argv])


def record_memo_commits(path):
    """Append every group commit of the worker processes to ``path``, one JSON line each.

    Connected before the fork, so every worker process inherits it (``durable.signals.
    memos_committed``: rows, seconds of the transaction, how long each row waited from
    its hand-over to its answer). A line: [time, rows, seconds, [waited...]].
    """
    if not path:
        return
    from durable.signals import memos_committed

    lock = threading.Lock()

    def write(sender, rows, seconds, refused, waited, **kwargs):
        line = json.dumps([time.time(), rows, seconds, waited]) + "\n"
        with lock, open(path, "a") as f:
            f.write(line)

    memos_committed.connect(write, weak=False)


def memo_commit_figures(path, start=None, end=None):
    """Memo commits inside the window: each run's wait (p50, p99) and the transaction per memo."""
    if not path or not Path(path).exists():
        return {}
    waited, per_row, groups = [], [], []
    for line in Path(path).read_text().splitlines():
        at, rows, seconds, waits = json.loads(line)
        if (start is not None and at < start) or (end is not None and at > end):
            continue
        waited += [w * 1000 for w in waits]
        per_row += [seconds * 1000 / rows] * rows  # every memo of a group shares its transaction
        groups.append(rows)
    return {"commit_wait_p50_ms": percentile(waited, 50), "commit_wait_p99_ms": percentile(waited, 99),
            "commit_amortised_p50_ms": percentile(per_row, 50), "commit_groups": len(groups),
            "commit_rows_per_group": sum(groups) / len(groups) if groups else None}


def child_report():
    """How the runs ended and what the workers wrote, as JSON."""
    _setup()
    from django.db.models import Count

    from durable.models import Job, StepResult

    register_agent()
    jobs = Job.objects.filter(workflow=AGENT)
    states = dict(jobs.values_list("state").annotate(n=Count("pk")))
    errors = list(jobs.exclude(state="done").exclude(last_error="").values_list("last_error", flat=True)[:3])
    memos = StepResult.objects.filter(job__workflow=AGENT).count()
    print(json.dumps({"states": states, "errors": errors, "memos": memos}))


def child_serve(low, high, log_path):
    """The fake model server until SIGTERM; then its request log goes to ``log_path``."""
    sys.path.insert(0, str(ROOT))
    from durable.testing import FakeModelServer

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    with FakeModelServer(replies(), latency=(low, high)) as server:
        print(server.url, flush=True)
        stopping.wait()
        calls = list(server.calls)
    rows = [[c.at, c.answered, c.turn, c.outcome, (c.body.get("messages") or [{}])[0].get("content")]
            for c in calls]
    Path(log_path).write_text(json.dumps(rows))


# Watching the processes ---------------------------------------------------------------

def _cpu_ticks(pid):
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime


def _children(pid):
    kids = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        pass
    return kids


class Sampler(threading.Thread):
    """Every 0.2 s: CPU of the workers' tree and of the server, RSS per worker, DB connections."""

    def __init__(self, workers_pid, server_pid, pg_url=None, database=None):
        super().__init__(daemon=True)
        self.workers_pid, self.server_pid = workers_pid, server_pid
        self.pg_url, self.database = pg_url, database
        self.samples = []  # (time, worker CPU s, server CPU s, connections or None)
        self.peak_rss_kb = {}  # worker process -> peak VmRSS
        self.last_ticks = {}  # every process of the tree seen, so an exited one still counts
        self._done = threading.Event()

    def run(self):
        conn = None
        if self.pg_url:
            import psycopg

            # A connection to another database of the server, so it does not count itself.
            conn = psycopg.connect(self.pg_url, autocommit=True)
        try:
            while not self._done.is_set():
                now = time.time()
                workers = _children(self.workers_pid)
                for pid in [self.workers_pid, *workers, *(g for w in workers for g in _children(w))]:
                    ticks = _cpu_ticks(pid)
                    if ticks is not None:
                        self.last_ticks[pid] = ticks
                for pid in workers:
                    rss = rss_kb(pid)
                    if rss:
                        self.peak_rss_kb[pid] = max(rss, self.peak_rss_kb.get(pid, 0))
                connections = None
                if conn is not None:
                    connections = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                                               [self.database]).fetchone()[0]
                server = _cpu_ticks(self.server_pid)
                self.samples.append((now, sum(self.last_ticks.values()) / TICKS,
                                     None if server is None else server / TICKS, connections))
                self._done.wait(SAMPLE_EVERY)
        finally:
            if conn is not None:
                conn.close()

    def stop(self):
        self._done.set()
        self.join()


# One configuration ----------------------------------------------------------------------

class ModelServerProcess:
    """The fake model server in a child process: its URL, its pid, its request log."""

    def __init__(self, low, high, log_path, python=sys.executable):
        self.log_path = Path(log_path)
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__)), "--role", "serve", "--latency-low", str(low),
             "--latency-high", str(high), "--server-log", str(self.log_path)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url:
            self.proc.kill()
            raise RuntimeError("the fake model server did not start")

    def kill(self):
        """End it at once if it still runs (a measurement that failed half way)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        """Stop it; its request log as rows (at, answered, turn, outcome, run) and its CPU seconds."""
        self.proc.send_signal(signal.SIGTERM)
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.proc.stdout.close()
        return json.loads(self.log_path.read_text()), usage.ru_utime + usage.ru_stime


class Configuration:
    """One database, one N and one latency: a fresh database, the server, the drain, the figures."""

    def __init__(self, args, tmp, database, size, low, high):
        self.args, self.tmp, self.database = args, Path(tmp), database
        self.size, self.low, self.high = size, low, high
        self.threads = math.ceil(size / 2)
        self.fleet = 2 * self.threads
        self.runs = args.runs_per_slot * self.fleet
        self.latency = (low + high) / 2

    def env(self):
        env = dict(os.environ, DJANGO_SETTINGS_MODULE="bench.settings", BENCH_DATABASE=self.database,
                   BENCH_LOG_LEVEL=self.args.log_level, PYTHONUNBUFFERED="1",
                   BENCH_MODEL_LATENCY_HIGH=str(self.high))
        if self.database == "sqlite":
            env["BENCH_SQLITE_PATH"] = str(self.tmp / "inflight.sqlite3")
        else:
            env["BENCH_POSTGRES_URL"] = f"{self.args.pg_url.rsplit('/', 1)[0]}/{PG_DATABASE}"
        return env

    def fresh(self):
        if self.database == "sqlite":
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.tmp / 'inflight.sqlite3'}{suffix}").unlink(missing_ok=True)
        else:
            drop_database(self.args.pg_url)
            import psycopg

            with psycopg.connect(self.args.pg_url, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{PG_DATABASE}"')

    def child(self, env, *argv):
        done = subprocess.run([sys.executable, str(Path(__file__)), *argv], env=env, cwd=ROOT,
                              capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def measure(self):
        self.fresh()
        env = self.env()
        env["BENCH_COMMITS_LOG"] = str(self.tmp / f"commits-{self.database}-{self.size}.jsonl")
        Path(env["BENCH_COMMITS_LOG"]).unlink(missing_ok=True)
        server = None
        try:
            self.child(env, "--role", "submit", "--runs", str(self.runs))
            server = ModelServerProcess(self.low, self.high, self.tmp / f"model-calls-{self.database}-{self.size}.json")
            env["BENCH_MODEL_URL"] = server.url
            command = ["--processes", "2", "--threads", str(self.threads), "--burst", "--no-dispatcher"]
            if self.args.connections:
                command += ["--connections", str(self.args.connections)]
            log_path = self.tmp / f"workers-{self.database}-{self.size}.log"
            with open(log_path, "wb") as log:
                began = time.time()
                workers = subprocess.Popen([sys.executable, str(Path(__file__)), "--role", "workers", "--",
                                            *command], cwd=ROOT, env=env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                sampler = Sampler(workers.pid, server.proc.pid,
                                  self.args.pg_url if self.database == "postgres" else None, PG_DATABASE)
                sampler.start()
                code, usage = wait_tree(workers, self.timeout())
                wall = time.time() - began
                sampler.stop()
            calls, server_cpu = server.stop()
            report = self.child(env, "--role", "report")
        finally:
            if server is not None:
                server.kill()
            if self.database == "postgres":
                drop_database(self.args.pg_url)
        figures = self.figures(calls, sampler)
        figures.update(memo_commit_figures(env["BENCH_COMMITS_LOG"], figures.get("window_start"),
                                           figures.get("window_end")))
        lines = log_path.read_text(errors="replace").splitlines()
        problems = [line for line in lines if "ERROR" in line or "Traceback" in line or "WARNING" in line]
        figures.update({
            "exit_code": code, "wall_s": wall, "states": report["states"], "job_errors": report["errors"],
            "memos": report["memos"], "log": str(log_path), "log_problems": len(problems),
            "log_problem_lines": problems[:5],
            "worker_cpu_ms_per_call_total": 1000 * (usage.ru_utime + usage.ru_stime) / max(1, len(calls)),
            "server_cpu_ms_per_call_total": 1000 * server_cpu / max(1, len(calls)),
        })
        return figures

    def timeout(self):
        # Each slot runs runs_per_slot runs of three calls; allow four times that, plus start-up.
        return 120 + 4 * self.args.runs_per_slot * MODEL_CALLS_PER_RUN * self.high

    def figures(self, calls, sampler):
        return window_figures(calls, sampler.samples, self.fleet, self.latency, peak_rss_kb=sampler.peak_rss_kb)


def window_figures(calls, samples, fleet, latency, peak_rss_kb=None):
    """Model calls/s and CPU per call over the steady window, from the server's log and the samples."""
    ok = [c for c in calls if c[3] == "ok"]
    firsts = sorted(c[0] for c in ok if c[2] == 0)
    asked = {(c[4], c[2]) for c in ok}
    out = {"fleet": fleet, "latency": latency, "bound": fleet / latency, "calls": len(calls),
           "paid_again": len(ok) - len(asked),  # the same run asked the same turn again
           "runs_seen": len({c[4] for c in ok}), "not_ok": len(calls) - len(ok),
           "peak_rss_mb": sorted((kb / 1024 for kb in (peak_rss_kb or {}).values()), reverse=True),
           "peak_connections": max((s[3] for s in samples if s[3] is not None), default=None)}
    if len(firsts) <= fleet:
        out["error"] = f"no steady window: {len(firsts)} runs started, the fleet is {fleet}"
        return out
    # From the moment the fleet is full to the moment the queue is empty, on sample times.
    start, end = firsts[fleet - 1], firsts[-1]
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        out["error"] = "the steady window is shorter than two samples"
        return out
    first, last = inside[0], inside[-1]
    seconds = last[0] - first[0]
    count = sum(1 for c in ok if first[0] <= c[0] < last[0])
    outstanding = sum(max(0.0, min(c[1] or last[0], last[0]) - max(c[0], first[0])) for c in ok)
    gaps, durations = [], []
    by_run = {}
    for c in ok:
        by_run.setdefault(c[4], []).append(c)
    for run_calls in by_run.values():
        run_calls.sort(key=lambda c: c[2])
        gaps += [(b[0] - a[1]) * 1000 for a, b in zip(run_calls, run_calls[1:], strict=False) if a[1]]
        if len(run_calls) == MODEL_CALLS_PER_RUN and run_calls[-1][1]:
            durations.append(run_calls[-1][1] - run_calls[0][0])
    out.update({
        "window_start": first[0], "window_end": last[0],
        "window_s": seconds, "window_calls": count, "calls_per_s": count / seconds,
        "ratio": count / seconds / (fleet / latency), "outstanding": outstanding / seconds,
        "gap_p50_ms": percentile(gaps, 50), "gap_p99_ms": percentile(gaps, 99),
        "run_p50_s": percentile(durations, 50),
        "worker_cpu_ms_per_call": 1000 * (last[1] - first[1]) / max(1, count),
        "server_cpu_ms_per_call": (1000 * (last[2] - first[2]) / max(1, count)
                                   if last[2] is not None and first[2] is not None else None),
    })
    return out


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def wait_tree(proc, timeout):
    """Reap ``proc``: (exit code, rusage of it and every descendant it reaped); kill it past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage


def drop_database(pg_url):
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{PG_DATABASE}" WITH (FORCE)')


# The peer: Procrastinate's async worker ----------------------------------------------------

PEER_APP = '''
import os

import openai
from procrastinate import App, PsycopgConnector

try:  # the HTTP library the openai client is built on (newer releases: httpx2)
    import httpx2 as httpx
except ImportError:
    import httpx

app = App(connector=PsycopgConnector(conninfo=os.environ["PEER_CONNINFO"]))
_client = None


def client():
    global _client
    if _client is None:  # one client per worker process, its pool as wide as its concurrency
        width = int(os.environ["PEER_CONCURRENCY"]) + 10
        _client = openai.AsyncOpenAI(
            base_url=os.environ["BENCH_MODEL_URL"], api_key="bench", max_retries=0, timeout=120,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=width,
                                                                           max_keepalive_connections=width)))
    return _client


@app.task(name="agent_run")
async def agent_run(run):
    chat = [{"role": "user", "content": f"Where is the refund of {run}?"}]
    for _ in range(3):
        reply = await client().chat.completions.create(model="fake-model", messages=chat)
        message = reply.choices[0].message
        chat.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():  # the read-only tools answer at once
            chat.append({"role": "tool", "tool_call_id": call.id, "content": "{}"})
'''

PEER_MAIN = '''
import asyncio, json, os, sys
sys.path.insert(0, os.environ["PEER_DIR"])
from peer_app import app

role = sys.argv[1]
if role == "setup":
    async def setup():
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            runs = int(sys.argv[2])
            for start in range(0, runs, 500):
                await app.tasks["agent_run"].batch_defer_async(
                    *({"run": f"run-{i:06d}"} for i in range(start, min(runs, start + 500))))
    asyncio.run(setup())
elif role == "worker":
    async def work():
        async with app.open_async():
            await app.run_worker_async(concurrency=int(os.environ["PEER_CONCURRENCY"]), wait=False,
                                       install_signal_handlers=False)
    asyncio.run(work())
elif role == "report":
    import psycopg
    with psycopg.connect(os.environ["PEER_CONNINFO"]) as conn:
        rows = conn.execute("SELECT status, count(*) FROM procrastinate_jobs GROUP BY status").fetchall()
    print(json.dumps({str(status): n for status, n in rows}))
'''


def peer_python():
    """The peer's virtualenv's interpreter, made on first use; None (and why) when it cannot be made."""
    python = PEER_VENV / "bin" / "python"
    stamp = PEER_VENV / f".installed-{hashlib.sha256(chr(10).join(PEER_REQUIREMENTS).encode()).hexdigest()[:16]}"
    if stamp.exists():
        return python, None
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True, capture_output=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        *PEER_REQUIREMENTS], check=True, capture_output=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"its virtualenv could not be made ({type(exc).__name__})"
    for old in PEER_VENV.glob(".installed-*"):
        old.unlink()
    stamp.touch()
    return python, None


class PeerConfiguration(Configuration):
    """The same N, latency and runs through Procrastinate's async worker (PostgreSQL only)."""

    def measure(self, python):
        self.fresh()
        peer_dir = self.tmp / "peer"
        peer_dir.mkdir(exist_ok=True)
        (peer_dir / "peer_app.py").write_text(PEER_APP)
        (peer_dir / "peer_main.py").write_text(PEER_MAIN)
        conninfo = f"{self.args.pg_url.rsplit('/', 1)[0]}/{PG_DATABASE}"
        env = dict(os.environ, PEER_DIR=str(peer_dir), PEER_CONNINFO=conninfo, PEER_CONCURRENCY=str(self.threads),
                   PYTHONUNBUFFERED="1")
        main = [str(python), str(peer_dir / "peer_main.py")]
        server = None
        try:
            done = subprocess.run([*main, "setup", str(self.runs)], env=env, capture_output=True, text=True,
                                  timeout=300, check=False)
            if done.returncode:
                raise RuntimeError(f"the peer's setup failed:\n{done.stderr[-3000:]}")
            server = ModelServerProcess(self.low, self.high, self.tmp / f"model-calls-peer-{self.size}.json")
            env["BENCH_MODEL_URL"] = server.url
            log_path = self.tmp / f"peer-{self.size}.log"
            with open(log_path, "wb") as log:
                began = time.time()
                # A parent that only starts the two worker processes and waits, so that one
                # tree is sampled and reaped, as for runworkers.
                starter = ("import subprocess, sys; ps = [subprocess.Popen(sys.argv[1:]) for _ in range(2)];"
                           " sys.exit(max(p.wait() for p in ps))")
                workers = subprocess.Popen([str(python), "-c", starter, *main, "worker"], cwd=peer_dir, env=env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                sampler = Sampler(workers.pid, server.proc.pid, self.args.pg_url, PG_DATABASE)
                sampler.start()
                code, usage = wait_tree(workers, self.timeout())
                wall = time.time() - began
                sampler.stop()
            calls, server_cpu = server.stop()
            done = subprocess.run([*main, "report"], env=env, check=True, capture_output=True, text=True)
            states = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            if server is not None:
                server.kill()
            drop_database(self.args.pg_url)
        figures = self.figures(calls, sampler)
        lines = log_path.read_text(errors="replace").splitlines()
        problems = [line for line in lines if "ERROR" in line or "Traceback" in line]
        figures.update({
            "exit_code": code, "wall_s": wall, "states": states, "log": str(log_path),
            "log_problems": len(problems), "log_problem_lines": problems[:5],
            "worker_cpu_ms_per_call_total": 1000 * (usage.ru_utime + usage.ru_stime) / max(1, len(calls)),
            "server_cpu_ms_per_call_total": 1000 * server_cpu / max(1, len(calls)),
        })
        return figures


# The table ------------------------------------------------------------------------------

def parse_sizes(text):
    sizes = []
    for item in text.split(","):
        size, _, latency = item.partition(":")
        sizes.append((int(size), float(latency) if latency else None))
    return sizes


def _fmt(value, digits=1, unit=""):
    return "n/a" if value is None else f"{value:,.{digits}f}{unit}"


def row(system, database, figures):
    if "error" in figures:
        return (f"| {system} | {database} | {figures['fleet']} | {figures['latency']:g} | {figures['error']} |"
                + " |" * 11)
    rss = ", ".join(f"{mb:.0f}" for mb in figures["peak_rss_mb"]) or "n/a"
    done = figures["states"].get("done", figures["states"].get("succeeded", 0))
    return (f"| {system} | {database} | {figures['fleet']} | {figures['latency']:g} |"
            f" {_fmt(figures['calls_per_s'])} | {_fmt(figures['bound'])} | {_fmt(figures['ratio'], 2)} |"
            f" {_fmt(figures['outstanding'], 0)} |"
            f" {_fmt(figures['gap_p50_ms'], 0)} / {_fmt(figures['gap_p99_ms'], 0)} |"
            f" {_fmt(figures['peak_connections'], 0) if database == 'postgres' else 'n/a'} | {rss} |"
            f" {_fmt(figures['worker_cpu_ms_per_call'], 2)} | {_fmt(figures['server_cpu_ms_per_call'], 2)} |"
            f" {_fmt(figures.get('commit_wait_p50_ms'), 1)} / {_fmt(figures.get('commit_wait_p99_ms'), 1)}"
            f" / {_fmt(figures.get('commit_amortised_p50_ms'), 2)} |"
            f" {done} / {sum(figures['states'].values())} | {figures['log_problems']} |")


HEADER = ("| system | database | N in flight | latency (s) | model calls/s | bound N/L | achieved/bound |"
          " calls outstanding | between calls p50 / p99 (ms) | peak DB connections | peak RSS per worker (MB) |"
          " worker CPU ms/call | server CPU ms/call | memo commit wait p50 / p99 / amortised p50 (ms) |"
          " runs done | log warnings and errors |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("100:1,1000:5,3000:10"),
                   help="N:L pairs: runs in flight and the model's latency in seconds")
    p.add_argument("--spread", help="LOW:HIGH: every size's latency uniform in LOW-HIGH seconds instead")
    p.add_argument("--databases", default="sqlite,postgres")
    p.add_argument("--connections", type=int, help="passed to runworkers --connections (else its default)")
    p.add_argument("--runs-per-slot", type=int, default=3, help="runs submitted per run in flight")
    p.add_argument("--quick", action="store_true", help="a smoke run: 50 in flight, 0.5 s")
    p.add_argument("--peers", action="store_true", help="also Procrastinate's async worker, on PostgreSQL")
    p.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--log-level", default="INFO", help="the workers' log level (BENCH_LOG_LEVEL)")
    p.add_argument("--json", help="also write every figure to this file")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, help=argparse.SUPPRESS)
    p.add_argument("--latency-low", type=float, help=argparse.SUPPRESS)
    p.add_argument("--latency-high", type=float, help=argparse.SUPPRESS)
    p.add_argument("--server-log", help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "serve":
        return child_serve(args.latency_low, args.latency_high, args.server_log)
    if args.role == "submit":
        return child_submit(args.runs)
    if args.role == "workers":
        return child_workers([a for a in args.rest if a != "--"])
    if args.role == "report":
        return child_report()

    sizes = [(50, 0.5)] if args.quick else args.sizes
    spread = tuple(float(v) for v in args.spread.split(":")) if args.spread else None
    print(f"python bench/inflight.py {shlex.join(sys.argv[1:] if argv is None else argv)}\n")
    tmp = Path(tempfile.mkdtemp(prefix="durable-inflight-"))
    results = []
    print(HEADER, flush=True)
    peer_note = None
    try:
        for size, latency in sizes:
            if spread is None and latency is None:
                raise SystemExit(f"--sizes {size} needs a latency (N:L), or give --spread")
            low, high = spread or (latency, latency)
            measures = [("durable", database, Configuration(args, tmp, database, size, low, high).measure)
                        for database in args.databases.split(",")]
            if args.peers:
                python, peer_note = peer_python()
                if python is not None:
                    peer = PeerConfiguration(args, tmp, "postgres", size, low, high)
                    measures.append(("procrastinate", "postgres", lambda peer=peer, python=python:
                                     peer.measure(python)))
            for system, database, measure in measures:
                try:
                    figures = measure()
                except Exception as exc:  # one failed configuration must not lose the others
                    figures = {"fleet": 2 * math.ceil(size / 2), "latency": (low + high) / 2,
                               "error": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                               "detail": str(exc)}
                results.append({"system": system, "database": database, **figures})
                print(row(system, database, figures), flush=True)
    finally:
        if args.keep:
            print(f"\nLogs and the model server's request logs are kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    latency_text = f"uniform {spread[0]:g}-{spread[1]:g} s (mean shown)" if spread else "fixed"
    print(f"\nLatency {latency_text}; two worker processes of ceil(N/2) threads;"
          f" {args.runs_per_slot} runs per run in flight; figures over the steady window.")
    if args.peers and peer_note:
        print(f"Procrastinate was not measured: {peer_note}.")
    for result in results:
        label = f"{result['system']} on {result['database']}, N={result['fleet']}"
        if result.get("detail"):
            print(f"- {label}: {result['detail'][-2000:]}")
        if result.get("exit_code"):
            print(f"- {label}: the workers exited {result['exit_code']}")
        if result.get("paid_again"):
            print(f"- {label}: {result['paid_again']} model calls paid more than once")
        if result.get("not_ok"):
            print(f"- {label}: {result['not_ok']} requests the server did not answer as a completion")
        for line in result.get("log_problem_lines", []):
            print(f"- {label}, log: {line[:300]}")
        for error in result.get("job_errors", []):
            print(f"- {label}, a run's last error: {error[:300]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
