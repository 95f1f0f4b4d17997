"""What an agent's calls spend: budgets reserved before a model call, and the cache that saves.

``reserve`` holds a model call's worst case on every budget that covers the run
(``durable.store.budgets``); the memo's transaction settles it (``AgentRun.commit``).
``cached`` answers a call from a reply another job paid for (``durable.store.cache``).
"""

from ..conf import durable_settings
from ..core import budgets as budget_rules
from ..core.workflows import NeedsHuman
from ..exceptions import PermanentError
from ..steps.limits import Throttled
from ..store import budgets
from ..store import cache as call_cache


def reserve(run, adapter, name, messages, tools, params, key):
    """Before a model call: its worst case held on every budget that covers ``run``.

    The holds' ids; ``NeedsHuman`` or ``Throttled`` (the budget's ``when_over``) when one
    has no room. A model with no price under the run's own budget alone falls back to
    ``run.check_budget`` (the memos spent less than the budget); under a declared budget
    it is a configuration error, and the job fails saying so.
    """
    if not run.scopes:
        return ()
    out = params.get("max_tokens") or params.get("max_completion_tokens") \
        or getattr(adapter, "defaults", {}).get("max_tokens")
    counted = getattr(adapter, "count_tokens", None)
    tokens = counted(messages, tools) if counted is not None else budget_rules.worst_input_tokens(messages, tools)
    prices = getattr(adapter, "prices", None)
    try:
        worst = budget_rules.worst_cost(name, tokens, out, durable_settings.MODEL_PRICES if prices is None else prices)
    except budget_rules.BudgetConfigError as exc:
        if all(scope.is_job for scope in run.scopes):
            run.check_budget()
            return ()
        raise PermanentError(str(exc)) from None
    try:
        return budgets.reserve(run.claimed.id, run.claimed.lease_token, key, worst, run.scopes)
    except budgets.OverBudget as over:
        if over.when_over == "wait" and over.until is not None:
            raise Throttled(over.until, str(over)) from None
        raise NeedsHuman(str(over)) from None


def guarded(run, adapter, name, messages, tools, params, key, holds, call):
    """``call()`` with the call's worst case reserved first (its hold ids put in ``holds``);
    a call that fails gives them back or writes them off (``budgets.unwind``)."""
    holds[:] = reserve(run, adapter, name, messages, tools, params, key)
    try:
        return call()
    except BaseException as exc:
        budgets.unwind(holds, exc)
        raise


def ttl(cache):
    """Seconds a call's result is cached (0: not cached), from a call site's or tool's ``cache``."""
    return call_cache.ttl_of(cache) if cache not in (None, False, 0) else 0


def cache_key(kind, name, fingerprint, seconds):
    """The call's key in the cache, or None when it is not cached."""
    return call_cache.key_for(kind, name, fingerprint) if seconds else None


def cached(key, model=None):
    """A hit for ``key`` as ``(output, extra)`` for the memo (cost 0, what it saved), or None.

    With ``model`` (the name the call asked for), a model reply: its memo says it came
    from the cache, at no cost, and what it saved.
    """
    if key is None:
        return None
    hit = call_cache.lookup(key)
    if hit is None:
        return None
    output, saved, answered = hit
    if model is None:
        return output, {"hit": (key, saved)}
    kept = {**output, "cost": "0", "priced": "cache", "saved": str(saved)}
    return kept, {"model": answered or model, "hit": (key, saved)}


__all__ = ["cache_key", "cached", "guarded", "reserve", "ttl"]
