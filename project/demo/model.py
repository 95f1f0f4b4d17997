"""A simulated extraction model: slow, priced per token, sometimes overloaded.

It behaves like the hosted model a real pipeline would call, without a network:
each call takes a moment, costs money (input and output tokens at a list price),
fails now and then with a transient "overloaded" error worth retrying, and fails
for good on a document it cannot read. Outcomes are seeded by the job and the
attempt, so a run can be replayed and a retry may succeed where the first try did not.
"""

import random
import re
import time
from decimal import Decimal

from durable import PermanentError, RetryableError

# Prices per thousand tokens, in US dollars like a hosted model's price list (DURABLE["CURRENCY"]).
INPUT_PRICE = Decimal("0.0030")
OUTPUT_PRICE = Decimal("0.0150")
# Share of first attempts that find the model overloaded.
OVERLOAD_RATE = 0.15


class ModelOverloaded(RetryableError):
    """The model service is overloaded (HTTP 529). Retryable: nothing was produced or billed."""


class UnreadableDocument(PermanentError):
    """The document has none of the fields a lead has. Poison: retrying reads the same text."""


_FIELDS = {
    "contact": re.compile(r"^From:\s*(?P<v>[^<\n]+?)\s*<", re.M),
    "email": re.compile(r"<(?P<v>[^>\s]+@[^>\s]+)>", re.M),
    "company": re.compile(r"^Company:\s*(?P<v>.+)$", re.M),
    "request": re.compile(r"^Request:\s*(?P<v>.+)$", re.M),
    "budget": re.compile(r"^Budget:\s*(?P<v>.+)$", re.M),
}


def tokens(text):
    """A rough token count (four characters a token)."""
    return max(1, len(text) // 4)


def price(input_tokens, output_tokens):
    """What a call costs, in US dollars, as a Decimal (money is never a float)."""
    cost = (INPUT_PRICE * input_tokens + OUTPUT_PRICE * output_tokens) / 1000
    return cost.quantize(Decimal("0.000001"))


def extract(text, *, seed, attempt, speed=1.0):
    """Read a lead from ``text``: ``(fields, cost)``; may raise the two errors above."""
    rng = random.Random(f"{seed}:{attempt}")
    time.sleep((0.3 + rng.random() * 0.7) * speed)
    if attempt == 1 and rng.random() < OVERLOAD_RATE:
        raise ModelOverloaded("model overloaded (HTTP 529); try again in a moment",
                              retry_after=0.5 * speed)
    found = {name: m["v"].strip() for name, p in _FIELDS.items() if (m := p.search(text))}
    if not {"contact", "company", "budget"} <= found.keys():
        raise UnreadableDocument(f"no lead in this document (found {sorted(found) or 'nothing'})")
    amount, confidence = _amount(found.pop("budget"))
    fields = {**found, "amount": amount, "currency": "EUR", "confidence": confidence}
    return fields, price(tokens(text), tokens(str(fields)))


def _amount(text):
    """The budget in euros and how sure the model is of it."""
    exact = re.fullmatch(r"([\d,]+)\s*EUR", text)
    if exact:
        return int(exact[1].replace(",", "")), 0.97
    rough = re.search(r"(\d+)\s*k\b", text)
    if rough:
        return int(rough[1]) * 1000, 0.45
    return 0, 0.1
