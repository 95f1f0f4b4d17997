"""An agent's run as the console shows it: turns, each what the model was sent, its reply, its tools.

Built from the memo rows (tokens, cost, latency, outputs), the proposals
(``Approval.step`` is the tool call's key) and the outbox rows (``Outbox.step_key``). A
tool call the model asked for that has no memo yet is shown too: waiting for approval,
in flight, or next.

The messages a model call was sent are not stored (a memo keeps the reply and only the
fingerprint of its input: a long conversation would otherwise grow the table
quadratically). They are rebuilt the way a worker rebuilds them: ``run()`` is executed
from the top over the job's records, every call answered by its memo, until the first
call with no record. Nothing is called and nothing is kept (the replay runs in a
transaction that is rolled back). Each rebuilt input is checked against the memo's
fingerprint: a mismatch means the code changed since the call ran, and the page says so.
"""

import json
import logging
from decimal import Decimal

from django.db import transaction

from ..agents.llm import ModelReply
from ..agents.run import Turn, fingerprint, tool_keys, tool_message
from ..core.workflows import registry
from ..models import Approval, MemoKind, Outbox, OutboxStatus, StepResult
from ..steps.children import child_id
from ..steps.waits import recorded

logger = logging.getLogger("durable.agents")


def _arguments(text):
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text or "{}")
    except (TypeError, ValueError):
        return text
    return value


def _short(value, limit=600):
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit] + "…"


def turns_of(job, show=None):
    """The turns of an agent job, oldest first, and the calls outside any turn.

    ``show(value)`` renders arguments, results and messages for the page (redaction
    included); by default they are cut to a few hundred characters of JSON.
    """
    show = show or _short
    memos = list(StepResult.objects.filter(job_id=job.pk).order_by("seq", "id"))
    proposals = {}
    for approval in Approval.objects.filter(job_id=job.pk).select_related("decided_by").order_by("id"):
        proposals[approval.step] = approval  # the latest one per tool call
    actions = {row.step_key: row for row in Outbox.objects.filter(job_id=job.pk).exclude(step_key="")}
    by_key = {m.step: m for m in memos}
    replay = replay_inputs(job, memos)
    turns, other, shown = {}, [], set()
    seen = 0  # messages shown with an earlier model call

    def turn(number):
        return turns.setdefault(number, {
            "number": number, "model": None, "calls": [], "cost": Decimal(0),
            "input_tokens": 0, "output_tokens": 0, "sent": None,
        })

    for memo in memos:
        if memo.kind == MemoKind.MODEL:
            t = turn(memo.turn)
            output = memo.output or {}
            t["model"] = {"key": memo.step, "model": memo.model or memo.name,
                          "input_tokens": memo.input_tokens, "output_tokens": memo.output_tokens,
                          "cost": memo.cost, "text": output.get("text") or "",
                          "duration": memo.duration, "attempt": memo.attempt,
                          "tool_calls": [{"name": c.get("name"), "id": c.get("id"),
                                          "arguments": show(_arguments(c.get("arguments")))}
                                         for c in output.get("tool_calls") or ()]}
            sent = replay["sent"].get(memo.step)
            if sent is not None:
                messages = sent["messages"]
                earlier = seen if len(messages) >= seen else 0
                t["sent"] = {"earlier": earlier, "count": len(messages), "check": sent["check"],
                             "tools": sent["tools"],
                             "messages": [_message(m, show) for m in messages[earlier:]]}
                seen = len(messages)
            t["cost"] += memo.cost
            t["input_tokens"] += memo.input_tokens
            t["output_tokens"] += memo.output_tokens
            prefix = memo.step.rsplit("/", 1)[0] + "/tool/" if "/" in memo.step else "tool/"
            for call in output.get("tool_calls") or ():
                key = f"{prefix}{call.get('id')}"
                done = by_key.get(key)
                shown.add(key)
                approval, action = proposals.get(key), actions.get(key)
                t["calls"].append({
                    "key": key, "id": call.get("id"), "name": call.get("name"),
                    "arguments": show(_arguments(call.get("arguments"))),
                    "kind": done.kind if done else "",
                    "result": show(done.output) if done else None,
                    "words": in_words(done, approval, action),
                    "raw": show(_raw_action(action)) if action is not None else None,
                    "cost": done.cost if done else Decimal(0),
                    "approval": approval, "action": action,
                    "status": "done" if done else _pending_status(approval, action),
                })
    for memo in memos:
        if memo.kind != MemoKind.MODEL and memo.step not in shown:
            other.append({"key": memo.step, "kind": memo.kind, "name": memo.name,
                          "result": show(memo.output), "cost": memo.cost})
    ordered = [turns[n] for n in sorted(turns)]
    return {"turns": ordered, "other": other, "replay": replay["stopped"],
            "cost": sum((m.cost for m in memos), Decimal(0)),
            "model_calls": sum(1 for m in memos if m.kind == MemoKind.MODEL),
            "tool_calls": sum(1 for m in memos if m.kind in (MemoKind.TOOL, MemoKind.ACTION))}


def _pending_status(approval, action):
    if action is not None:
        return f"action {action.status}"
    if approval is not None:
        return f"proposal {approval.status}"
    return "not run yet"


def _message(message, show):
    """One message sent to the model, for the page: its role, its text or its data, its calls."""
    if not isinstance(message, dict):
        return {"role": "?", "text": "", "shown": show(message), "tool_calls": []}
    content = message.get("content")
    text, shown = "", None
    if isinstance(content, str) and message.get("role") == "tool":
        shown = show(_arguments(content))  # a tool's result, as the model read it
    elif isinstance(content, str):
        text = content
    elif content is not None:
        shown = show(content)
    calls = [{"name": (c.get("function") or c).get("name"), "id": c.get("id"),
              "arguments": show(_arguments((c.get("function") or c).get("arguments")))}
             for c in message.get("tool_calls") or () if isinstance(c, dict)]
    return {"role": message.get("role", "?"), "text": text, "shown": shown, "tool_calls": calls,
            "tool_call_id": message.get("tool_call_id", "")}


def in_words(memo, approval, action):
    """What became of a tool call, in a sentence: sent and confirmed, refused, rejected, waiting."""
    output = memo.output if memo is not None and isinstance(memo.output, dict) else {}
    if action is not None:
        what = f"{action.operation} on {action.destination}"
        attempts = f"{action.attempts} attempt{'' if action.attempts == 1 else 's'}"
        if action.status == OutboxStatus.SUCCEEDED:
            remote = f", remote id {action.remote_id}" if action.remote_id else ""
            return f"Sent {what}: it happened{remote} ({attempts})."
        if action.status == OutboxStatus.FAILED:
            return f"Sent {what}: the destination refused it ({action.last_error or 'no reason given'})."
        if action.status == OutboxStatus.UNKNOWN:
            return f"Sent {what}: whether it happened is unknown; it waits for reconciliation."
        if action.status == OutboxStatus.CANCELLED:
            return f"{what} was cancelled: it was never sent."
        return f"{what} is {action.get_status_display()} ({attempts} so far)."
    if output.get("status") == "rejected" and approval is not None:
        who = approval.decided_by or "someone"
        return f"Rejected by {who}: the model was told “{output.get('rejected')}”."
    if "error" in output:
        error = str(output["error"])
        return error[0].upper() + error[1:] if error.lower().startswith("not done") else f"Not done: {error}"
    if approval is not None and memo is None:
        return f"Proposed; the proposal is {approval.get_status_display()}."
    return ""


def _raw_action(action):
    return {"id": action.pk, "kind": action.kind, "destination": action.destination,
            "operation": action.operation, "values": action.payload, "status": action.status,
            "attempts": action.attempts, "idempotency_key": action.idempotency_key,
            "remote_id": action.remote_id, "response": action.response_summary,
            "last_error": action.last_error, "sent_at": action.sent_at}


def turn_support(approval, show=None):
    """What an agent's proposal came from: its turn, and the read-only results the model had read.

    None for a proposal of a pipeline step. The reads are those of its turn and the
    turns before, newest first.
    """
    if approval.turn is None:
        return None
    show = show or _short
    reads = StepResult.objects.filter(job_id=approval.job_id, kind=MemoKind.TOOL,
                                      turn__lte=approval.turn).order_by("-seq")
    return {"turn": approval.turn, "anchor": f"turn-{approval.turn}-sent",
            "reads": [{"key": m.step, "name": m.name, "turn": m.turn, "result": show(m.output)}
                      for m in reads if not (isinstance(m.output, dict) and "error" in m.output)]}


# Rebuilding what each model call was sent ---------------------------------------------------


class _Frontier(Exception):  # noqa: N818 - a signal, not an error
    """The replay reached a call with no record: a worker would run it next."""


def replay_inputs(job, memos=None):
    """``{"sent": {model key: {"messages", "tools", "check"}}, "stopped": why it stopped}``.

    ``check`` is True when the rebuilt input has the memo's fingerprint, False when it
    differs (the code changed since), None when it could not be checked.
    """
    memos = list(StepResult.objects.filter(job_id=job.pk)) if memos is None else memos
    try:
        workflow = registry.get(job.workflow)
    except Exception as exc:  # noqa: BLE001 - an unknown workflow: nothing to replay
        return {"sent": {}, "stopped": f"not rebuilt: {exc}"}
    replay = _Replay(workflow, job, memos)
    try:
        with transaction.atomic():
            try:
                workflow.run(replay.ctx, job.payload)
                replay.stopped = "the run finished"
            except _Frontier as frontier:
                replay.stopped = f"rebuilt up to {frontier}, the first call with no record"
            finally:
                transaction.set_rollback(True)  # a replay keeps nothing, whatever run() did
    except Exception as exc:  # noqa: BLE001 - shown on the page: the calls before it are rebuilt
        logger.info("job=%s: rebuilding the model inputs stopped: %r", job.pk, exc)
        replay.stopped = f"rebuilt until run() raised {type(exc).__name__}: {exc}"[:500]
    return {"sent": replay.sent, "stopped": replay.stopped}


class _Replay:
    def __init__(self, workflow, job, memos):
        self.workflow = workflow
        self.memos = {m.step: m for m in memos}
        self.visited, self.used, self.occurrences = set(), set(), {}
        self.sent = {}
        self.stopped = ""
        self.ctx = _ReplayContext(self, job)

    def key(self, key, repeat=False):
        if repeat:
            n = self.occurrences[key] = self.occurrences.get(key, 0) + 1
            key = key if n == 1 else f"{key}#{n}"
        self.used.add(key)
        return key

    def memo(self, key):
        memo = self.memos.get(key)
        if memo is None:
            raise _Frontier(key)
        self.visited.add(key)
        return memo

    def capture(self, key, memo, messages, model, tools, params):
        specs = self.workflow.tool_specs() if tools is None else tools
        check = None
        try:
            adapter = model or self.workflow.get_model(self.ctx)
            if hasattr(adapter, "fingerprint_input"):
                fp = fingerprint(adapter.fingerprint_input(messages, specs or None, **params))
            else:
                name = str(getattr(adapter, "model", "") or type(adapter).__name__)
                fp = fingerprint({"model": name, "messages": messages, "tools": specs, **params})
            check = fp == memo.fingerprint if memo.fingerprint else None
        except Exception:  # noqa: BLE001 - the input is shown unchecked
            check = None
        self.sent[key] = {"messages": json.loads(json.dumps(messages, default=str)), "check": check,
                          "tools": [(s.get("function") or s).get("name") for s in specs or ()
                                    if isinstance(s, dict)]}


class _ReplayContext:
    """What ``run()`` sees during a replay: ``AgentContext``'s calls, each answered by its record."""

    step = "run"
    attempt = 1
    lease_token = None

    def __init__(self, replay, job):
        self._replay = replay
        self.job_id = job.pk
        self.payload = job.payload
        self.workflow = job.workflow
        self.db_now = job.updated

    @property
    def spent(self):
        return sum((m.cost for m in self._replay.memos.values()), Decimal(0))

    def turns(self, limit=None):
        number = 0
        while limit is None or number < limit:
            number += 1
            yield Turn(self, number)

    def model(self, messages, *, key, turn=0, model=None, tools=None, repeat=False, **params):
        key = self._replay.key(key, repeat)
        memo = self._replay.memo(key)
        self._replay.capture(key, memo, messages, model, tools, params)
        return ModelReply.from_memo(memo.output)

    def call(self, key, fn, *args, turn=0, repeat=False, **kwargs):
        return self._replay.memo(self._replay.key(key, repeat)).output

    def tool(self, call, *, key, turn=0):
        return self._replay.memo(self._replay.key(key)).output

    def call_tools(self, calls, *, turn=0, prefix=""):
        return [tool_message(call, self.tool(call, key=key, turn=turn))
                for key, call in tool_keys(calls, prefix)]

    def patched(self, name):
        replay = self._replay
        key = replay.key(f"patch/{name}")
        if key in replay.memos:
            replay.visited.add(key)
            return True
        if any(k not in replay.visited for k in replay.memos):
            return False
        raise _Frontier(key)

    def wait_for(self, name, timeout=None, *, key=None, repeat=False):
        return self._waited(self._replay.key(key or f"wait/{name}", repeat))

    def join(self, children, timeout=None, *, key="join", repeat=False):
        return dict(self._waited(self._replay.key(key, repeat)))

    def _waited(self, key):
        wait, outcome = recorded(self, key)
        if wait is None or not wait.outcome:
            raise _Frontier(key)
        return outcome

    def spawn(self, workflow, key, payload, queue="default"):
        return child_id(self.job_id, workflow, key)

    def spawn_many(self, workflow, children, queue="default"):
        return [child_id(self.job_id, workflow, key) for key in children]


__all__ = ["in_words", "replay_inputs", "turn_support", "turns_of"]
