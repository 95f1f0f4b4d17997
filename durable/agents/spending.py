"""What an agent's calls spend: budgets reserved before a model call, and the cache that saves.

``guarded`` holds a model call's worst case on every budget that covers the run
(``durable.store.budgets``); the memo's transaction settles it (``AgentRun.commit``).
``cached`` answers a call from a reply another job paid for (``durable.store.cache``).
"""

from ..steps import budgets as step_budgets
from ..store import cache as call_cache


def guarded(run, adapter, name, messages, tools, params, key, holds, call):
    """``call()`` with the call's worst case reserved first on the run's budgets (its hold ids put
    in ``holds``); a model with no price under the job's own budget alone falls back to
    ``run.check_budget`` (the memos spent less than the budget)."""
    claimed = run.claimed
    return step_budgets.guarded(
        holds, lambda: step_budgets.reserve(run.scopes, claimed.id, claimed.lease_token, key, adapter, name, messages,
                                            tools, params, unpriced=run.check_budget),
        call, run.seat.release)


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


__all__ = ["cache_key", "cached", "guarded", "ttl"]
