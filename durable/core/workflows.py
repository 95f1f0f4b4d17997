"""Declaring workflows: the Workflow base class, the ``step`` decorator and the registry.

    class Research(Workflow):
        name = "research"
        version = 1

        @step(working="fetching", done="fetched", timeout=20)
        def fetch(self, payload, ctx): ...

Steps run in the order they are declared. The transition table is derived from them
(or declared by hand as ``transitions = {...}``) and validated when Django starts.
"""

import dataclasses
import inspect
from dataclasses import dataclass, field
from decimal import Decimal

from django.core.exceptions import ImproperlyConfigured

from ..conf import durable_settings
from ..exceptions import UnknownWorkflow
from . import states


@dataclass(frozen=True)
class Retry:
    """A step's retry policy; ``None`` fields fall back to the DURABLE settings."""

    max_attempts: int | None = None
    base: float | None = None
    cap: float | None = None
    # Exception classes that are retried / treated as poison, overriding the defaults.
    retry_on: tuple = ()
    poison_on: tuple = ()
    # Unknown exceptions are poison unless the step says they are worth retrying.
    retry_unknown: bool = False

    def resolved(self):
        return (
            self.max_attempts if self.max_attempts is not None else durable_settings.MAX_ATTEMPTS,
            self.base if self.base is not None else durable_settings.BACKOFF_BASE,
            self.cap if self.cap is not None else durable_settings.BACKOFF_CAP,
        )


@dataclass
class Step:
    """One declared step: its function, states and policies."""

    func: object
    name: str
    working: str
    done: str
    timeout: float | None = None
    retry: Retry = field(default_factory=Retry)
    needs_human: bool = False
    on_failure: str = "failed"  # or "needs_human": failures park the job for a person
    waits: bool = False
    # ctx.wait_for() parks in awaiting_signal_<step>; ctx.join() parks in joining_<step>.
    signals: bool = False
    joins: bool = False
    # Actions (see durable.engine.dispatch.loop): the step returns an Action instead of doing it.
    action: bool = False
    approval: object = False  # True, or a predicate(action, ctx) -> bool
    approval_expiry: float | None = None
    on_reject: str = states.CANCELLED
    # The earlier steps a proposal is prepared from (their memos): when the proposal is
    # prepared again from current inputs, these run again first. None: every earlier step.
    prepared_from: tuple | None = None
    order: int = 0

    @property
    def effective_timeout(self):
        return self.timeout if self.timeout is not None else durable_settings.STEP_TIMEOUT


_counter = iter(range(1_000_000_000))


def step(
    func=None,
    *,
    working=None,
    done=None,
    timeout=None,
    retry=None,
    needs_human=False,
    on_failure=None,
    waits=False,
    signals=False,
    joins=False,
    action=False,
    approval=False,
    approval_expiry=None,
    on_reject=states.CANCELLED,
    prepared_from=None,
):
    """Declare a method of a Workflow as a step (usable bare or with arguments).

    ``prepared_from`` (steps that need approval): the names of the earlier steps whose
    memos the proposal is prepared from. When a proposal is prepared again (its inputs
    changed, it expired, or an operator asked), these steps run again before it, so the
    new proposal comes from current inputs rather than from their old memos. The default
    is every earlier step; ``()`` re-runs the action step alone (it reads its inputs itself).
    """

    def wrap(f):
        f._durable_step = Step(
            func=f,
            name=f.__name__,
            working=working or f"{f.__name__}_running",
            done=done or f"{f.__name__}_done",
            timeout=timeout,
            retry=retry or Retry(),
            needs_human=needs_human,
            on_failure=on_failure or ("needs_human" if needs_human else "failed"),
            waits=waits,
            signals=signals,
            joins=joins,
            action=action or bool(approval),
            approval=approval,
            approval_expiry=approval_expiry,
            on_reject=on_reject,
            prepared_from=None if prepared_from is None else tuple(prepared_from),
            order=next(_counter),
        )
        return f

    return wrap(func) if func is not None else wrap


def _resolve_prepared_from(cls, steps):
    """Steps with ``prepared_from`` spelled out for this workflow (a copy where it differs)."""
    resolved = []
    for index, st in enumerate(steps):
        earlier = [s.name for s in steps[:index]]
        if st.approval:
            names = tuple(earlier) if st.prepared_from is None else st.prepared_from
            wrong = [n for n in names if n not in earlier]
            if wrong:
                raise ImproperlyConfigured(
                    f"Step {st.name!r} of {cls.__name__}: prepared_from names {', '.join(map(repr, wrong))},"
                    f" which {'is' if len(wrong) == 1 else 'are'} not a step before it"
                    f" (earlier steps: {', '.join(earlier) or 'none'})"
                )
            if names != st.prepared_from:
                st = dataclasses.replace(st, prepared_from=names)
        resolved.append(st)
    return resolved


def _check_when_busy(cls):
    from .concurrency import check_policy

    try:
        check_policy(cls.name or cls.__name__, cls.when_busy)
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None


class Workflow:
    """Base class of workflows. Subclasses with a ``name`` register themselves."""

    name: str = ""
    version: int = 1
    # Optional hand-declared table {state: [targets]}; derived from the steps when None.
    transitions: dict | None = None
    # Optional durable.Schedule (or a list of them): submit this workflow on its ticks.
    schedule = None
    # Whether the workflow drives its own run (``drive(started, seat)`` returns an outcome
    # the engine's runner matches) instead of the runner calling its steps one by one.
    # An agent workflow does (``durable.agents.AgentWorkflow``).
    runs_itself = False
    # What its actions are (``durable.actions.kinds``): None, a step's action; an agent
    # workflow names the tool-call kind. The outbox, approvals and console ask it.
    action_kind = None
    # What a job of this workflow does when its concurrency key is full
    # (``durable.core.concurrency``): "queue" (wait its turn), "reject" (submit raises
    # KeyBusy) or "interrupt" (the key's active runs stop at their next model call).
    when_busy = "queue"

    steps: list[Step]
    table: states.TransitionTable

    def __init_subclass__(cls, register=True, **kwargs):
        super().__init_subclass__(**kwargs)
        found = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                if hasattr(value, "_durable_step"):
                    found[attr] = value._durable_step
        cls.steps = _resolve_prepared_from(cls, sorted(found.values(), key=lambda s: s.order))
        _check_when_busy(cls)
        if register and cls.name:
            registry.register(cls)

    def __init__(self):
        self.steps_by_name = {s.name: s for s in self.steps}

    @classmethod
    def build_table(cls):
        if not cls.steps:
            raise ImproperlyConfigured(f"Workflow {cls.name!r} declares no steps")
        if cls.transitions is not None:
            table = states.from_declared(cls.transitions, cls.steps)
        else:
            table = states.derive(cls.steps)
        return table.validate(cls.name)

    def run_step(self, st, data, ctx):
        """Call one step's function; a hook for subclasses that wrap every step."""
        return st.func(self, data, ctx)

    def call_step(self, st, data, ctx):
        """Run one step (through ``run_step``) and unwrap an ``Output``: a ``StepReturn``.

        The cost is what the step recorded with ``ctx.cost()`` plus its ``Output``'s cost.
        The runner and replay both call steps this way. An ``async def`` step's coroutine
        runs on the process's event loop while this thread waits (see ``durable.core.aio``).
        """
        returned = self.run_step(st, data, ctx)
        if inspect.iscoroutine(returned):
            from . import aio

            returned = aio.run(returned, f"step {st.name}", st.effective_timeout)
        cost = ctx.cost_total
        if isinstance(returned, Output):
            cost += Decimal(str(returned.cost))
            returned = returned.value
        return StepReturn(returned, cost)

    # Hooks for actions that need approval (see durable.approvals).

    def input_version(self, job, ctx):
        """A fingerprint of the records a proposal was prepared from; override to track them."""
        return ""

    def summarize(self, action, ctx):
        """An ordinary-language line describing an action for the approver."""
        return f"{action.operation} on {action.destination}"

    def current_record(self, action, ctx):
        """The target record as it is now, for a before/after diff (None: unknown)."""
        return None

    def __str__(self):
        return f"{self.name} v{self.version}"


class Registry:
    """Workflows by name: one instance each, tables built and validated once."""

    def __init__(self):
        self._classes = {}
        self._instances = {}
        # Bumped by every change, so that caches derived from the tables know to rebuild.
        self.generation = 0

    def register(self, cls):
        name = cls.name
        existing = self._classes.get(name)
        if existing is not None and (existing.__module__, existing.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise ImproperlyConfigured(
                f"Two workflows are named {name!r}: {existing.__module__}.{existing.__qualname__}"
                f" and {cls.__module__}.{cls.__qualname__}"
            )
        cls.table = cls.build_table()
        self._classes[name] = cls
        self._instances.pop(name, None)
        self.generation += 1
        return cls

    def unregister(self, name):
        self._classes.pop(name, None)
        self._instances.pop(name, None)
        self.generation += 1

    def get(self, name):
        try:
            cls = self._classes[name]
        except KeyError:
            known = ", ".join(sorted(self._classes)) or "none"
            raise UnknownWorkflow(
                f"No workflow is registered as {name!r} (registered: {known})"
            ) from None
        inst = self._instances.get(name)
        if inst is None:
            inst = self._instances[name] = cls()
        return inst

    def __contains__(self, name):
        return name in self._classes

    def kind_of(self, workflow, state):
        """The StateKind of ``state`` in ``workflow``'s table; None if either is unknown here."""
        cls = self._classes.get(workflow)
        return None if cls is None else cls.table.kinds.get(state)

    def names(self):
        return sorted(self._classes)

    def all(self):
        return [self.get(n) for n in self.names()]


registry = Registry()


# What steps raise or return to steer the engine.


class NeedsHuman(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a step: park the job in needs_human with this reason."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class Wait(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a step: sleep durably until ``until`` (a datetime) or for ``seconds``."""

    def __init__(self, until=None, *, seconds=None):
        if until is None and seconds is None:
            raise TypeError("Wait needs until= or seconds=")
        super().__init__(until or seconds)
        self.until = until
        self.seconds = seconds


class _TimedOut:
    """What a wait returns when its deadline passed first: ``durable.TIMED_OUT`` (falsy)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self):
        return False

    def __repr__(self):
        return "durable.TIMED_OUT"

    def __reduce__(self):
        return (_TimedOut, ())


TIMED_OUT = _TimedOut()


class WaitingOn(Exception):  # noqa: N818 - a signal, not an error
    """Raised by ctx.wait_for() and ctx.join(): park the step on the wait ``key`` until it is due."""

    def __init__(self, kind, key, name, deadline, data=None):
        super().__init__(key)
        self.kind = kind
        self.key = key
        self.name = name
        self.deadline = deadline
        self.data = data


@dataclass
class Output:
    """A step's return value with its cost: ``return Output(data, cost=Decimal("0.012"))``."""

    value: object
    cost: Decimal | str | float = Decimal(0)


@dataclass(frozen=True)
class StepReturn:
    """What ``Workflow.call_step`` returns: the step's value (``Output`` unwrapped) and its cost."""

    value: object
    cost: Decimal


@dataclass
class Action:
    """What an action step returns: the effect to send through the outbox."""

    destination: str
    operation: str
    values: dict
    # The approver sees this; the workflow's summarize() is used when it is empty.
    summary: str = ""
