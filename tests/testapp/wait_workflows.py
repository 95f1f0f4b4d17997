"""Workflows that wait on signals and on child jobs."""

import time

from durable import TIMED_OUT, Workflow, step

from .workflows import record


class Confirm(Workflow):
    """Waits for one signal ``confirmed`` (or ``payload["timeout"]`` seconds), then finishes."""

    name = "confirm"

    @step(signals=True)
    def ask(self, payload, ctx):
        record(payload, f"{ctx.job_id} ask")
        got = ctx.wait_for("confirmed", timeout=payload.get("timeout"))
        record(payload, f"{ctx.job_id} got {'timeout' if got is TIMED_OUT else 'signal'}")
        return {"timed_out": True} if got is TIMED_OUT else {"signal": got}

    @step
    def finish(self, data, ctx):
        return data


class Turns(Workflow):
    """Reads ``payload["n"]`` signals ``reply`` in a row, one wait each."""

    name = "turns"

    @step(signals=True)
    def talk(self, payload, ctx):
        return {"replies": [ctx.wait_for("reply") for _ in range(payload["n"])]}


class Child(Workflow):
    """A child job: returns its payload, sleeps ``sleep`` seconds, or fails when asked."""

    name = "child"

    @step(retry=None)
    def work(self, payload, ctx):
        if payload.get("sleep"):
            time.sleep(payload["sleep"])
        if payload.get("fail"):
            raise ValueError("asked to fail")
        if payload.get("wait_file"):
            from pathlib import Path

            while not Path(payload["wait_file"]).exists():
                time.sleep(0.005)
        return {"n": payload.get("n")}


class Parent(Workflow):
    """Spawns ``payload["children"]`` children of ``child`` and joins them."""

    name = "parent"

    @step(joins=True)
    def fan_out(self, payload, ctx):
        record(payload, f"{ctx.job_id} fan_out")
        kids = ctx.spawn_many("child", {
            f"{i:04d}": {"n": i, **payload.get("child", {})} for i in range(payload["children"])
        })
        outcomes = ctx.join(kids, timeout=payload.get("timeout"))
        return {"outcomes": {k: v["outcome"] for k, v in outcomes.items()},
                "sum": sum((v.get("result") or {}).get("n", 0) for v in outcomes.values())}


class NotDeclared(Workflow):
    """Waits without declaring it: refused clearly."""

    name = "not_declared"

    @step
    def ask(self, payload, ctx):
        return ctx.wait_for("x")


class SubsetParent(Workflow):
    """Spawns children a, b and c, and joins only a and b."""

    name = "subset_parent"

    @step(joins=True)
    def fan_out(self, payload, ctx):
        first = ctx.spawn_many("child", {"a": {"n": 1}, "b": {"n": 2}})
        ctx.spawn("child", "c", {"n": 3})
        return {k: v["outcome"] for k, v in ctx.join(first).items()}


from durable.agents import AgentWorkflow  # noqa: E402


class WaitingAgent(AgentWorkflow):
    """An agent that reads one signal per turn, then fans out to two children and joins them."""

    name = "waiting_agent"

    def run(self, ctx, payload):
        replies = []
        for turn in ctx.turns(payload.get("turns", 2)):
            got = turn.wait_for("reply", timeout=payload.get("timeout"))
            replies.append("timed out" if got is TIMED_OUT else got)
        kids = ctx.spawn_many("child", {"a": {"n": 1}, "b": {"n": 2}})
        joined = ctx.join(kids)
        return {"replies": replies, "children": {k: v["outcome"] for k, v in joined.items()}}
