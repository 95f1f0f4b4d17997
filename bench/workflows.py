"""Workflows the benchmark runs: no-op steps, a start-time probe, and one action."""

import os
import time

from durable import Action, Workflow, step


class Noop(Workflow):
    """Three steps that do nothing: what is left is durable's own cost per step."""

    name = "bench_noop"

    @step
    def one(self, payload, ctx):
        return None

    @step
    def two(self, data, ctx):
        return None

    @step
    def three(self, data, ctx):
        return None


class Sleep(Workflow):
    """One step that waits on nothing, as a model or tool call waits on the network."""

    name = "bench_sleep"

    @step(timeout=30)
    def call(self, payload, ctx):
        time.sleep(payload["seconds"])
        return None


class Probe(Workflow):
    """One step that records when it started, to measure submit-to-start latency."""

    name = "bench_probe"

    @step
    def start(self, payload, ctx):
        return {"started": time.time()}


# Only the actions phase declares it (BENCH_ACTIONS=1), so the other figures do not
# depend on the outbox dispatcher being present.
if os.environ.get("BENCH_ACTIONS") == "1":

    class Act(Workflow):
        """One step that sends one action to the benchmark's local receiver."""

        name = "bench_action"

        @step(action=True)
        def send(self, payload, ctx):
            return Action(destination=payload.get("to", "bench"), operation="create",
                          values={"n": payload["n"]})
