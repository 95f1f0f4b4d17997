"""What a step sees of its job: ``ctx``, passed to every step function.

Ids, the attempt, earlier memos, the cost it records, durable timers, and the waits:
``ctx.wait_for`` reads the job's inbox (``durable.steps.inbox``); ``ctx.spawn`` and
``ctx.join`` submit and join child jobs (``durable.steps.children``).
"""

import datetime
from decimal import Decimal

from ..core.workflows import Wait
from . import children as children_
from . import inbox


class Context:
    """What a step sees of its job: ids, the attempt, earlier memos, cost and timers."""

    def __init__(self, *, job_id, workflow, step, attempt, payload, memos, db_now, wake_at=None,
                 lease_token=None, enqueued_at=None, first_claim=False, worker=None):
        self.job_id = job_id
        # When the job was submitted (the database's stamp), whether this worker's claim
        # was its first (nothing ran or waited before it), and the worker's id.
        self.enqueued_at = enqueued_at
        self.first_claim = first_claim
        self.worker = worker
        self.lease_token = lease_token
        self._keys = {}
        self.workflow = workflow
        self.step = step
        self.attempt = attempt
        self.payload = payload
        self.memos = memos
        self.db_now = db_now
        self._wake_at = wake_at
        self.cost_total = Decimal(0)

    def cost(self, amount):
        """Add ``amount`` (money: a Decimal or a string) to this step's recorded cost."""
        self.cost_total += Decimal(str(amount))

    @property
    def woken(self):
        """Whether this run is the wake-up of a timer this step set."""
        return self._wake_at is not None and self.db_now >= self._wake_at

    def sleep_until(self, when):
        """Wait durably until ``when``: the first call sets the timer, re-runs after it return."""
        if self.woken:
            return
        raise Wait(self._wake_at or when)

    def sleep(self, seconds):
        """Wait durably for ``seconds`` from the first time this step asked."""
        self.sleep_until(self.db_now + datetime.timedelta(seconds=seconds))

    def key(self, kind, name):
        """The stable key of this step's next ``kind`` call on ``name``: ``<step>/wait/<name>``.

        A second call with the same kind and name in one run of the step gets ``#2``,
        and so on: a loop that waits on one name reads successive signals.
        """
        base = f"{self.step}/{kind}/{name}" if name else f"{self.step}/{kind}"
        count = self._keys[base] = self._keys.get(base, 0) + 1
        return base if count == 1 else f"{base}#{count}"

    def wait_for(self, name, timeout=None):
        """The payload of the oldest unconsumed signal ``name``, or ``durable.TIMED_OUT``.

        Without one the step parks (declare it with ``signals=True``), holding no worker
        and no lease, until such a signal arrives or ``timeout`` (seconds or a timedelta
        from the first time this step asked) passes. Recorded once: a re-run of the
        step returns the same payload, or TIMED_OUT again.
        """
        return inbox.wait_for(self, name, timeout)

    def spawn(self, workflow, key, payload, queue="default"):
        """Submit one child job ``<job>/<workflow>/<key>`` linked to this one; returns its id."""
        return self.spawn_many(workflow, {key: payload}, queue=queue)[0]

    def spawn_many(self, workflow, children, queue="default"):
        """Submit the child jobs ``{key: payload}`` in one transaction (all or none); their ids."""
        return children_.spawn_many(self, workflow, children, queue=queue)

    def join(self, children, timeout=None):
        """``{child id: outcome}`` in key order once every child finished; parks until then.

        An outcome is ``{"outcome": "ok", "state", "result"}``, ``"failed"`` (with
        ``error``), ``"cancelled"``, or past ``timeout`` ``"timed_out"`` for a child
        still running. Declare the step with ``joins=True``. Recorded once.
        """
        return children_.join(self, children, timeout)
