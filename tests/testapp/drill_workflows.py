"""Workflows the crash drills run: every step body writes down each time it runs.

A drill counts executions from the log named in the payload (one line per start of
a step body, appended with O_APPEND so lines of concurrent processes never tear) and
compares them with the memos and events the engine committed.

Payload knobs (all optional):

- ``log``: the executions log.
- ``hold``: ``{"step": "b", "seconds": 1.5, "attempt": 1}``: that step sleeps on that
  attempt, so a drill can pause or kill the process while it is inside the step.
- ``fail_once``: the named step raises a connection error on its first attempt (a
  retryable failure, so the job passes through backoff).
- ``work``: seconds every step sleeps (spreads kills over step bodies).
"""

import os
import time

from durable import Action, Retry, Workflow, faults, step
from durable.actions.destinations import Destination, HttpDestination, register

# Kills during a drill hit a step again and again; a real poison job would fail after
# the default attempts, but a drill must see every job through to count it.
DRILL_RETRY = Retry(max_attempts=25, base=0.05, cap=0.2)


def write_line(path, line):
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def body(ctx, data):
    """What every drill step does: record, maybe hold or fail, hit mid_step, return."""
    payload = ctx.payload if isinstance(ctx.payload, dict) else {}
    log = payload.get("log")
    pid = os.getpid()
    write_line(log, f"exec {ctx.job_id} {ctx.step} {ctx.attempt} {pid}")
    hold = payload.get("hold") or {}
    if hold.get("step") == ctx.step and ctx.attempt == hold.get("attempt", 1):
        time.sleep(float(hold.get("seconds", 1.0)))
    if payload.get("work"):
        time.sleep(float(payload["work"]))
    faults.point("mid_step")
    if payload.get("fail_once") == ctx.step and ctx.attempt == 1:
        raise ConnectionError("drill: connection reset by peer (first attempt only)")
    # "done" means the body returned: a paused holder writes it after SIGCONT, which
    # proves it reached the commit that fencing then refused.
    write_line(log, f"done {ctx.job_id} {ctx.step} {ctx.attempt} {pid}")
    count = (data or {}).get("n", 0) if isinstance(data, dict) else 0
    return {"n": count + 1, "by": pid}


class Drill(Workflow):
    """Four recorded steps: the unit of work of every drill."""

    name = "drill"

    @step(retry=DRILL_RETRY)
    def a(self, payload, ctx):
        return body(ctx, None)

    @step(retry=DRILL_RETRY)
    def b(self, data, ctx):
        return body(ctx, data)

    @step(retry=DRILL_RETRY)
    def c(self, data, ctx):
        return body(ctx, data)

    @step(retry=DRILL_RETRY)
    def d(self, data, ctx):
        return body(ctx, data)


class DrillHold(Workflow):
    """The same four steps, with a step timeout longer than any pause a drill applies.

    A paused holder must come back *inside* its step and reach the commit, so the drill
    sees fencing refuse the write (with the default timeout, the heartbeat would end
    the process first, which is the other safe path).
    """

    name = "drill_hold"

    @step(retry=DRILL_RETRY, timeout=120)
    def a(self, payload, ctx):
        return body(ctx, None)

    @step(retry=DRILL_RETRY, timeout=120)
    def b(self, data, ctx):
        return body(ctx, data)

    @step(retry=DRILL_RETRY, timeout=120)
    def c(self, data, ctx):
        return body(ctx, data)

    @step(retry=DRILL_RETRY, timeout=120)
    def d(self, data, ctx):
        return body(ctx, data)


# The receiver matrix: four destinations side by side, one per kind of receiver. Each
# reads its receiver's URL from DURABLE_DRILL_RECEIVER_<NAME> (set on the workers by
# the drill), so one runworkers process serves every cell with the right client.

MATRIX_READ_TIMEOUT = 1.0


class DrillReceiver(Destination):
    """An HttpDestination for a drill receiver named in the environment."""

    def __init__(self, name, *, idempotent, lookup):
        super().__init__(name)
        self.idempotent = idempotent
        self._lookup = lookup
        self._built = (None, None)

    @property
    def supports_lookup(self):
        return self._lookup

    @property
    def timeout(self):
        return self.current().timeout

    def current(self):
        url = os.environ.get(f"DURABLE_DRILL_RECEIVER_{self.name.upper()}", "http://127.0.0.1:9")
        if self._built[0] != url:
            self._built = (url, HttpDestination(
                self.name, url=f"{url}/actions", idempotent=self.idempotent,
                lookup_url=f"{url}/actions/lookup?key={{key}}" if self._lookup else None,
                timeout=(1.0, MATRIX_READ_TIMEOUT),
            ))
        return self._built[1]

    def dispatch(self, request):
        return self.current().dispatch(request)

    def lookup(self, request):
        return self.current().lookup(request)

    def redact(self, text):
        return self.current().redact(text)


MATRIX = {
    "drill_idem_lookup": (True, True),
    "drill_idem": (True, False),
    "drill_plain_lookup": (False, True),
    "drill_plain": (False, False),
}
for _name, (_idempotent, _lookup) in MATRIX.items():
    register(DrillReceiver(_name, idempotent=_idempotent, lookup=_lookup))


# The property tests' workflow: each step does what the test says it should this time.

CHAOS = {}  # job id -> the next step's outcome (in-process runners only)
CHAOS_RETRY = Retry(max_attempts=2, base=0.001, cap=0.002)


def chaos(ctx):
    from durable import NeedsHuman, PermanentError

    outcome = CHAOS.pop(ctx.job_id, "ok")
    if outcome == "retry":
        raise ConnectionError("chaos: connection reset")
    if outcome == "poison":
        raise PermanentError("chaos: malformed input")
    if outcome == "human":
        raise NeedsHuman("chaos: a person must look")
    if outcome == "wait" and not ctx.woken:
        ctx.sleep(0)
    return {"step": ctx.step, "attempt": ctx.attempt}


class Chaos(Workflow):
    """Three steps (one may wait, one may ask a human) steered by the property tests."""

    name = "drill_chaos"

    @step(retry=CHAOS_RETRY, waits=True)
    def a(self, payload, ctx):
        return chaos(ctx)

    @step(retry=CHAOS_RETRY, needs_human=True)
    def b(self, data, ctx):
        return chaos(ctx)

    @step(retry=CHAOS_RETRY)
    def c(self, data, ctx):
        return chaos(ctx)


# The partition drill's ticket: the same three steps as ``ticket``, with the drills'
# patient retries, because a host cut off from the receiver turns sends into "not sent"
# (nothing was delivered) several times in a row before another host sends it.


class DrillTicket(Workflow):
    """Prepare, create the ticket at the receiver (an action), confirm."""

    name = "drill_ticket"

    @step(retry=DRILL_RETRY)
    def prepare(self, payload, ctx):
        return {"subject": "Printer on fire", "customer": payload["customer"]}

    @step(action=True, retry=DRILL_RETRY)
    def create_ticket(self, data, ctx):
        return Action(destination="test_receiver", operation="create_ticket",
                      values={"subject": data["subject"], "customer": data["customer"]},
                      summary=f"Create a ticket for {data['customer']}")

    @step(retry=DRILL_RETRY)
    def confirm(self, memo, ctx):
        return {"ticket": memo["remote_id"], "how": memo["confirmed_by"]}
