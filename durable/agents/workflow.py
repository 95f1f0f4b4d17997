"""Agent workflows: the code decides the next call at run time.

    @tool
    def lookup_order(ctx, order_id: str) -> dict:
        return shop.get_order(order_id)

    @tool(action="refund", approval=lambda action, ctx: action.values["amount"] > 100)
    def issue_refund(ctx, order_id: str, amount: int) -> Action:
        return Action("payments", "refunds.create", {"order": order_id, "amount": amount})

    class Support(AgentWorkflow):
        name = "support-agent"
        model = MyModel()                      # anything with .name and .complete()
        tools = [lookup_order, issue_refund]
        max_turns, budget = 8, Decimal("0.40")

        def run(self, ctx, payload):
            chat = [{"role": "user", "content": payload["message"]}]
            for turn in ctx.turns():               # keys t1/..., t2/...
                reply = turn.model(chat)            # memo t{n}/model
                chat.append(reply.message)
                if not reply.tool_calls:
                    return {"answer": reply.text}
                chat.extend(turn.call_tools(reply)) # memo t{n}/tool/<tool_call_id>

``run`` is re-executed from the top each time a worker claims the job; every call with
an effect or a cost goes through ``ctx`` under an explicit key and is found again by
that key (see ``durable.agents.run``). Action tools go through the outbox, maybe after
approval (``durable.agents.tools``); their rows are of the tool-call kind
(``durable.agents.outbox.TOOL_CALL``), which the outbox, approvals and console ask.
"""

import typing

from django.core.exceptions import ImproperlyConfigured

from ..core.workflows import Retry, Step, Workflow, registry
from .base import DONE, RUN, RUNNING, Tool, agent_table
from .outbox import TOOL_CALL
from .run import AgentRun


class AgentWorkflow(Workflow, register=False):
    """Base class of agent workflows: override ``run(ctx, payload)``.

    ``model`` is the model adapter (or override ``get_model(ctx)``), ``tools`` the
    tools the model may call, ``max_turns`` and ``budget`` (money, a Decimal) the
    bounds the engine enforces (a call's worst case is reserved against the budget
    before it goes, ``durable.core.budgets``): reaching either parks the job in
    needs_human, and an operator may grant more (``durable.agent_actions.grant``).
    ``cache`` reuses model replies other jobs paid for (``durable.store.cache``).
    ``call_timeout`` bounds each model and tool call (default: the STEP_TIMEOUT
    setting); ``retry`` is the retry policy of a failed call.
    """

    runs_itself = True
    action_kind = TOOL_CALL
    model = None
    tools: typing.ClassVar[list] = []
    max_turns = 10
    budget = None
    # Reuse a reply another job paid for the same model call (True, or seconds to keep
    # replies): every ``ctx.model`` of the workflow unless the call says otherwise.
    cache = None
    call_timeout = None
    retry = Retry()

    def __init_subclass__(cls, register=True, **kwargs):
        super().__init_subclass__(register=False, **kwargs)
        cls.steps = [Step(func=None, name=RUN, working=RUNNING, done=DONE,
                          timeout=cls.call_timeout, retry=cls.retry, needs_human=True,
                          on_failure="failed")]
        cls.tools_by_name = {}
        for t in cls.tools:
            if not isinstance(t, Tool):
                raise ImproperlyConfigured(
                    f"Workflow {cls.name!r}: {t!r} in tools is not a tool (decorate it with @tool)")
            if t.name in cls.tools_by_name:
                raise ImproperlyConfigured(f"Workflow {cls.name!r}: two tools are named {t.name!r}")
            cls.tools_by_name[t.name] = t
        for t in cls.tools:
            for source in t.prepared_from if isinstance(t.prepared_from, tuple) else ():
                read = cls.tools_by_name.get(source)
                if read is None or read.is_action:
                    raise ImproperlyConfigured(
                        f"Workflow {cls.name!r}: tool {t.name} is prepared from {source!r},"
                        " which is not one of its read-only tools")
        if register and cls.name:
            registry.register(cls)

    @classmethod
    def build_table(cls):
        return agent_table().validate(cls.name)

    def drive(self, started, seat):
        """Run ``run()`` from the top under this claim: the outcome is the engine's runner's to act on."""
        return AgentRun(self, seat, started).go()

    def run(self, ctx, payload):
        raise NotImplementedError(f"{type(self).__name__} must define run(self, ctx, payload)")

    def get_model(self, ctx):
        """The model this run calls; by default the ``model`` attribute."""
        if self.model is None:
            raise ImproperlyConfigured(f"Workflow {self.name!r} has no model")
        return self.model

    def tool_specs(self):
        return [t.spec() for t in self.tools]
