"""Job priorities: their range, and the order the claim takes due jobs in.

A job's priority (``Job.priority``) gives it a head start (``Job.head_start``, fixed at
submit): the claim counts it due that much earlier than it is, and takes the due job
first in that order (``ClaimOrder``), which the index ``durable_job_claim_order`` holds.
"""

from django.db import models
from django.db.models import F
from django.db.models.expressions import DurationExpression

# The range of Job.priority: Django's task priorities, higher first.
MIN_PRIORITY, MAX_PRIORITY = -100, 100

# The claim's order spelled by each database with statements of its own, so that an index
# can hold it: a job's next_run_at less its head start. Index expressions must be
# immutable: on PostgreSQL ``timestamptz - interval`` depends on the session's time zone
# (a day is not always 24 hours there), so the interval is taken from the UTC timestamp;
# SQLite stores the head start as microseconds and subtracts it from the julian day
# (to SQLite's millisecond, the order's tie-break next_run_at keeps the rest).
CLAIM_ORDER_SQL = {
    "postgresql": "({next_run_at} AT TIME ZONE 'UTC') - {head_start}",
    "sqlite": "julianday({next_run_at}) - {head_start} / 86400000000.0",
}


def claim_order_sql(vendor):
    """The claim's order as the store's statements on ``vendor`` write it, over the job's own columns."""
    return CLAIM_ORDER_SQL[vendor].format(next_run_at="next_run_at", head_start="head_start")


class ClaimOrder(models.Func):
    """The moment the claim counts a job due by: ``next_run_at - head_start``.

    The claim takes the due job first in this order (then by ``next_run_at``), and the
    index ``durable_job_claim_order`` holds it. An order, not a value to select: its
    type differs by database (a UTC timestamp on PostgreSQL, a julian day on SQLite).
    The store's claim statements spell it as ``CLAIM_ORDER_SQL`` does, which the planner
    needs to match them to the index.
    """

    output_field = models.DateTimeField()

    def __init__(self):
        super().__init__(F("next_run_at"), F("head_start"))

    def as_sql(self, compiler, connection, **extra_context):
        # Any other database: Django's own datetime less a duration.
        next_run_at, head_start = self.get_source_expressions()
        return compiler.compile(DurationExpression(next_run_at, "-", head_start))

    def _spelled(self, compiler, spelling):
        (next_run_at, p1), (head_start, p2) = (compiler.compile(e) for e in self.get_source_expressions())
        return f"({spelling.format(next_run_at=next_run_at, head_start=head_start)})", [*p1, *p2]

    def as_postgresql(self, compiler, connection, **extra_context):
        return self._spelled(compiler, CLAIM_ORDER_SQL["postgresql"])

    def as_sqlite(self, compiler, connection, **extra_context):
        return self._spelled(compiler, CLAIM_ORDER_SQL["sqlite"])
