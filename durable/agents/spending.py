"""What an agent's calls spend: budgets reserved before a model call, and the cache that saves.

``reserve`` holds a model call's worst case on every budget that covers the run
(``durable.store.budgets``); the memo's transaction settles it (``AgentRun.commit``).
``cached`` answers a call from a reply another job paid for (``durable.store.cache``).
"""

from ..core import budgets as budget_rules
from ..exceptions import PermanentError
from ..steps import budgets as step_budgets
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
    try:
        worst = step_budgets.worst_of(adapter, name, messages, tools, params)
    except budget_rules.BudgetConfigError as exc:
        if all(scope.is_job for scope in run.scopes):
            run.check_budget()
            return ()
        raise PermanentError(str(exc)) from None
    return step_budgets.hold(run.scopes, run.claimed.id, run.claimed.lease_token, key, worst)


def guarded(run, adapter, name, messages, tools, params, key, holds, call):
    """``call()`` with the call's worst case reserved first (its hold ids put in ``holds``)."""
    return step_budgets.guarded(holds, lambda: reserve(run, adapter, name, messages, tools, params, key), call,
                                run.seat.release)


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
