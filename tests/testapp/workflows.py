"""Workflows the tests (and their worker subprocesses) run.

Steps that record executions append a line to the file named in the payload, with
O_APPEND so lines from concurrent processes never interleave.
"""

import os
import time
from decimal import Decimal

from durable import NeedsHuman, Output, Retry, RetryableError, Wait, Workflow, step


def record(payload, what):
    path = payload.get("log") if isinstance(payload, dict) else None
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{what}\n".encode())
        finally:
            os.close(fd)


class Pipeline(Workflow):
    """The article's fetch -> extract -> verify -> deliver pipeline, as plain steps."""

    name = "test_pipeline"

    @step(working="fetching", done="fetched")
    def fetch(self, payload, ctx):
        return {"doc": payload.get("doc", "text")}

    @step(working="extracting", done="extracted")
    def extract(self, data, ctx):
        return Output({"n": len(data["doc"])}, cost=Decimal("0.03"))

    @step(working="verifying", done="verified", needs_human=True)
    def verify(self, data, ctx):
        if data["n"] == 0:
            raise NeedsHuman("empty document")
        return {"ok": True}

    @step(working="delivering", done="delivered")
    def deliver(self, data, ctx):
        return {"delivered": True}


class Recorded(Workflow):
    """Three steps that log each execution; ``sleep`` slows the first attempt of step b."""

    name = "recorded"

    @step(timeout=20)
    def a(self, payload, ctx):
        record(ctx.payload, f"{ctx.job_id} a {os.getpid()}")
        return {"a": 1}

    @step(timeout=20)
    def b(self, data, ctx):
        record(ctx.payload, f"{ctx.job_id} b-start {os.getpid()}")
        if ctx.attempt == 1:
            time.sleep(float(ctx.payload.get("sleep", 0)))
        record(ctx.payload, f"{ctx.job_id} b {os.getpid()}")
        return {"b": data["a"] + 1}

    @step(timeout=20)
    def c(self, data, ctx):
        record(ctx.payload, f"{ctx.job_id} c {os.getpid()}")
        ctx.cost("0.01")
        return {"c": data["b"] + 1}


class Flaky(Workflow):
    """One step that fails as the payload says, to exercise retries and poison."""

    name = "flaky"

    @step(retry=Retry(max_attempts=3, base=0.01, cap=0.05))
    def work(self, payload, ctx):
        record(payload, f"{ctx.job_id} work {ctx.attempt}")
        mode = payload.get("mode")
        if mode == "retryable" and ctx.attempt < payload.get("succeed_on", 99):
            raise ConnectionError("connection reset by peer")
        if mode == "retry_after":
            if ctx.attempt == 1:
                raise RetryableError("slow down", retry_after=payload["retry_after"])
        if mode == "poison":
            raise ValueError("malformed document at line 3")
        if mode == "secret":
            raise RuntimeError("GET https://user:hunter2@api.example/x?token=abc123 "
                               "Authorization: Bearer sk-live-0123456789")
        if mode == "timeout":
            time.sleep(payload.get("sleep", 5))
        return {"attempt": ctx.attempt}


class Slow(Workflow):
    """A step with a short timeout, for step-timeout drills."""

    name = "slow"

    @step(timeout=1.0, retry=Retry(max_attempts=2, base=0.01, cap=0.02))
    def work(self, payload, ctx):
        record(payload, f"{ctx.job_id} work {ctx.attempt} {os.getpid()}")
        if ctx.attempt == 1:
            time.sleep(payload.get("sleep", 30))
        return {"attempt": ctx.attempt}


class Sleeper(Workflow):
    """A durable timer between two steps."""

    name = "sleeper"

    @step
    def first(self, payload, ctx):
        return {"x": 1}

    @step(waits=True)
    def nap(self, data, ctx):
        ctx.sleep(ctx.payload.get("seconds", 3600))
        return {"woke": True}


class WaitUntil(Workflow):
    name = "wait_until"

    @step(waits=True)
    def wait(self, payload, ctx):
        if not ctx.woken:
            raise Wait(seconds=payload["seconds"])
        return {}

# Importing these modules registers their workflows.
from . import (  # noqa: E402, F401
    actions_workflows,
    agent_workflows,
    approval_workflows,
    burst_workflows,
    drill_workflows,
    operator_workflows,
    thread_workflows,
    wait_workflows,
)
