"""Money paid and money the cache saved, over a range of memos, per workflow, model, tool or tenant.

A memo records what its step, model call or tool call cost (``cost``); one answered from
the model-call cache cost nothing and records what it saved (``cost_saved``, the price
the reply was paid at by the job that made the call). This module reads the memos written
in a range (the ``at`` index) in one grouped query; it reads no rollup: what a rollup
keeps of purged jobs has no saved half, so this split covers the memos still kept.
"""

from dataclasses import dataclass
from decimal import Decimal

from django.db.models import Count, Q, Sum

from ..models import MemoKind, StepResult

ZERO = Decimal(0)
# Money has the precision of the memo's columns, whatever the database's arithmetic returned.
PLACES = Decimal("0.000001")
# The groupings, and the memo columns each reads (tenant: the job's budget key, else its
# concurrency key, as budgets match a job).
GROUPS = {
    "workflow": ("workflow",),
    "model": ("model",),
    "tool": ("name",),
    "tenant": ("job__budget_key", "job__concurrency_key"),
}
NONE = "—"


@dataclass
class SpendRow:
    """One group's money: paid, saved, and the memos that paid or saved it."""

    name: str
    paid: Decimal = ZERO
    saved: Decimal = ZERO
    memos: int = 0
    answered_by_cache: int = 0

    @property
    def total(self):
        """What the calls would have cost with no cache."""
        return self.paid + self.saved

    @property
    def saved_share(self):
        """The percentage of ``total`` the cache saved, whole (None: nothing to share)."""
        return round(100 * self.saved / self.total) if self.total else None


def _name(by, row):
    if by == "tenant":
        return row["job__budget_key"] or row["job__concurrency_key"] or NONE
    return row[GROUPS[by][0]] or NONE


def paid_and_saved(start, end, *, by="workflow", workflow=None):
    """Per group, the money memos written in ``[start, end)`` paid and what the cache saved.

    ``by``: ``workflow``, ``model`` (a memo that is not a model call has none: ``—``),
    ``tool`` (tool calls only, by the tool's name) or ``tenant`` (the job's budget key,
    else its concurrency key, else ``—``). Returns ``{"rows": [SpendRow], "paid", "saved", "total"}``,
    the rows with the most money first. One query.
    """
    if by not in GROUPS:
        raise ValueError(f"paid_and_saved groups by {', '.join(GROUPS)}, not {by!r}")
    memos = StepResult.objects.filter(at__gte=start, at__lt=end)
    if workflow:
        memos = memos.filter(workflow=workflow)
    if by == "tool":
        memos = memos.filter(kind=MemoKind.TOOL)
    grouped = (memos.values(*GROUPS[by]).order_by()
               .annotate(paid=Sum("cost"), saved=Sum("cost_saved"), n=Count("pk"),
                         hits=Count("pk", filter=Q(cost_saved__gt=0))))
    rows = {}
    for group in grouped:
        name = _name(by, group)
        row = rows.setdefault(name, SpendRow(name))
        row.paid += Decimal(group["paid"] or 0).quantize(PLACES)
        row.saved += Decimal(group["saved"] or 0).quantize(PLACES)
        row.memos += group["n"]
        row.answered_by_cache += group["hits"]
    found = sorted((r for r in rows.values() if r.memos), key=lambda r: (-r.total, r.name))
    paid, saved = sum((r.paid for r in found), ZERO), sum((r.saved for r in found), ZERO)
    return {"rows": found, "paid": paid, "saved": saved, "total": paid + saved}


__all__ = ["GROUPS", "SpendRow", "paid_and_saved"]
