"""Workflows with actions, and the destination the outbox tests send them to.

The destination ``test_receiver`` reads where the receiver is from the environment
each time it is used (``DURABLE_TEST_RECEIVER_*``), so a test and the worker
subprocesses it starts (which inherit its environment) send to the same receiver.
Tests that configure ``DURABLE["DESTINATIONS"]`` instead name their destination in
the payload (``{"destination": "crm"}``).
"""

import os

from durable import Action, Retry, Workflow, step
from durable.actions.destinations import Destination, HttpDestination, register

# Fast retries and lookups, so a test waits milliseconds, not the production backoff.
FAST = Retry(max_attempts=3, base=0.05, cap=0.2)


class ReceiverFromEnvironment(Destination):
    """An HttpDestination for the receiver named by DURABLE_TEST_RECEIVER_URL."""

    def __init__(self, name):
        super().__init__(name)
        self._built = (None, None)

    def current(self):
        env = os.environ
        config = (
            env.get("DURABLE_TEST_RECEIVER_URL", "http://127.0.0.1:9"),
            env.get("DURABLE_TEST_RECEIVER_IDEMPOTENT", "1") == "1",
            env.get("DURABLE_TEST_RECEIVER_LOOKUP", "1") == "1",
            float(env.get("DURABLE_TEST_RECEIVER_READ_TIMEOUT", "1.0")),
        )
        if self._built[0] != config:
            url, idempotent, lookup, read = config
            self._built = (config, HttpDestination(
                self.name, url=f"{url}/actions", idempotent=idempotent,
                lookup_url=f"{url}/actions/lookup?key={{key}}" if lookup else None,
                timeout=(1.0, read),
            ))
        return self._built[1]

    @property
    def idempotent(self):
        return self.current().idempotent

    @idempotent.setter
    def idempotent(self, value):
        pass  # decided by the environment

    @property
    def supports_lookup(self):
        return self.current().supports_lookup

    @property
    def timeout(self):
        return self.current().timeout

    def dispatch(self, request):
        return self.current().dispatch(request)

    def lookup(self, request):
        return self.current().lookup(request)

    def redact(self, text):
        return self.current().redact(text)


register(ReceiverFromEnvironment("test_receiver"))


class Ticket(Workflow):
    """Prepare a ticket, create it at the destination (an action), then read its id."""

    name = "ticket"

    @step
    def prepare(self, payload, ctx):
        return {"subject": payload.get("subject", "Printer on fire"),
                "customer": payload.get("customer", "c-1")}

    @step(action=True, retry=FAST)
    def create_ticket(self, data, ctx):
        return Action(
            destination=ctx.payload.get("destination", "test_receiver"),
            operation=ctx.payload.get("operation", "create_ticket"),
            values={"subject": data["subject"], "customer": data["customer"]},
            summary=f"Create a ticket for {data['customer']}",
        )

    @step
    def confirm(self, memo, ctx):
        return {"ticket": memo["remote_id"], "how": memo["confirmed_by"]}


class Notify(Workflow):
    """One action and nothing else: the action's confirmed result is the job's result."""

    name = "notify"

    @step(action=True, retry=FAST)
    def send(self, payload, ctx):
        return Action(payload.get("destination", "test_receiver"), "notify",
                      {"to": payload.get("to", "ops"), "n": payload.get("n", 0)})


class NotifyMany(Workflow):
    """Spawns ``payload["children"]`` notify children and joins them: each child ends on its action."""

    name = "notify_many"

    @step(joins=True)
    def fan_out(self, payload, ctx):
        kids = ctx.spawn_many("notify", {f"{i:02d}": {"n": i} for i in range(payload["children"])})
        outcomes = ctx.join(kids)
        return {"outcomes": sorted(v["outcome"] for v in outcomes.values())}


class BadAction(Workflow):
    """An action step that returns what the payload says, valid or not."""

    name = "bad_action"

    @step(action=True, retry=FAST)
    def send(self, payload, ctx):
        kind = payload["kind"]
        if kind == "unknown_destination":
            return Action("nowhere", "notify", {"x": 1})
        if kind == "not_json":
            return Action("test_receiver", "notify", {"x": object()})
        if kind == "not_an_action":
            return {"x": 1}
        return Action("test_receiver", "notify", {"x": 1})


class Approved(Workflow):
    """An action that needs approval (refused with a clear error without the machinery)."""

    name = "actions_needing_approval"

    @step(action=True, approval=True, retry=FAST)
    def send(self, payload, ctx):
        return Action("test_receiver", "notify", {"x": 1})
