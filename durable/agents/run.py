"""One execution of an agent's ``run()``: keys, memos, bounds and divergence.

A claim loads the job's memo rows once. Each call through ``ctx`` names a key; a key
with a memo returns the memo (after checking it is the same kind of call: otherwise
the code changed, a *divergence*, and the job waits for a person). A key without one
is the frontier: the call runs, and its memo commits together with the job's progress
in one transaction fenced by the lease token (a worker that lost its lease commits
nothing). A miss while memos recorded later by an earlier run are still unvisited is
also a divergence: the code inserted a call (guard it with ``ctx.patched``).
"""

import datetime
import hashlib
import json
import logging
import time
from decimal import Decimal

from django.db import transaction

from .. import faults
from ..core.concurrency import Interrupted
from ..core.formats import money
from ..core.identity import storable_json
from ..core.outcomes import AskHuman, Done, Failed, HandedBack, Left, Lost, Parked
from ..core.outcomes import Interrupted as InterruptedOutcome
from ..core.outcomes import Throttled as ThrottledOutcome
from ..core.retry import scrub
from ..core.workflows import NeedsHuman, Output, WaitingOn
from ..exceptions import LeaseLost
from ..models import EventKind, Job, JobEvent, MemoKind, StepResult
from ..steps.limits import Throttled, paced
from ..store import budgets, concurrency, locking
from ..store import cache as call_cache
from . import spending
from . import tools as agent_actions
from .base import RUNNING, Divergence, Draining, DuplicateKey, Suspended, ToolError, parsed
from .llm import ModelReply, ModelReplyInvalid

logger = logging.getLogger("durable.agents")


def fingerprint(value):
    """sha256 of a value's canonical JSON: detects a changed input without storing it."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class Memo:
    __slots__ = ("key", "kind", "name", "seq", "fingerprint", "output", "cost", "turn",
                 "input_tokens", "output_tokens")

    def __init__(self, key, kind, name, seq, fingerprint, output, cost, turn,
                 input_tokens=0, output_tokens=0):
        self.key, self.kind, self.name, self.seq = key, kind, name, seq
        self.fingerprint, self.output, self.cost, self.turn = fingerprint, output, cost, turn
        self.input_tokens, self.output_tokens = input_tokens, output_tokens

    def describe(self):
        return f"{self.kind} {self.name!r}" if self.name else self.kind


def _money(value):
    return Decimal(str(value or 0))


class AgentRun:
    """The state of one execution of ``run()`` under one lease."""

    def __init__(self, workflow, seat, started):
        self.workflow = workflow
        self.seat = seat
        self.started = started
        self.claimed = started.claimed
        self.memos = {}
        self.visited = set()
        self.used = set()
        self.occurrences = {}
        self.seq = 0
        self.turn_limit = workflow.max_turns
        self.budget = workflow.budget
        self.changed = []  # keys whose input fingerprint differs from the memo's
        self.priority = 0  # the job's: it orders the runs waiting for a provider limit's slot
        self.scopes = ()  # the budgets that cover the run (durable.store.budgets.Scope)
        self.ctx = AgentContext(self)

    # Loading -----------------------------------------------------------------------

    def load(self):
        rows = StepResult.objects.filter(job_id=self.claimed.id).values_list(
            "step", "kind", "name", "seq", "fingerprint", "output", "cost", "turn",
            "input_tokens", "output_tokens")
        for row in rows:
            memo = Memo(*row)
            self.memos[memo.key] = memo
            self.seq = max(self.seq, memo.seq)
        limit, budget, self.priority, budget_key = Job.objects.filter(pk=self.claimed.id).values_list(
            "turn_limit", "budget", "priority", "budget_key").first() or (None, None, 0, "")
        if limit is not None:
            self.turn_limit = limit
        if budget is not None:
            self.budget = _money(budget)
        self.scopes = budgets.scopes_for(self.claimed.id, self.workflow.name,
                                         budgets.key_of(budget_key, self.claimed.concurrency_key), self.budget)

    def check_key(self):
        """Before a model call: a job submitted later under the run's concurrency key may interrupt it."""
        claimed = self.claimed
        if claimed.concurrency_key is not None:
            turn = concurrency.admit(claimed.id, claimed.concurrency_key, claimed.concurrency_seq)
            if turn.interrupted_by is not None:
                raise Interrupted(turn.interrupted_by)

    def spent(self):
        return sum((m.cost for m in self.memos.values()), Decimal(0))

    def turns_recorded(self):
        return max((m.turn for m in self.memos.values()), default=0)

    def unvisited(self):
        return sorted((m for k, m in self.memos.items() if k not in self.visited),
                      key=lambda m: m.seq)

    # Running -----------------------------------------------------------------------

    def go(self):
        """Run ``run()`` from the top; return the outcome the engine's runner acts on.

        Nothing here ends the step: the runner matches the outcome (``durable.core.outcomes``)
        and makes the move, as it does for a step function's return.
        """
        seat = self.seat
        began = time.monotonic()
        self._watch()
        try:
            self.load()
            result = self.workflow.run(self.ctx, self.claimed.payload)
            self._check_end()
            if isinstance(result, Output):
                result = result.value
            output_json = storable_json(result)
        except NeedsHuman as signal_:
            return AskHuman(signal_.reason)
        except Divergence as exc:
            return AskHuman(f"divergence: {exc}")
        except Suspended as signal_:
            return Left(signal_.outcome)
        except WaitingOn as waiting:
            return Parked(waiting)
        except LeaseLost:
            return Lost()
        except Draining:
            return HandedBack(self.seq)
        except Throttled as waiting:
            return ThrottledOutcome(waiting.until, waiting.why, self.seq)
        except Interrupted as stop:
            return InterruptedOutcome(stop.by, self.seq)
        except ModelReplyInvalid as exc:
            # Kept for the operator: last_error names what the model sent.
            raw = str(exc.raw or "")[:1500]
            kept = ModelReplyInvalid(f"{exc}; the reply was: {raw}" if raw else str(exc), raw=raw)
            return Failed(kept, time.monotonic() - began)
        except Exception as exc:  # noqa: BLE001 - the run's retry policy classifies it
            return Failed(exc, time.monotonic() - began)
        finally:
            if seat.heartbeat is not None:
                seat.heartbeat.unwatch()
        self._report_changes()
        duration = datetime.timedelta(seconds=time.monotonic() - began)
        return Done(output_json, duration)

    def _watch(self):
        """Watch the run: its lease is renewed while it runs, and each call has the step timeout."""
        hb = self.seat.heartbeat
        if hb is not None:
            hb.watch(self.started, self.started.step.effective_timeout, self.seat.on_timeout)

    def _restart_timeout(self, renewed_at=None):
        hb = self.seat.heartbeat
        if hb is not None:
            hb.restart_timeout(self.started, renewed_at)

    def _check_end(self):
        left = self.unvisited()
        actions = [m for m in left if m.kind == MemoKind.ACTION]
        if actions:
            raise Divergence(
                f"the run finished without reaching {actions[0].key} ({actions[0].describe()}),"
                " an action an earlier run of this job took: the code changed"
            )
        if left:
            self._event(f"finished without reaching {len(left)} recorded calls:"
                        f" {', '.join(m.key for m in left[:10])}",
                        {"unvisited": [m.key for m in left[:100]]})

    def _report_changes(self):
        if self.changed:
            self._event(f"the input of {len(self.changed)} recorded calls changed since they"
                        f" ran (memos used): {', '.join(self.changed[:10])}",
                        {"fingerprint_changed": self.changed[:100]})

    def _event(self, message, data):
        JobEvent.objects.create(job_id=self.claimed.id, kind=EventKind.STEP_DONE,
                                step="run", actor=self.seat.owner, message=message,
                                from_state=RUNNING, to_state=RUNNING, data=data)

    # Keys and memos ----------------------------------------------------------------

    def use_key(self, key, repeat=False):
        # The step timeout bounds each call (and the code before it), not the whole run.
        self._restart_timeout()
        if not isinstance(key, str) or not key or len(key) > 200:
            raise DuplicateKey(f"a key must be a non-empty string of at most 200 characters,"
                               f" not {key!r}"[:300])
        if repeat:
            n = self.occurrences[key] = self.occurrences.get(key, 0) + 1
            key = key if n == 1 else f"{key}#{n}"
        if key in self.used:
            raise DuplicateKey(
                f"the key {key!r} was used twice in one run: give each call its own key"
                " (or pass repeat=True for a counter)"
            )
        self.used.add(key)
        return key

    def memoized(self, key, kind, name, fp, produce, *, turn=0, strict=False, check_name=True):
        """The memo at ``key``, or the result of ``produce()`` committed under it."""
        memo = self.memos.get(key)
        if memo is not None:
            self.visited.add(key)
            if memo.kind != kind or (check_name and memo.name != name):
                raise Divergence(
                    f"at key {key!r} the code asked for {kind} {name!r}; the memo holds"
                    f" {memo.describe()}"
                )
            if fp and memo.fingerprint and memo.fingerprint != fp:
                if strict:
                    raise Divergence(
                        f"at key {key!r} the code asked for {kind} {name!r} with other"
                        " parameters than the ones recorded"
                    )
                self.changed.append(key)
            return memo
        left = self.unvisited()
        if left:
            raise Divergence(
                f"at key {key!r} the code asked for {kind} {name!r}, which this run never"
                f" recorded, while an earlier run went on to {left[0].key} ({left[0].describe()}):"
                " the code changed (guard new calls with ctx.patched(...))"
            )
        if self.seat.stopping is not None and self.seat.stopping():
            # SIGTERM: what ran is kept; the next call is another worker's to make (now, not
            # after the lease), so a deploy neither waits for whole runs nor pays a call twice.
            raise Draining()
        if self.seat.release is not None:
            self.seat.release()  # a model, tool or HTTP call waits: on no connection
        began = time.monotonic()
        output, extra = produce()
        duration = datetime.timedelta(seconds=time.monotonic() - began)
        return self.commit(key, kind, name, fp, output, turn=turn, duration=duration, **extra)

    def commit(self, key, kind, name, fp, output, *, turn, duration, cost=Decimal(0),
               input_tokens=0, output_tokens=0, model="", holds=(), hit=None, keep=None):
        """Write one memo with the job's progress: one transaction, fenced by the lease.

        The call's budget holds settle to its cost in that transaction (money recorded
        without a hold, a tool's, is added to the run's budgets); a cache hit ``(cache key,
        cost saved)`` records what it saved there too.
        """
        try:
            output_json = storable_json(output)
            cost = _money(cost)
            if cost < 0:
                raise ValueError(f"a call's cost must not be negative (got {cost})")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"the result of {key!r} is not storable: {exc}") from None
        self.seq += 1
        lease = self.seat.lease_seconds
        faults.point("agent_before_memo")
        renewed_at = time.monotonic()
        memo = locking.MemoCommit(
            key=key, kind=str(kind), name=name[:100], seq=self.seq, turn=turn,
            fingerprint=fp or "", output_json=output_json, cost=cost,
            input_tokens=int(input_tokens or 0), output_tokens=int(output_tokens or 0),
            model=(model or "")[:100], duration=duration, attempt=self.started.attempt,
            workflow=self.workflow.name,
        )
        progress = json.dumps({"turn": turn, "key": key, "calls": self.seq})
        commit_memo = self.seat.commit_memo or locking.commit_memo
        money = holds or hit is not None or (cost and self.scopes)
        if not money:
            ok = commit_memo(self.claimed, RUNNING, lease, progress, memo)
        else:
            # Settled with the memo: both, or (fenced out) neither. Outside the group commit.
            rows = budgets.current_rows(self.scopes) if cost and not holds and self.scopes else None
            with transaction.atomic():
                ok = commit_memo(self.claimed, RUNNING, lease, progress, memo)
                if ok:
                    budgets.settle(holds, cost, rows)
                    if hit is not None:
                        call_cache.record_hit(hit[0], self.claimed.id, key, hit[1])
        if not ok:
            if holds:  # the reply came: the provider billed it, memo or not
                budgets.settle(holds, cost)
            raise LeaseLost(f"lost the lease of job {self.claimed.id} before {key!r} committed")
        self._restart_timeout(renewed_at)  # the commit set the lease afresh
        if keep is not None:  # a paid reply other jobs may reuse (durable.store.cache)
            call_cache.keep(keep[0], kind=str(kind), name=name, output=json.loads(output_json), cost=cost,
                            input_tokens=input_tokens, output_tokens=output_tokens, model=model,
                            job=self.claimed.id, ttl=keep[1])
        faults.point("agent_after_memo")
        # The call succeeded: the next one starts its own count of attempts.
        self.started.attempt = self.claimed.attempts = 1
        memo = Memo(key, kind, name, self.seq, fp or "", json.loads(output_json), cost, turn,
                    input_tokens, output_tokens)
        self.memos[key] = memo
        self.visited.add(key)
        return memo

    # Bounds ------------------------------------------------------------------------

    def check_turn(self, number):
        if number <= self.turns_recorded():
            return  # replaying a turn that was allowed when it ran
        if self.turn_limit is not None and number > self.turn_limit:
            raise NeedsHuman(f"turn limit: the run used its {self.turn_limit} turns;"
                             " grant more turns to let it go on")

    def check_budget(self):
        """The run's own budget, for a model without a price (its worst case unknown): the
        call goes while the memos spent less than the budget (so it may end one call over)."""
        spent = self.spent()
        if self.budget is not None and spent >= self.budget:
            raise NeedsHuman(f"budget: the run spent {money(spent)} of its budget of"
                             f" {money(self.budget)};"
                             " grant more budget to let it go on")


class AgentContext:
    """What an agent's ``run()`` sees: the job, and every call it may make under a key."""

    def __init__(self, run):
        self._run = run
        self.job_id = run.claimed.id
        self.payload = run.claimed.payload
        self.workflow = run.workflow.name

    @property
    def attempt(self):
        return self._run.started.attempt

    # What the waits (durable.steps.inbox, durable.steps.children) read of a context.
    step = "run"

    @property
    def lease_token(self):
        return self._run.claimed.lease_token

    @property
    def db_now(self):
        return self._run.claimed.db_now

    def wait_for(self, name, timeout=None, *, key=None, repeat=False):
        """The payload of the oldest unread signal ``name``, or ``durable.TIMED_OUT``.

        Recorded under ``key`` (default ``wait/<name>``; in a turn ``t3/wait/<name>``):
        a re-run returns the same payload. Without a signal the job parks in
        ``waiting``, holding no worker, until one arrives or ``timeout`` passes.
        """
        from ..steps.inbox import wait_for

        return wait_for(self, name, timeout, key=self._run.use_key(key or f"wait/{name}", repeat))

    def spawn(self, workflow, key, payload, queue="default"):
        """Submit one child job ``<job>/<workflow>/<key>``; returns its id."""
        return self.spawn_many(workflow, {key: payload}, queue=queue)[0]

    def spawn_many(self, workflow, children, queue="default"):
        """Submit the child jobs ``{key: payload}`` in one transaction (all or none); their ids."""
        from ..steps.children import spawn_many

        return spawn_many(self, workflow, children, queue=queue)

    def join(self, children, timeout=None, *, key="join", repeat=False):
        """``{child id: outcome}`` in key order once every child finished; parks in ``joining``."""
        from ..steps.children import join

        return join(self, children, timeout, key=self._run.use_key(key, repeat))

    @property
    def spent(self):
        """The money this job's recorded calls cost so far (the budget's ledger)."""
        return self._run.spent()

    def turns(self, limit=None):
        """Turns 1, 2, …: each scopes its keys (``t3/model``); past the limit, needs_human."""
        number = 0
        while True:
            number += 1
            if limit is not None and number > limit:
                return
            self._run.check_turn(number)
            yield Turn(self, number)

    def model(self, messages, *, key, turn=0, model=None, tools=None, repeat=False, cache=None, **params):
        """One model call, memoized at ``key``: a ``ModelReply`` with its tokens and cost.

        Before a call that is not recorded yet, its worst case is reserved on every
        budget that covers the run (``durable.core.budgets``); the memo settles it. The
        reply's message goes into the memo, not the prompt (only its fingerprint: a long
        conversation does not grow the table quadratically). ``cache=True`` (or seconds;
        default the workflow's ``cache``) answers from a reply another job paid for the
        same call, at cost 0, and keeps a paid reply for others (``durable.store.cache``).
        """
        run = self._run
        key = run.use_key(key, repeat)
        model = model or run.workflow.get_model(self)
        specs = run.workflow.tool_specs() if tools is None else tools
        name = str(getattr(model, "model", "") or type(model).__name__)
        if hasattr(model, "fingerprint_input"):
            fp = fingerprint(model.fingerprint_input(messages, specs or None, **params))
        else:
            fp = fingerprint({"model": name, "messages": messages, "tools": specs, **params})
        ttl = spending.ttl(run.workflow.cache if cache is None else cache)

        def produce():
            cache_key = spending.cache_key(MemoKind.MODEL, name, fp, ttl)
            hit = spending.cached(cache_key, model=name)
            if hit is not None:
                return hit
            run.check_key()
            faults.point("agent_model_call")
            holds = []
            reply = paced(model, messages, specs or None, params,
                          lambda: spending.guarded(run, model, name, messages, specs or None, params, key, holds,
                                                   lambda: model.complete(messages, tools=specs or None, **params)),
                          job_id=run.claimed.id, lease_token=run.claimed.lease_token, key=key,
                          release=run.seat.release, priority=run.priority)
            if not isinstance(reply, ModelReply):
                budgets.write_off(holds)
                raise ModelReplyInvalid(f"the model adapter returned {type(reply).__name__},"
                                        " not a ModelReply", raw=repr(reply)[:2000])
            extra = {"cost": reply.cost, "input_tokens": reply.input_tokens,
                     "output_tokens": reply.output_tokens, "model": reply.model or name, "holds": tuple(holds)}
            if cache_key is not None:
                extra["keep"] = (cache_key, ttl)
            return reply.as_memo(), extra

        memo = run.memoized(key, MemoKind.MODEL, name, fp, produce, turn=turn, check_name=False)
        return ModelReply.from_memo(memo.output)

    def call(self, key, fn, *args, turn=0, repeat=False, **kwargs):
        """Any other call worth remembering (``fn(*args, **kwargs)``), memoized at ``key``.

        ``fn`` may return ``durable.Output(value, cost=...)`` to record a cost.
        """
        run = self._run
        key = run.use_key(key, repeat)
        name = getattr(fn, "__name__", type(fn).__name__)

        def produce():
            value = fn(*args, **kwargs)
            if isinstance(value, Output):
                return value.value, {"cost": value.cost}
            return value, {}

        return run.memoized(key, MemoKind.CALL, name, "", produce, turn=turn).output

    def tool(self, call, *, key, turn=0):
        """Run one tool call of the model (a ``durable.llm.ToolCall``) at ``key``; returns its result.

        Bad input from the model is data: an unknown tool or arguments that fail the
        tool's schema give an error result the model reads, not a crash.
        """
        run = self._run
        key = run.use_key(key)
        tool = run.workflow.tools_by_name.get(call.name)
        if tool is None:
            known = ", ".join(sorted(run.workflow.tools_by_name)) or "none"
            error = {"error": f"there is no tool named {call.name!r}; the tools are: {known}"}
            return run.memoized(key, MemoKind.TOOL, str(call.name)[:100], "",
                                lambda: (error, {}), turn=turn).output
        arguments, errors = parsed(call)
        if not errors:
            errors = tool.errors(arguments)
        if errors:
            error = {"error": f"invalid arguments for {tool.name}: {'; '.join(errors)}"}
            kind = MemoKind.ACTION if tool.is_action else MemoKind.TOOL
            return run.memoized(key, kind, tool.name, "", lambda: (error, {}), turn=turn).output
        if tool.is_action:
            return agent_actions.act(run, key, tool, arguments, turn)

        fp = fingerprint(arguments)
        ttl = spending.ttl(tool.cache)

        def produce():
            cache_key = spending.cache_key(MemoKind.TOOL, tool.name, fp, ttl)
            hit = spending.cached(cache_key)
            if hit is not None:
                return hit
            try:
                value = tool(self, **arguments)
            except ToolError as exc:
                return {"error": str(exc)}, {}  # an error is not kept for others
            extra = {"keep": (cache_key, ttl)} if cache_key is not None else {}
            if isinstance(value, Output):
                return value.value, {"cost": value.cost, **extra}
            return value, extra

        return run.memoized(key, MemoKind.TOOL, tool.name, fp, produce, turn=turn).output

    def call_tools(self, calls, *, turn=0, prefix=""):
        """Run a turn's tool calls in the model's order; returns the tool messages for the chat.

        Every proposal of the turn is written before any of them is decided, and the run
        resumes only when all are decided.
        """
        keyed = tool_keys(calls, prefix)
        agent_actions.propose_turn(self._run, keyed, turn)
        return [tool_message(call, self.tool(call, key=key, turn=turn)) for key, call in keyed]

    def patched(self, name):
        """True on runs that reach this point with the new code; False on runs that passed it before.

        The first time a run reaches it at its frontier a marker is recorded, so the
        answer stays the same on every later execution of this job.
        """
        run = self._run
        key = run.use_key(f"patch/{name}")
        memo = run.memos.get(key)
        if memo is not None:
            run.visited.add(key)
            return True
        if run.unvisited():
            return False
        run.commit(key, MemoKind.PATCH, str(name)[:100], "", True, turn=0,
                   duration=datetime.timedelta(0))
        return True


def tool_keys(calls, prefix=""):
    """``[(memo key, call)]`` of a turn's tool calls, in the model's order.

    A call's key is its id (its index when it has none); an id the model repeated in
    one turn gets its index too, so each call has a memo of its own.
    """
    keyed, seen = [], set()
    for index, call in enumerate(getattr(calls, "tool_calls", calls)):
        ident = str(call.id or index)
        if ident in seen:
            ident = f"{ident}#{index}"
        seen.add(ident)
        keyed.append((f"{prefix}tool/{ident}", call))
    return keyed


def tool_message(call, result):
    """The chat message that feeds a tool call's result back to the model."""
    return {"role": "tool", "tool_call_id": call.id,
            "content": json.dumps(result, sort_keys=True, default=str)}


class Turn:
    """One model call and the tool calls it asked for; its keys start with ``t<n>/``."""

    def __init__(self, ctx, number):
        self.ctx = ctx
        self.number = number

    def key(self, name):
        return f"t{self.number}/{name}"

    def model(self, messages, **kwargs):
        return self.ctx.model(messages, key=self.key("model"), turn=self.number, **kwargs)

    def call_tools(self, calls):
        return self.ctx.call_tools(calls, turn=self.number, prefix=f"t{self.number}/")

    def tool(self, call, key=None):
        return self.ctx.tool(call, key=self.key(key or f"tool/{call.id}"), turn=self.number)

    def call(self, name, fn, *args, **kwargs):
        return self.ctx.call(self.key(name), fn, *args, turn=self.number, **kwargs)

    def wait_for(self, name, timeout=None):
        """``ctx.wait_for`` keyed ``t<n>/wait/<name>``: one signal per turn."""
        return self.ctx.wait_for(name, timeout, key=self.key(f"wait/{name}"))

    def __repr__(self):
        return f"<Turn {self.number}>"


__all__ = ["AgentContext", "AgentRun", "Turn", "fingerprint", "scrub"]
