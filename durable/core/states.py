"""State kinds and the transition table: derivation from steps, validation, rendering.

A workflow's states are plain strings ("fetching", "failed_fetch"); what the engine
needs to know about each one is its kind. The table is a constant checked on every
write (see ``locking.transition``).
"""

from collections import deque
from dataclasses import dataclass, field

from django.core.exceptions import ImproperlyConfigured
from django.db import models

INITIAL = "pending"
CANCELLED = "cancelled"
NEEDS_HUMAN = "needs_human"


class StateKind(models.TextChoices):
    INITIAL = "initial", "submitted, not started"  # first state of every job
    READY = "ready", "between steps"  # a step finished; the next one may start
    WORKING = "working", "running a step"  # a worker holds (or held) the lease
    TIMER = "timer", "waiting for a time"  # a durable timer: claimable at next_run_at
    SIGNAL = "signal", "waiting for a signal"  # claimable when a signal arrives or at the deadline
    JOIN = "join", "waiting for its children"  # claimable when the last child finishes or at the deadline
    APPROVAL = "approval", "awaiting approval"  # a proposal waits for a human decision
    IN_FLIGHT = "in_flight", "action in flight"  # the outbox dispatcher owns the next move
    UNKNOWN = "unknown", "action result unknown"  # reconciliation decides what happened
    HUMAN = "human", "needs a human"  # parked until an operator sends it back
    FAILED = "failed", "failed"  # parked until an operator requeues it
    TERMINAL = "terminal", "finished"  # no way out

    @property
    def is_claimable(self):
        """Whether a job worker may pick a job up in this kind of state."""
        return self in CLAIMABLE_KINDS

    @property
    def is_waiting_for_operator(self):
        return self in (StateKind.APPROVAL, StateKind.UNKNOWN, StateKind.HUMAN, StateKind.FAILED)


CLAIMABLE_KINDS = frozenset({StateKind.INITIAL, StateKind.READY, StateKind.WORKING, StateKind.TIMER,
                             StateKind.SIGNAL, StateKind.JOIN})
# The kinds a waiting step resumes from like a timer: the step runs again from the top.
RESUMING_KINDS = frozenset({StateKind.TIMER, StateKind.SIGNAL, StateKind.JOIN})
# What the claim event of a resumed step says, by the kind it resumed from.
WOKEN = {
    StateKind.TIMER: "timer fired",
    StateKind.SIGNAL: "woken: a signal arrived or its deadline passed",
    StateKind.JOIN: "woken: its children finished or its deadline passed",
}
# The kinds a parent's join counts a child as finished in (failed: until it is requeued).
SETTLED_KINDS = frozenset({StateKind.TERMINAL, StateKind.FAILED})


@dataclass(frozen=True)
class StepStates:
    """The states one step moves through, as the runner needs them."""

    step: str
    before: str  # the state a job is in when this step may start (the retry target)
    working: str
    done: str
    failure: str  # failed_<step>, or needs_human for steps that route failures to a person
    human: str | None = None
    timer: str | None = None
    approval: str | None = None
    in_flight: str | None = None
    unknown: str | None = None
    signal: str | None = None
    join: str | None = None


@dataclass
class TransitionTable:
    """Edges between states, the kind of each state, and each step's states."""

    edges: dict[str, tuple[str, ...]]
    kinds: dict[str, StateKind]
    steps: list[StepStates] = field(default_factory=list)
    initial: str = INITIAL

    def allows(self, frm, to):
        """Whether ``frm -> to`` is an edge; cancelling is allowed from any non-terminal state."""
        if to == CANCELLED and CANCELLED in self.kinds:
            return self.kinds.get(frm) not in (StateKind.TERMINAL, None)
        return to in self.edges.get(frm, ())

    def kind(self, state):
        try:
            return self.kinds[state]
        except KeyError:
            raise KeyError(f"state {state!r} is not in this workflow's table") from None

    def is_terminal(self, state):
        return self.kinds.get(state) == StateKind.TERMINAL

    def terminal_states(self):
        return [s for s, k in self.kinds.items() if k == StateKind.TERMINAL]

    def states_of_kind(self, *kinds):
        return [s for s, k in self.kinds.items() if k in kinds]

    def step_starting_at(self, state):
        """The step that runs next from a ready/initial state, or None at the end."""
        for s in self.steps:
            if s.before == state:
                return s
        return None

    def states_for(self, step):
        """The states of the step named ``step``, as this table declares them, or None."""
        for s in self.steps:
            if s.step == step:
                return s
        return None

    def step_of(self, state):
        """The step a working, waiting or failed state belongs to."""
        for s in self.steps:
            if state in (s.working, s.timer, s.signal, s.join, s.approval, s.in_flight,
                         s.unknown) or (
                state == s.failure and state != s.human
            ):
                return s
        return None

    def notes(self, state):
        """The edges of ``state`` that mean more than a move, as ``(meaning, target)`` pairs.

        ``("retry", before)``: a working state's way back to where its step starts.
        ``("requeue", before)``: a failed state's way back, taken when an operator requeues.
        """
        targets = self.edges.get(state, ())
        found = []
        for st in self.steps:
            if state == st.working and st.before in targets:
                found.append(("retry", st.before))
            if state == st.failure and st.failure != st.human:
                found.append(("requeue", st.before))
        return found

    def validate(self, name="workflow"):
        """Raise ImproperlyConfigured naming the first bad edge or state."""
        for problem in self._problems():
            raise ImproperlyConfigured(f"Workflow {name!r}: {problem}")
        return self

    def _problems(self):
        """What is wrong with the table, one sentence each, in the order validate() checks it."""
        yield from self._undeclared_states()
        for st in self.steps:
            yield from self._missing_step_edges(st)
        yield from self._states_without_a_way_out()
        yield from self._unreachable_states()

    def _undeclared_states(self):
        """The initial state and every edge's target are declared, and every state has a kind."""
        if self.initial not in self.edges:
            yield f"the initial state {self.initial!r} is not declared"
        for frm, targets in self.edges.items():
            if frm not in self.kinds:
                yield f"state {frm!r} has no kind"
            for to in targets:
                if to not in self.edges:
                    yield f"edge {frm} -> {to} points to an undeclared state {to!r}"

    def _missing_step_edges(self, st):
        """A step can start, finish, fail, be requeued, wait and come back, and be retried."""
        # An action step is done when its action is confirmed, from in flight.
        need = [(st.before, st.working), (st.in_flight or st.working, st.done), (st.working, st.failure)]
        if st.failure != st.human:
            need.append((st.failure, st.before))
        for frm, to in need:
            if to not in self.edges.get(frm, ()):
                yield f"step {st.step!r} needs the edge {frm} -> {to}"
        for waiting in (st.timer, st.signal, st.join):
            if waiting and not (waiting in self.edges.get(st.working, ())
                                and st.working in self.edges.get(waiting, ())):
                yield (f"step {st.step!r} waits in {waiting!r} and needs the edges "
                       f"{st.working} -> {waiting} -> {st.working}")
        if st.before not in self.edges.get(st.working, ()):
            yield f"working state {st.working!r} has no retry edge back to {st.before!r}"

    def _states_without_a_way_out(self):
        """Only terminal states end a job: every other state (a failed one too) has an exit."""
        for state, kind in self.kinds.items():
            targets = self.edges.get(state, ())
            if kind == StateKind.TERMINAL and targets:
                yield f"terminal state {state!r} has outgoing edges {', '.join(targets)}"
            if kind != StateKind.TERMINAL and not targets:
                yield f"state {state!r} has no way out and is not terminal"
            if kind == StateKind.FAILED and not targets:
                yield f"failed state {state!r} has no requeue edge"

    def _unreachable_states(self):
        """Every state but cancelled (reached from anywhere) is reachable from the initial state."""
        seen, todo = {self.initial}, deque([self.initial])
        while todo:
            for to in self.edges.get(todo.popleft(), ()):
                if to not in seen:
                    seen.add(to)
                    todo.append(to)
        unreachable = [s for s in self.edges if s not in seen and s != CANCELLED]
        if unreachable:
            yield f"state {unreachable[0]!r} is unreachable from {self.initial!r}"

    def render(self):
        """The table as text, one state a line, in the style of DESIGN.md."""
        width = max(len(s) for s in self.edges)
        lines = []
        for state, targets in self.edges.items():
            kind = self.kinds[state]
            right = ", ".join(targets) if targets else f"({kind.label})"
            notes = [f"-> {target} = retry" if meaning == "retry" else "an operator requeues"
                     for meaning, target in self.notes(state)]
            note = f"    ({'; '.join(notes)})" if notes else ""
            lines.append(f"{state.ljust(width)} -> {right}{note}")
        if CANCELLED in self.kinds:
            lines.append(f"{'*'.ljust(width)} -> {CANCELLED}    (operator cancel, any non-terminal state)")
        return "\n".join(lines)


def _prepare_again_from(st, earlier):
    """The state a proposal of ``st`` is prepared again from, or None for its own start."""
    names = getattr(st, "prepared_from", None) or ()
    for states in earlier:
        if states.step in names:
            return states.before
    return None


def prepare_again_plan(table, st):
    """``(state, [steps])``: where a job goes to prepare a new proposal for step ``st``,
    and the earlier steps that run again on the way (their memos are stale).

    The start of the first step in ``st.prepared_from`` when the table allows the move
    from both the approval and the in-flight state; otherwise the step's own start.
    """
    own = table.states_for(st.name)
    names = st.prepared_from or ()
    for index, states in enumerate(table.steps):
        if states.step == st.name:
            break
        if states.step in names:
            target = states.before
            allowed = all(table.allows(frm, target) for frm in (own.approval, own.in_flight) if frm)
            if allowed:
                return target, [s.step for s in table.steps[index:] if s.step in names]
            break
    return own.before, []


def derive(steps):
    """Build the table for ordered steps (each a ``durable.core.workflows.Step``)."""
    draft = _Draft()
    human_returns: list[str] = []
    # The starts a person may send a job back to from a later step's question: every
    # step's start since the last action step. Sending a job back past an action would
    # prepare a side effect that was already sent again, so no edge goes that far.
    fresh_starts: list[str] = []
    step_states = []
    before = INITIAL
    for index, st in enumerate(steps):
        last = index == len(steps) - 1
        states = _states_of(st, before)
        step_states.append(states)
        # Prepared again from current inputs: back to the first step the proposal was
        # prepared from (see Step.prepared_from), or to this step's own start.
        again = _prepare_again_from(st, step_states) or before
        draft.add_step(st, states, again, last)
        fresh_starts.append(before)
        human_returns.extend(_human_return_targets(st, states, fresh_starts))
        if st.action:
            fresh_starts = []
        if not last:
            before = st.done
    draft.add_ends(steps, human_returns)
    ordered = _design_order(draft.edges, step_states)
    return TransitionTable(
        edges={s: tuple(draft.edges[s]) for s in ordered}, kinds=draft.kinds, steps=step_states
    )


def _states_of(st, before):
    """The states step ``st`` (a ``durable.core.workflows.Step``) moves through, starting from ``before``."""
    failure = NEEDS_HUMAN if st.needs_human and st.on_failure == "needs_human" else f"failed_{st.name}"
    return StepStates(
        step=st.name,
        before=before,
        working=st.working,
        done=st.done,
        failure=failure,
        human=NEEDS_HUMAN if st.needs_human else None,
        timer=f"waiting_{st.name}" if st.waits else None,
        approval=f"awaiting_approval_{st.name}" if st.approval else None,
        in_flight=f"in_flight_{st.name}" if st.action else None,
        unknown=f"unknown_{st.name}" if st.action else None,
        signal=f"awaiting_signal_{st.name}" if st.signals else None,
        join=f"joining_{st.name}" if st.joins else None,
    )


def _working_exits(st, states):
    """Where a step's working state leads, in the order the table lists them."""
    outs = [s for s in (states.approval, states.in_flight) if s]
    # An action step reaches done from working only when its action was confirmed
    # earlier (the step was sent back past it): the recorded result is its memo.
    outs.append(states.done)
    outs.extend(s for s in (states.timer, states.signal, states.join) if s)
    outs.append(states.failure)
    if st.needs_human and states.failure != NEEDS_HUMAN:
        outs.append(NEEDS_HUMAN)
    outs.append(states.before)  # the retry edge
    return outs


def _human_return_targets(st, states, fresh_starts):
    """The starts a person may send a job back to from step ``st``'s question (none if it asks none)."""
    targets = []
    if st.needs_human or (states.approval and st.on_reject == NEEDS_HUMAN):
        # A person may send the job back to prepare again (after a rejection, too).
        targets.append(states.before)
    if st.needs_human:
        # ... or to an earlier step's start, to fetch again (a re-fetch).
        targets.extend(fresh_starts)
    return targets


class _Draft:
    """The edges and kinds of a table being derived, kept in the order they are added:
    the order is the one ``render`` shows and ``_design_order`` starts from."""

    def __init__(self):
        self.edges: dict[str, list[str]] = {INITIAL: []}
        self.kinds = {INITIAL: StateKind.INITIAL}

    def add(self, frm, *tos):
        lst = self.edges.setdefault(frm, [])
        for to in tos:
            if to not in lst:
                lst.append(to)

    def add_step(self, st, states, again, last):
        """A step's states and edges: start, work, wait, approval, dispatch, failure, done."""
        self.add(states.before, states.working)
        self.kinds[states.working] = StateKind.WORKING
        self.add(states.working, *_working_exits(st, states))
        for waiting, kind in ((states.timer, StateKind.TIMER), (states.signal, StateKind.SIGNAL),
                              (states.join, StateKind.JOIN)):
            if waiting:
                # A waiting step runs again from the top when it is due; cancel is implicit.
                self.add(waiting, states.working)
                self.kinds[waiting] = kind
        if states.approval:
            # approved -> dispatch; superseded -> prepare again from current inputs;
            # rejected -> where the step says (cancelled by default, or needs_human).
            self.add(states.approval, states.in_flight, again, states.before, st.on_reject)
            self.kinds[states.approval] = StateKind.APPROVAL
        if states.in_flight:
            self.add(states.in_flight, states.done, states.failure, states.unknown, again, states.before)
            self.add(states.unknown, states.done, states.in_flight, states.failure)
            self.kinds[states.in_flight] = StateKind.IN_FLIGHT
            self.kinds[states.unknown] = StateKind.UNKNOWN
        if states.failure != NEEDS_HUMAN:
            self.add(states.failure, states.before)  # the requeue edge
            self.kinds[states.failure] = StateKind.FAILED
        self.kinds[states.done] = StateKind.TERMINAL if last else StateKind.READY
        self.edges.setdefault(states.done, [])

    def add_ends(self, steps, human_returns):
        """needs_human (when a step asks a person or a rejection goes to one) and cancelled."""
        if human_returns or any(s.approval and s.on_reject == NEEDS_HUMAN for s in steps):
            self.add(NEEDS_HUMAN, *human_returns, CANCELLED)
            self.kinds[NEEDS_HUMAN] = StateKind.HUMAN
        self.edges[INITIAL].append(CANCELLED)
        self.edges.setdefault(CANCELLED, [])
        self.kinds[CANCELLED] = StateKind.TERMINAL


def _design_order(edges, step_states):
    """Order states as a reader expects: the happy path, then waiting, human, failed, terminal."""
    order = [INITIAL]
    for st in step_states:
        for s in (st.working, st.timer, st.signal, st.join, st.approval, st.in_flight, st.unknown,
                  st.done):
            if s and s not in order:
                order.append(s)
    tail_first = [s for s in edges if s not in order and s == NEEDS_HUMAN]
    failed = [s for s in edges if s.startswith("failed_") and s not in order]
    rest = [s for s in edges if s not in order and s not in tail_first and s not in failed]
    return order + tail_first + failed + rest


def from_declared(declared, steps):
    """Build a table from a hand-written ``{state: [targets]}`` constant and the steps."""
    derived = derive(steps)
    edges = {state: tuple(targets) for state, targets in declared.items()}
    kinds = {}
    for state, targets in edges.items():
        kind = derived.kinds.get(state)
        if kind is None:
            kind = StateKind.TERMINAL if not targets else StateKind.READY
        kinds[state] = kind
    table = TransitionTable(edges=edges, kinds=kinds, steps=derived.steps)
    return table
