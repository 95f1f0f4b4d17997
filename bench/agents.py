"""Agent benchmark: what one model call's memo costs, and how long a long run takes to replay.

    python bench/agents.py                          # SQLite and PostgreSQL, 100 turns x 5 tools
    python bench/agents.py --databases sqlite --turns 50 --tools 3 --repeat 5

For each database, in a child process of its own (a fresh SQLite file in a temporary
directory, or the database ``durable_bench_agents`` created and dropped on the
PostgreSQL server at ``--pg-url``):

- **run**: one agent job of ``--turns`` turns, each a model call asking for ``--tools``
  read-only tool calls, then a final answer; the model is scripted in-process (no
  network), the tools return at once, so the time is durable's own. Each memo commit
  (the fenced job update plus the memo insert, one transaction) is timed; the figure
  is the median commit of a model call's memo and the run's wall time per call.
- **replay**: the last model memo is deleted and the job put back to pending, as if
  its worker died during the final model call; a worker claims it and replays every
  recorded call from the memos up to the frontier. The figure is claim to the first
  model call that is paid again.

With ``--budget`` every model call is reserved on a tenant's budget before it goes and
settled in its memo's transaction (``durable.store.budgets``): the difference is what a
budget costs a call.

Figures are median (min-max) over ``--repeat`` runs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(turns, tools, repeat, budget=False):
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    if budget:  # every model call reserved on a tenant's budget, settled with its memo
        settings.DURABLE = {**settings.DURABLE, "MODEL_PRICES": {"scripted": {"input": "0.1", "output": "0.4"}},
                            "BUDGETS": {"tenant:*": {"amount": "1000000", "period": "day"}}}

    call_command("migrate", verbosity=0)

    import durable
    from durable.agents import AgentWorkflow, tool
    from durable.agents import run as agent_run
    from durable.engine.runner import Runner
    from durable.models import Job, StepResult
    from durable.testing import ScriptedModel, reply, tool_call

    @tool
    def lookup(ctx, order_id: str) -> dict:
        """Look an order up."""
        return {"order_id": order_id, "status": "delivered", "amount": 250}

    script = [reply(tool_calls=[tool_call("lookup", {"order_id": f"A-{t}-{i}"}, id=f"c{t}_{i}")
                                for i in range(tools)], usage=(1000 + 50 * t, 40), cost="0.001")
              for t in range(turns)] + [reply("done", usage=(2000, 10), cost="0.001")]
    model = ScriptedModel(script)

    class BenchAgent(AgentWorkflow):
        name = "bench_agent"
        tools = [lookup]
        max_turns = turns + 10

        def get_model(self, ctx):
            return model

        def run(self, ctx, payload):
            chat = [{"role": "user", "content": "go"}]
            for turn in ctx.turns():
                answer = turn.model(chat)
                chat.append(answer.message)
                if not answer.tool_calls:
                    return {"turns": turn.number}
                chat.extend(turn.call_tools(answer))

    commits = []
    original = agent_run.AgentRun.commit

    def timed(self, key, kind, *args, **kwargs):
        began = time.perf_counter()
        try:
            return original(self, key, kind, *args, **kwargs)
        finally:
            commits.append((kind, time.perf_counter() - began))

    agent_run.AgentRun.commit = timed
    first_paid = []
    complete = model.complete

    def noted(messages, tools=None, **params):
        if not first_paid:
            first_paid.append(time.perf_counter())
        return complete(messages, tools=tools, **params)

    model.complete = noted
    runner = Runner("bench-agent", chain=False)
    out = {"run_ms_per_call": [], "model_commit_ms": [], "tool_commit_ms": [], "replay_ms": [],
           "rows": [], "calls": turns * (tools + 1) + 1}
    for index in range(repeat):
        key = f"bench-{index}"
        durable.submit("bench_agent", key, {}, budget_key="tenant:1" if budget else None)
        commits.clear()
        began = time.perf_counter()
        runner.run(runner.claim(["bench_agent"]))
        wall = time.perf_counter() - began
        assert Job.objects.get(pk=key).state == "done", Job.objects.get(pk=key).last_error
        out["run_ms_per_call"].append(wall * 1000 / out["calls"])
        out["model_commit_ms"].append(1000 * statistics.median(t for k, t in commits if k == "model"))
        out["tool_commit_ms"].append(1000 * statistics.median(t for k, t in commits if k == "tool"))
        out["rows"].append(StepResult.objects.filter(job_id=key).count())
        StepResult.objects.filter(job_id=key, step=f"t{turns + 1}/model").delete()
        Job.objects.filter(pk=key).update(state="pending", next_run_at=Job.objects.get(pk=key).updated,
                                          result=None)
        first_paid.clear()
        began = time.perf_counter()
        runner.run(runner.claim(["bench_agent"]))
        out["replay_ms"].append((first_paid[0] - began) * 1000)
        assert Job.objects.get(pk=key).state == "done"
    print(json.dumps(out))


def run_database(which, args):
    env = dict(os.environ, BENCH_DATABASE=which, DJANGO_SETTINGS_MODULE="bench.settings")
    cleanup = None
    if which == "sqlite":
        tmp = tempfile.TemporaryDirectory()
        env["BENCH_SQLITE_PATH"] = os.path.join(tmp.name, "bench.sqlite3")
        cleanup = tmp.cleanup
    else:
        import psycopg

        base = args.pg_url.rsplit("/", 1)[0]
        with psycopg.connect(args.pg_url, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS durable_bench_agents")
            conn.execute("CREATE DATABASE durable_bench_agents")
        env["BENCH_POSTGRES_URL"] = f"{base}/durable_bench_agents"

        def cleanup():
            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute("DROP DATABASE IF EXISTS durable_bench_agents")
    try:
        done = subprocess.run([sys.executable, __file__, "--child", "--turns", str(args.turns),
                               "--tools", str(args.tools), "--repeat", str(args.repeat),
                               *(["--budget"] if args.budget else [])],
                              env=env, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"{which}: the benchmark failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        cleanup()


def spread(values, digits=2):
    return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}"
            f"–{max(values):.{digits}f})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--databases", default="sqlite,postgres")
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--tools", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--pg-url", default="postgres://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--budget", action="store_true",
                   help="every model call under a tenant's budget (reserved, then settled with its memo)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.turns, args.tools, args.repeat, args.budget)
    print(f"{args.turns} turns x {args.tools} tool calls, median (min–max) of {args.repeat} runs"
          + (", every model call under a tenant's budget" if args.budget else "") + "\n")
    print("| database | memo commit, model call (ms) | memo commit, tool call (ms) |"
          " run, per call (ms) | replay of the run to its frontier (ms) | rows |")
    print("| --- | --- | --- | --- | --- | --- |")
    for which in args.databases.split(","):
        out = run_database(which, args)
        print(f"| {which} | {spread(out['model_commit_ms'])} | {spread(out['tool_commit_ms'])} |"
              f" {spread(out['run_ms_per_call'])} | {spread(out['replay_ms'], 0)} |"
              f" {out['rows'][0]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
