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
that key (see ``durable.agent_run``). Action tools go through the outbox, maybe after
approval (``durable.agent_actions``).
"""

import typing
from dataclasses import dataclass, field

from django.core.exceptions import ImproperlyConfigured

from ..core.states import CANCELLED, INITIAL, NEEDS_HUMAN, StateKind, StepStates, TransitionTable
from ..core.workflows import Retry, Step, Workflow, registry
from ..exceptions import DurableError
from .llm import ModelReply, ModelReplyInvalid, ToolCall
from .toolschema import ToolSchemaError, schema_for, validate_arguments

# The states of every agent workflow.
PENDING = INITIAL
RUNNING = "running"
AWAITING_APPROVAL = "awaiting_approval"
IN_FLIGHT = "action_in_flight"
UNKNOWN = "action_unknown"
WAITING = "waiting"  # ctx.wait_for(): parked until a signal or the deadline
JOINING = "joining"  # ctx.join(): parked until the last child finishes or the deadline
DONE = "done"
FAILED = "failed"
RUN = "run"  # the one step of the table: run() from the top


class DuplicateKey(DurableError):
    """A key was used twice in one execution of run(): a bug in the workflow's code."""


class Divergence(DurableError):
    """At a stored key, the code asked for something other than what the memo holds."""


class ToolError(Exception):
    """Raised by a tool: this message goes back to the model as the tool's error result."""


class Suspended(Exception):  # noqa: N818 - a signal, not an error
    """The run parked the job (approval, action in flight): it has left this worker."""

    def __init__(self, outcome, message=""):
        super().__init__(message or outcome)
        self.outcome = outcome


# What a model is ------------------------------------------------------------------------


@typing.runtime_checkable
class Model(typing.Protocol):
    """What a model adapter implements (``durable.llm.OpenAIChat`` is one).

    ``model`` names the model; ``complete(messages, tools=...)`` makes one paid call and
    returns a ``durable.llm.ModelReply`` (message, tool calls with their ids, tokens,
    model, cost). It raises ``durable.RetryableError`` for a failure worth another
    attempt, ``durable.PermanentError`` for one that is not, and
    ``durable.llm.ModelReplyInvalid`` (retryable, with the raw reply) for a reply it
    cannot parse. An optional ``fingerprint_input(messages, tools)`` says what
    identifies a call; by default the model, the messages and the tools do.
    """

    model: str

    def complete(self, messages, tools=None, **params) -> ModelReply: ...


# Tools ------------------------------------------------------------------------------------

ON_REJECT = ("note", "cancel")


@dataclass
class Tool:
    """A function the model may call: read-only (a memoized call) or an action tool.

    An action tool returns a ``durable.Action``; the outbox sends it (attempted before
    send, a stable idempotency key bound to its values, unknown as a state). ``kind``
    names the action: a job performs one action of a kind unless ``many=True``.
    ``approval`` (True, or a predicate ``(action, ctx) -> bool``) asks a person first;
    ``on_reject="note"`` tells the model the call was declined (the decider's message
    to the model, never their internal note) and the run goes on; ``"cancel"``
    cancels the job. ``prepared_from`` names what an approved call was prepared from:
    a function ``(ctx, arguments) -> record`` that reads the record again, or the names
    of read-only tools whose results the model read. Right before an approved call is
    sent, they are read again; if anything changed, nothing is sent, the approval is
    set aside with what changed, and the model is told, so it proposes again from
    fresh data.
    """

    func: object
    name: str
    schema: dict  # the chat-completions tools entry (durable.toolschema.schema_for)
    kind: str | None = None
    approval: object = False
    many: bool = False
    on_reject: str = "note"
    approval_expiry: float | None = None
    retry: Retry = field(default_factory=Retry)
    prepared_from: object = None  # a callable (ctx, arguments), or a tuple of tool names

    @property
    def is_action(self):
        return self.kind is not None

    @property
    def parameters(self):
        return self.schema["function"]["parameters"]

    def spec(self):
        """The tool as the chat-completions API describes it."""
        return self.schema

    def errors(self, arguments):
        """What is wrong with the model's arguments, in words the model can act on."""
        return validate_arguments(self.schema, arguments)

    def needs_approval(self, action, ctx):
        if not self.approval:
            return False
        if not callable(self.approval):
            return True
        try:
            return bool(self.approval(action, ctx))
        except Exception:  # noqa: BLE001 - a predicate that fails cannot waive approval
            return True

    def __call__(self, ctx, **arguments):
        return self.func(ctx, **arguments)


def _sources(prepared_from, tool_name):
    """``prepared_from`` as a Tool keeps it: None, a callable, or a tuple of tool names."""
    if prepared_from is None or callable(prepared_from) and not isinstance(prepared_from, Tool):
        return prepared_from
    items = [prepared_from] if isinstance(prepared_from, (str, Tool)) else list(prepared_from)
    names = tuple(item.name if isinstance(item, Tool) else item for item in items)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ImproperlyConfigured(
            f"tool {tool_name}: prepared_from is a function (ctx, arguments) -> record, or the"
            f" names of read-only tools, not {prepared_from!r}")
    return names


def tool(func=None, *, name=None, description=None, schema=None, action=None, approval=False,
         many=False, on_reject="note", approval_expiry=None, retry=None, prepared_from=None):
    """Declare a function ``f(ctx, **arguments)`` as a tool (usable bare or with arguments).

    Its schema comes from the type hints and docstring (``durable.toolschema``);
    ``schema`` replaces it (a chat-completions tools entry). ``action=True`` (or a kind
    name) makes it an action tool.
    """
    if on_reject not in ON_REJECT:
        raise ImproperlyConfigured(f"on_reject must be one of {ON_REJECT}, not {on_reject!r}")

    def wrap(f):
        tool_name = name or f.__name__
        if approval and not action:
            raise ImproperlyConfigured(f"tool {tool_name}: only an action tool needs approval")
        if prepared_from is not None and not approval:
            raise ImproperlyConfigured(f"tool {tool_name}: prepared_from is checked before an"
                                       " approved call is sent; the tool needs approval")
        try:
            spec = schema or schema_for(f, name=tool_name, description=description)
        except ToolSchemaError as exc:
            raise ImproperlyConfigured(str(exc)) from None
        return Tool(
            func=f, name=tool_name, schema=spec,
            kind=(action if isinstance(action, str) else tool_name) if action else None,
            approval=approval, many=many, on_reject=on_reject,
            approval_expiry=approval_expiry, retry=retry or Retry(),
            prepared_from=_sources(prepared_from, tool_name),
        )

    return wrap(func) if func is not None else wrap


# The workflow class and its table ---------------------------------------------------------


def agent_table():
    """The transition table every agent workflow shares; where inside running is the memo keys."""
    edges = {
        PENDING: (RUNNING, CANCELLED),
        RUNNING: (DONE, AWAITING_APPROVAL, IN_FLIGHT, WAITING, JOINING, NEEDS_HUMAN, FAILED,
                  PENDING),
        AWAITING_APPROVAL: (PENDING, CANCELLED),
        # A wake-up (or the deadline) runs run() from the top again; cancel is implicit.
        WAITING: (RUNNING,),
        JOINING: (RUNNING,),
        IN_FLIGHT: (PENDING, UNKNOWN),
        UNKNOWN: (PENDING, IN_FLIGHT),
        NEEDS_HUMAN: (PENDING, CANCELLED),
        FAILED: (PENDING,),
        DONE: (),
        CANCELLED: (),
    }
    kinds = {
        PENDING: StateKind.INITIAL, RUNNING: StateKind.WORKING,
        AWAITING_APPROVAL: StateKind.APPROVAL, IN_FLIGHT: StateKind.IN_FLIGHT,
        UNKNOWN: StateKind.UNKNOWN, NEEDS_HUMAN: StateKind.HUMAN, FAILED: StateKind.FAILED,
        WAITING: StateKind.SIGNAL, JOINING: StateKind.JOIN,
        DONE: StateKind.TERMINAL, CANCELLED: StateKind.TERMINAL,
    }
    run = StepStates(step=RUN, before=PENDING, working=RUNNING, done=DONE, failure=FAILED,
                     human=NEEDS_HUMAN, signal=WAITING, join=JOINING)
    return TransitionTable(edges=edges, kinds=kinds, steps=[run])


# How the dispatcher and the approval services see an agent's action.
ACTION_STATES = StepStates(step=RUN, before=PENDING, working=RUNNING, done=PENDING,
                           failure=PENDING, human=NEEDS_HUMAN, approval=AWAITING_APPROVAL,
                           in_flight=IN_FLIGHT, unknown=UNKNOWN)


def is_agent(workflow):
    return getattr(workflow, "runs_itself", False)


def parsed(call):
    """(arguments, problems) of a tool call whose arguments are the model's JSON text."""
    arguments = call.arguments
    if isinstance(arguments, dict):
        return arguments, []
    try:
        return call.parsed_arguments(), []
    except (ValueError, TypeError, AttributeError) as exc:
        return None, [f"the arguments are not a JSON object ({exc}): {str(arguments)[:200]!r}"]


class AgentWorkflow(Workflow, register=False):
    """Base class of agent workflows: override ``run(ctx, payload)``.

    ``model`` is the model adapter (or override ``get_model(ctx)``), ``tools`` the
    tools the model may call, ``max_turns`` and ``budget`` (money, a Decimal) the
    bounds the engine enforces from the memo ledger: reaching either parks the job in
    needs_human, and an operator may grant more (``durable.agent_actions.grant``).
    ``call_timeout`` bounds each model and tool call (default: the STEP_TIMEOUT
    setting); ``retry`` is the retry policy of a failed call.
    """

    runs_itself = True
    model = None
    tools: typing.ClassVar[list] = []
    max_turns = 10
    budget = None
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

    def run(self, ctx, payload):
        raise NotImplementedError(f"{type(self).__name__} must define run(self, ctx, payload)")

    def get_model(self, ctx):
        """The model this run calls; by default the ``model`` attribute."""
        if self.model is None:
            raise ImproperlyConfigured(f"Workflow {self.name!r} has no model")
        return self.model

    def tool_specs(self):
        return [t.spec() for t in self.tools]


__all__ = [
    "AgentWorkflow", "Divergence", "DuplicateKey", "Model", "ModelReply", "ModelReplyInvalid",
    "Tool", "ToolCall", "ToolError", "agent_table", "tool",
]
