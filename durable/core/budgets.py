"""Budgets as pure rules: what ``DURABLE["BUDGETS"]`` declares, which budgets cover a run,
their periods, and a model call's worst-case cost.

A budget is money a scope may spend on model calls, in ``DURABLE["CURRENCY"]``::

    "BUDGETS": {
        "tenant:*": {"amount": "20.00", "period": "day", "when_over": "wait"},
        "workflow:support-agent": {"amount": "500", "period": "month"},
    }

A pattern ``workflow:<name pattern>`` covers the jobs of the workflows it names; any other
pattern covers the jobs whose budget key (``submit(budget_key=...)``, else the concurrency
key) it matches. Of each kind, the first pattern in the setting's order that covers a job
is its budget; a job's own ``budget`` (the workflow's, or ``submit(budget=...)``) is a
third. Every budget that covers a run must have room for a call before it is made.

``period`` is ``"day"`` or ``"month"`` (UTC, a fresh budget each) or ``"none"``;
``when_over`` says what a run whose next call does not fit does: ``"park"`` (the default:
it waits in needs_human, naming the budget, until a person grants more) or ``"wait"``
(throttled until the next period, no attempt spent).

Before each model call its worst case is reserved (``worst_cost``): the request's tokens
counted at no fewer than they can be (one per byte of its JSON: a byte-level tokenizer
never makes a token of less than a byte), and its ``max_tokens`` written, at the price of
``DURABLE["MODEL_PRICES"]``. The memo's transaction settles it to the real cost. This module
only does the arithmetic; ``durable.store.budgets`` holds the rows.
"""

import datetime
import fnmatch
import json
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from .concurrency import MAX_KEY_LENGTH

WORKFLOW = "workflow:"
JOB = "job:"
PERIODS = ("day", "month", "none")
POLICIES = ("park", "wait")
FIELDS = {
    "amount": "money the scope may spend per period, in DURABLE['CURRENCY'] (a string or Decimal)",
    "period": "'day' or 'month' (UTC; a fresh budget each) or 'none' (default)",
    "when_over": "'park' (default: needs_human until a grant) or 'wait' (until the next period)",
}
# Output tokens reserved for a call that sets no max_tokens (nor the price table a
# "max_output"): the most most models write in one reply.
DEFAULT_MAX_TOKENS = 4096
MILLION = Decimal(1_000_000)
CENT = Decimal("0.000001")


class BudgetConfigError(ValueError):
    """``DURABLE["BUDGETS"]`` (or a call under a budget) is not what it must be; the message says why."""


@dataclass(frozen=True)
class BudgetSpec:
    """One declared budget: its pattern, its amount per period and its policy."""

    pattern: str
    amount: Decimal
    period: str = "none"
    when_over: str = "park"

    @property
    def kind(self):
        return "workflow" if self.pattern.startswith(WORKFLOW) else "key"

    def covers(self, workflow, key):
        if self.kind == "workflow":
            return fnmatch.fnmatchcase(workflow, self.pattern[len(WORKFLOW):])
        return bool(key) and fnmatch.fnmatchcase(key, self.pattern)

    def scope(self, workflow, key):
        """The scope this budget is kept under for a job: ``workflow:<name>`` or the key."""
        return f"{WORKFLOW}{workflow}" if self.kind == "workflow" else key


def money_value(value, what):
    """``value`` as a Decimal of at least 0, or ``BudgetConfigError`` naming ``what``."""
    if isinstance(value, bool) or isinstance(value, float):
        raise BudgetConfigError(f"{what} must be a string or Decimal (money is never a float), not {value!r}")
    try:
        amount = Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise BudgetConfigError(f"{what} is not an amount of money: {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise BudgetConfigError(f"{what} must be an amount of 0 or more, not {value!r}")
    return amount


def parse(setting):
    """The declared budgets in their order, or ``BudgetConfigError`` saying which and why."""
    if setting in (None, {}):
        return ()
    if not isinstance(setting, dict):
        raise BudgetConfigError(f"BUDGETS must be a dict of budgets by pattern, not {type(setting).__name__}")
    specs = []
    for pattern, declared in setting.items():
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_KEY_LENGTH:
            raise BudgetConfigError(f"a budget pattern must be a string of 1 to {MAX_KEY_LENGTH} characters,"
                                    f" not {pattern!r}")
        if pattern.startswith(JOB):
            raise BudgetConfigError(f"BUDGETS[{pattern!r}]: a job's budget is its workflow's `budget` or"
                                    " submit(budget=...), not a pattern")
        if not isinstance(declared, dict):
            declared = {"amount": declared}
        unknown = set(declared) - set(FIELDS)
        if unknown:
            raise BudgetConfigError(f"BUDGETS[{pattern!r}] has unknown keys {sorted(unknown)};"
                                    f" a budget declares {', '.join(FIELDS)}")
        if "amount" not in declared:
            raise BudgetConfigError(f"BUDGETS[{pattern!r}] declares no amount")
        amount = money_value(declared["amount"], f"BUDGETS[{pattern!r}]['amount']")
        period = declared.get("period", "none")
        if period not in PERIODS:
            raise BudgetConfigError(f"BUDGETS[{pattern!r}]['period'] must be one of {', '.join(PERIODS)},"
                                    f" not {period!r}")
        policy = declared.get("when_over", "park")
        if policy not in POLICIES:
            raise BudgetConfigError(f"BUDGETS[{pattern!r}]['when_over'] must be one of {', '.join(POLICIES)},"
                                    f" not {policy!r}")
        if policy == "wait" and period == "none":
            raise BudgetConfigError(f"BUDGETS[{pattern!r}]: 'wait' waits for the next period, and"
                                    " 'none' has none; declare a period or park")
        specs.append(BudgetSpec(pattern, amount, period, policy))
    return tuple(specs)


def covering(specs, workflow, key):
    """The declared budgets that cover a job of ``workflow`` with budget key ``key``: the
    first of each kind (workflow, key) in the setting's order."""
    found = {}
    for spec in specs:
        if spec.kind not in found and spec.covers(workflow, key):
            found[spec.kind] = spec
    return tuple(found.values())


def period_of(period, now):
    """``(key, start, end)`` of the period ``now`` falls in (UTC); ``("", None, None)`` for none."""
    now = now.astimezone(datetime.UTC)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.strftime("%Y-%m-%d"), start, start + datetime.timedelta(days=1)
    if period == "month":
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (start + datetime.timedelta(days=32)).replace(day=1)
        return start.strftime("%Y-%m"), start, end
    return "", None, None


def worst_input_tokens(messages, tools=None):
    """The most tokens a request can count: one per byte of its JSON (messages and tools).

    A byte-level tokenizer (OpenAI's, Anthropic's) never makes a token of less than one
    byte, and the JSON's quotes and braces outnumber the few tokens a provider adds per
    message. A bound, not an estimate: it errs by the bytes per token, which the memo's
    settlement gives back right after the call.
    """
    return len(json.dumps([messages, tools or []], default=str, separators=(",", ":"),
                          ensure_ascii=False).encode())


def worst_cost(model, input_tokens, max_tokens, prices):
    """The most a call of ``model`` can cost: ``input_tokens`` in and ``max_tokens`` out at the
    price table's prices (``BudgetConfigError`` when the table has no price for it).

    ``max_tokens`` None: the table's ``max_output`` for the model, else ``DEFAULT_MAX_TOKENS``.
    """
    entry = price_entry(model, prices)
    if entry is None:
        raise BudgetConfigError(
            f"the model {model!r} has no price in DURABLE['MODEL_PRICES']: a budget cannot bound what"
            " its calls cost; add its input and output prices per million tokens")
    input_price = money_value(entry.get("input", 0), f"MODEL_PRICES[{model!r}]['input']")
    output_price = money_value(entry.get("output", 0), f"MODEL_PRICES[{model!r}]['output']")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        max_tokens = int(entry.get("max_output") or DEFAULT_MAX_TOKENS)
    cost = (input_price * int(input_tokens) + output_price * int(max_tokens)) / MILLION
    return cost.quantize(CENT, rounding="ROUND_CEILING")


def price_entry(model, prices):
    """The price table's entry for ``model``: its own, or the longest name it starts with."""
    entry = prices.get(model)
    if entry is None:
        matches = [name for name in prices if model.startswith(name)]
        entry = prices[max(matches, key=len)] if matches else None
    return entry


__all__ = ["BudgetConfigError", "BudgetSpec", "DEFAULT_MAX_TOKENS", "covering", "money_value", "parse",
           "period_of", "price_entry", "worst_cost", "worst_input_tokens"]
