"""Workflows of the threads tests: steps that wait on a real server on 127.0.0.1.

Each step calls the URL in its payload (the test's server, which holds the reply until
the test opens the gate) and logs its execution, so a test can count steps in flight
at the server and effects afterwards.
"""

import asyncio
import os
import threading
import time
import urllib.parse
import urllib.request

from durable import Retry, Workflow, step

from .workflows import record


def _url(payload, ctx, gate=None):
    query = urllib.parse.urlencode({"job": ctx.job_id, "attempt": ctx.attempt, "pid": os.getpid(),
                                    "thread": threading.get_ident()})
    return f"{payload['url']}/{gate or payload.get('gate', 'barrier')}?{query}"


def call(payload, ctx, gate=None):
    """GET the test server's gate (it answers when the test opens it) and log the call."""
    with urllib.request.urlopen(_url(payload, ctx, gate), timeout=120) as reply:
        body = reply.read().decode()
    record(payload, f"{ctx.job_id} call {ctx.attempt} {os.getpid()}")
    return body


class Call(Workflow):
    """Two steps: a call that waits on the server, then one that logs."""

    name = "thread_call"

    @step(timeout=45)
    def call(self, payload, ctx):
        return {"reply": call(payload, ctx)}

    @step(timeout=45)
    def after(self, data, ctx):
        record(ctx.payload, f"{ctx.job_id} after {ctx.attempt} {os.getpid()}")
        return {"done": True}


class OneCall(Workflow):
    """One call that waits on the server: the job is done when the call returns."""

    name = "thread_one_call"

    @step(timeout=45)
    def call(self, payload, ctx):
        return {"reply": call(payload, ctx)}


class AsyncCall(Workflow):
    """One ``async def`` call that waits on the server, on the process's event loop."""

    name = "thread_async_call"

    @step(timeout=float(os.environ.get("DURABLE_TEST_ASYNC_TIMEOUT", 45)),
          retry=Retry(max_attempts=3, base=0.01, cap=0.02))
    async def call(self, payload, ctx):
        parts = urllib.parse.urlsplit(_url(payload, ctx))
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(f"GET {parts.path}?{parts.query} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            await writer.drain()
            reply = await reader.read()
        finally:
            writer.close()
        record(payload, f"{ctx.job_id} call {ctx.attempt} {os.getpid()}")
        return {"status": reply.split(b" ", 2)[1].decode()}


class Stuck(Workflow):
    """A step whose first attempt outlives its one-second timeout (it waits on the server)."""

    name = "thread_stuck"

    @step(timeout=1.0, retry=Retry(max_attempts=3, base=0.01, cap=0.02))
    def work(self, payload, ctx):
        if ctx.attempt == 1:
            record(payload, f"{ctx.job_id} stuck {ctx.attempt} {os.getpid()}")
            call(payload, ctx, gate="stuck")
            record(payload, f"{ctx.job_id} late {ctx.attempt} {os.getpid()}")
        else:
            record(payload, f"{ctx.job_id} work {ctx.attempt} {os.getpid()}")
        return {"attempt": ctx.attempt}


class Writes(Workflow):
    """Three short steps that write, for SQLite under many threads."""

    name = "thread_writes"

    @step
    def one(self, payload, ctx):
        record(payload, f"{ctx.job_id} one {ctx.attempt} {os.getpid()}")
        time.sleep(float(payload.get("work", 0)))
        return {"n": 1}

    @step
    def two(self, data, ctx):
        record(ctx.payload, f"{ctx.job_id} two {ctx.attempt} {os.getpid()}")
        time.sleep(float(ctx.payload.get("work", 0)))
        return {"n": data["n"] + 1}

    @step
    def three(self, data, ctx):
        record(ctx.payload, f"{ctx.job_id} three {ctx.attempt} {os.getpid()}")
        return {"n": data["n"] + 1}
