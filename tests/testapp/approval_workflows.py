"""Workflows whose actions need approval: refunds against an order record kept in a file.

The order record stands for the rows a plan is prepared from. Tests (and operators in
the drills) change it between proposal and dispatch; its ``version`` is the input
version, so a changed record makes an approval stale. Steps that record executions
append to the payload's ``log`` file (see ``record``).
"""

import json
import os
from decimal import Decimal

from durable import Action, Output, Workflow, step

from .workflows import record

# Worker subprocesses find the test's receiver here (see use_refunds_receiver).
REFUNDS_URL_ENV = "DURABLE_TEST_REFUNDS_URL"


def read_order(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_order(path, **changes):
    """Create or change the order record; every write bumps its version."""
    order = read_order(path) if os.path.exists(path) else {"version": 0}
    order.update(changes)
    order["version"] += 1
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(order, f)
    os.replace(tmp, path)
    return order


class Refund(Workflow):
    """Assess a complaint (a model call), then refund the order: always approved by a person."""

    name = "refund"

    @step(working="assessing", done="assessed")
    def assess(self, payload, ctx):
        record(payload, f"{ctx.job_id} assess")
        return Output({"reason": payload.get("reason", "damaged in transit")}, cost=Decimal("0.02"))

    # The action step reads the record itself (prepared_from=()): a proposal prepared
    # again starts from what the record says now, and the assessment is kept.
    @step(working="proposing", done="refunded", approval=True, prepared_from=())
    def refund(self, data, ctx):
        order = read_order(ctx.payload["order_file"])
        record(ctx.payload, f"{ctx.job_id} propose v{order['version']}")
        ctx.cost("0.01")
        return Action(
            destination=ctx.payload.get("destination", "refunds"),
            operation="refund",
            values={
                "order": order["id"],
                "amount": Decimal(order["amount"]),
                "currency": order.get("currency", "EUR"),
                "reason": data["reason"],
                "status": "refunded",
            },
        )

    def input_version(self, job, ctx):
        return f"order {read_order(job.payload['order_file'])['version']}"

    def summarize(self, action, ctx):
        v = action.values
        return f"Refund {v['currency']} {v['amount']} to order #{v['order']}"

    def current_record(self, action, ctx):
        order = read_order(ctx.payload["order_file"])
        return {"order": order["id"], "amount": order["amount"],
                "currency": order.get("currency", "EUR"), "status": order.get("status", "paid")}


class RefundAbove(Refund):
    """Refunds that need approval only above 100: small ones go straight to the outbox."""

    name = "refund_above"

    @step(working="proposing", done="refunded", prepared_from=(),
          approval=lambda action, ctx: Decimal(str(action.values["amount"])) > 100)
    def refund(self, data, ctx):
        return Refund.refund(self, data, ctx)


class RefundReview(Refund):
    """Rejections go to a person (needs_human) rather than cancelling; approvals last 10 minutes."""

    name = "refund_review"

    @step(working="proposing", done="refunded", approval=True, approval_expiry=600,
          on_reject="needs_human", prepared_from=())
    def refund(self, data, ctx):
        return Refund.refund(self, data, ctx)


def use_refunds_receiver(url):
    """Point the ``refunds`` destination at a durable.testing receiver (deduplicating, with lookup)."""
    from durable.actions.destinations import HttpDestination, register

    return register(HttpDestination(
        "refunds", url=f"{url}/actions", idempotent=True,
        lookup_url=f"{url}/actions/lookup?key={{key}}", timeout=(1.0, 2.0),
    ))


if os.environ.get(REFUNDS_URL_ENV):
    use_refunds_receiver(os.environ[REFUNDS_URL_ENV])
