"""A workflow whose proposal is prepared from earlier steps' memos, not by the action step.

``quote`` reads an order record (the same file format as the refund workflows), prices
it in a second step (a priced model call), and only then proposes the action from the
price memo. Its input version is the record's version, read live: when the record
changes, the proposal is stale, and so are the memos it was prepared from.
"""

from decimal import Decimal

from durable import Action, Output, Workflow, step

from .approval_workflows import read_order
from .workflows import record


class Quote(Workflow):
    name = "quote"

    @step(working="reading", done="read")
    def read(self, payload, ctx):
        record(payload, f"{ctx.job_id} read")
        order = read_order(payload["order_file"])
        return {"order": order["id"], "amount": order["amount"], "version": order["version"]}

    @step(working="pricing", done="priced")
    def price(self, order, ctx):
        record(ctx.payload, f"{ctx.job_id} price v{order['version']}")
        return Output({**order, "total": str(Decimal(order["amount"]) * 2)},
                      cost=Decimal("0.000807"))

    @step(working="sending", done="sent", approval=True)
    def send(self, priced, ctx):
        return Action("refunds", "refund", {"order": priced["order"], "amount": priced["total"]})

    def input_version(self, job, ctx):
        return f"order {read_order(job.payload['order_file'])['version']}"

    def summarize(self, action, ctx):
        return f"Quote {action.values['amount']} for order #{action.values['order']}"
