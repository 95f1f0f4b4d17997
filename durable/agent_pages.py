"""An agent's run as the console shows it: turns, each a model call and its tool calls.

Built from the memo rows (tokens, cost, outputs), the proposals (``Approval.step`` is
the tool call's key) and the outbox rows (``Outbox.step_key``). A tool call the model
asked for that has no memo yet is shown too: waiting for approval, in flight, or next.
"""

import json
from decimal import Decimal

from .models import Approval, MemoKind, Outbox, StepResult


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

    ``show(value)`` renders arguments and results for the page (redaction included);
    by default they are cut to a few hundred characters of JSON.
    """
    show = show or _short
    memos = list(StepResult.objects.filter(job_id=job.pk).order_by("seq", "id"))
    proposals = {}
    for approval in Approval.objects.filter(job_id=job.pk).select_related("decided_by").order_by("id"):
        proposals[approval.step] = approval  # the latest one per tool call
    actions = {row.step_key: row for row in Outbox.objects.filter(job_id=job.pk).exclude(step_key="")}
    by_key = {m.step: m for m in memos}
    turns, other, shown = {}, [], set()

    def turn(number):
        return turns.setdefault(number, {
            "number": number, "model": None, "calls": [], "cost": Decimal(0),
            "input_tokens": 0, "output_tokens": 0,
        })

    for memo in memos:
        if memo.kind == MemoKind.MODEL:
            t = turn(memo.turn)
            output = memo.output or {}
            t["model"] = {"key": memo.step, "model": memo.model or memo.name,
                          "input_tokens": memo.input_tokens, "output_tokens": memo.output_tokens,
                          "cost": memo.cost, "text": output.get("text") or "",
                          "duration": memo.duration, "attempt": memo.attempt}
            t["cost"] += memo.cost
            t["input_tokens"] += memo.input_tokens
            t["output_tokens"] += memo.output_tokens
            prefix = memo.step.rsplit("/", 1)[0] + "/tool/" if "/" in memo.step else "tool/"
            for call in output.get("tool_calls") or ():
                key = f"{prefix}{call.get('id')}"
                done = by_key.get(key)
                shown.add(key)
                t["calls"].append({
                    "key": key, "id": call.get("id"), "name": call.get("name"),
                    "arguments": show(_arguments(call.get("arguments"))),
                    "kind": done.kind if done else "",
                    "result": show(done.output) if done else None,
                    "cost": done.cost if done else Decimal(0),
                    "approval": proposals.get(key), "action": actions.get(key),
                    "status": "done" if done else _pending_status(proposals.get(key),
                                                                   actions.get(key)),
                })
    for memo in memos:
        if memo.kind != MemoKind.MODEL and memo.step not in shown:
            other.append({"key": memo.step, "kind": memo.kind, "name": memo.name,
                          "result": show(memo.output), "cost": memo.cost})
    ordered = [turns[n] for n in sorted(turns)]
    return {"turns": ordered, "other": other,
            "cost": sum((m.cost for m in memos), Decimal(0)),
            "model_calls": sum(1 for m in memos if m.kind == MemoKind.MODEL),
            "tool_calls": sum(1 for m in memos if m.kind in (MemoKind.TOOL, MemoKind.ACTION))}


def _pending_status(approval, action):
    if action is not None:
        return f"action {action.status}"
    if approval is not None:
        return f"proposal {approval.status}"
    return "not run yet"


__all__ = ["turns_of"]
