"""A model call under budgets: its worst case held before it goes, its cost settled after.

``hold`` reserves a call's worst case (``durable.core.budgets.worst_cost``) on every budget
that covers the job (``durable.store.budgets``), or stops the job: a budget whose
``when_over`` is ``"wait"`` hands it back until its next period (``Throttled``), one that
parks asks a person (``NeedsHuman``, naming the budget). ``guarded`` wraps the call: one
that fails gives its holds back when the provider surely billed nothing, and writes them
off at their worst case otherwise. An agent's memo settles its holds in the memo's
transaction (``durable.agents.run``); a pipeline step's call settles right after its
reply (``in_step``), since the step's memo comes only when the whole step ends.
"""

from ..conf import durable_settings
from ..core import budgets as rules
from ..core.workflows import NeedsHuman
from ..exceptions import PermanentError
from ..store import budgets
from .limits import Throttled, current_step, step_call_key
from .limits import in_step as paced_in_step


def worst_of(adapter, name, messages, tools, params):
    """The most the call can cost (``BudgetConfigError`` when its model has no price)."""
    out = params.get("max_tokens") or params.get("max_completion_tokens") \
        or getattr(adapter, "defaults", {}).get("max_tokens")
    counted = getattr(adapter, "count_tokens", None)
    tokens = counted(messages, tools) if counted is not None else rules.worst_input_tokens(messages, tools)
    prices = getattr(adapter, "prices", None)
    return rules.worst_cost(name, tokens, out, durable_settings.MODEL_PRICES if prices is None else prices)


def reserve(scopes, job_id, lease_token, key, adapter, name, messages, tools, params, unpriced=None):
    """A model call's worst case held on ``scopes``: its holds, or the job stops as the budget says.

    A model with no price cannot be bounded: under a declared budget the job fails saying so;
    under its own budget alone, ``unpriced()`` decides when given (an agent falls back to its
    memos' ledger).
    """
    if not scopes:
        return ()
    try:
        worst = worst_of(adapter, name, messages, tools, params)
    except rules.BudgetConfigError as exc:
        if unpriced is not None and all(scope.is_job for scope in scopes):
            unpriced()
            return ()
        raise PermanentError(str(exc)) from None
    return hold(scopes, job_id, lease_token, key, worst)


def hold(scopes, job_id, lease_token, key, worst):
    """Reserve ``worst`` on ``scopes``: the holds' ids, or the job stops as the budget says."""
    try:
        return budgets.reserve(job_id, lease_token, key, worst, scopes)
    except budgets.OverBudget as over:
        if over.when_over == "wait" and over.until is not None:
            raise Throttled(over.until, str(over)) from None
        raise NeedsHuman(str(over)) from None


def guarded(holds, reserve, call, release=None):
    """``call()`` once ``reserve()`` put the call's hold ids in ``holds``; a call that fails
    gives them back or writes them off (``budgets.unwind``). ``release`` gives the thread's
    connection back between the reservation and the call, which waits on the network."""
    holds[:] = reserve()
    if holds and release is not None:
        release()
    try:
        return call()
    except BaseException as exc:
        budgets.unwind(holds, exc)
        raise


def in_step(adapter, messages, tools, params, call):
    """A model adapter's call: from a step function, reserved on the job's budgets and settled
    from its reply's cost at once, then paced under the provider's limits (``steps.limits.in_step``)."""
    here = current_step()
    if here is None:
        return call()
    return paced_in_step(adapter, messages, tools, params,
                         budgeted(adapter, messages, tools, params, call, here, step_call_key(here, ahead=1)))


def budgeted(adapter, messages, tools, params, call, here, key):
    """``call``, reserved on the budgets that cover the step's job (``here``) and settled after."""
    scopes = here.get("scopes")
    if scopes is None:
        from ..models import Job

        row = Job.objects.filter(pk=here["job_id"]).values_list(
            "workflow", "budget_key", "concurrency_key", "budget").first() or ("", "", None, None)
        scopes = here["scopes"] = budgets.scopes_for(here["job_id"], row[0], budgets.key_of(row[1], row[2]), row[3])
    if not scopes:
        return call
    name = str(getattr(adapter, "model", "") or type(adapter).__name__)

    def budgeted():
        holds = []
        reply = guarded(holds, lambda: reserve(scopes, here["job_id"], here["lease_token"], key, adapter, name,
                                               messages, tools, params), call, here.get("release"))
        budgets.settle(holds, getattr(reply, "cost", 0) or 0)
        return reply

    return budgeted


__all__ = ["budgeted", "guarded", "hold", "in_step", "reserve", "worst_of"]
