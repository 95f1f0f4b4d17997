"""What every agent module shares: the agent's one-step table, its errors, ``Tool`` and ``@tool``.

The run (``run``), its action tools (``tools``), their outbox kind (``outbox``) and the
workflow class users subclass (``workflow``) all build on these.
"""


import typing
from dataclasses import dataclass, field

from django.core.exceptions import ImproperlyConfigured

from ..core.states import CANCELLED, INITIAL, NEEDS_HUMAN, StateKind, StepStates, TransitionTable
from ..core.workflows import Retry
from ..exceptions import DurableError
from .llm import ModelReply
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


class Draining(Exception):  # noqa: N818 - a signal, not an error
    """The worker drains: the run stops at its frontier, before a call it would pay for."""


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
    # A read-only tool whose result other jobs may reuse for the same arguments: True (for
    # DURABLE["CACHE_TTL"]) or seconds (``durable.store.cache``).
    cache: object = None

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
         many=False, on_reject="note", approval_expiry=None, retry=None, prepared_from=None, cache=None):
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
        if cache not in (None, False) and action:
            raise ImproperlyConfigured(f"tool {tool_name}: an action is never cached (its result is"
                                       " what the receiver did); only a read-only tool may be")
        if cache not in (None, False):
            from ..store.cache import ttl_of

            try:
                ttl_of(cache)
            except ValueError as exc:
                raise ImproperlyConfigured(f"tool {tool_name}: {exc}") from None
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
            prepared_from=_sources(prepared_from, tool_name), cache=cache,
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


def parsed(call):
    """(arguments, problems) of a tool call whose arguments are the model's JSON text."""
    arguments = call.arguments
    if isinstance(arguments, dict):
        return arguments, []
    try:
        return call.parsed_arguments(), []
    except (ValueError, TypeError, AttributeError) as exc:
        return None, [f"the arguments are not a JSON object ({exc}): {str(arguments)[:200]!r}"]
