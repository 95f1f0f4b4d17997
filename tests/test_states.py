"""The transition table: derivation, validation and rendering (no database)."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from durable import Workflow, step
from durable.core.states import StateKind, TransitionTable
from durable.core.workflows import registry

DESIGN_TABLE = {
    "pending": ("fetching", "cancelled"),
    "fetching": ("fetched", "failed_fetch", "pending"),
    "fetched": ("extracting",),
    "extracting": ("extracted", "failed_extract", "fetched"),
    "extracted": ("verifying",),
    "verifying": ("verified", "needs_human", "extracted"),
    "verified": ("delivering",),
    "delivering": ("delivered", "failed_deliver", "verified"),
    "needs_human": ("extracted", "cancelled"),
    "failed_fetch": ("pending",),
    "failed_extract": ("fetched",),
    "failed_deliver": ("verified",),
    "delivered": (),
    "cancelled": (),
}

# The derived table is the design's, plus the edges that let a person answering a question
# send the job back to fetch again (to any step's start since the last action).
DERIVED_TABLE = {**DESIGN_TABLE, "needs_human": ("extracted", "pending", "fetched", "cancelled")}


def test_the_example_pipeline_derives_exactly_the_design_table():
    table = registry.get("test_pipeline").table
    assert dict(table.edges) == DERIVED_TABLE
    assert set(table.terminal_states()) == {"delivered", "cancelled"}
    assert table.kind("needs_human") == StateKind.HUMAN
    assert table.kind("failed_fetch") == StateKind.FAILED


def test_a_hand_declared_table_equal_to_the_design_is_accepted():
    class Declared(Workflow, register=False):
        name = "declared"
        transitions = {k: list(v) for k, v in DESIGN_TABLE.items()}

        @step(working="fetching", done="fetched")
        def fetch(self, p, ctx): ...

        @step(working="extracting", done="extracted")
        def extract(self, p, ctx): ...

        @step(working="verifying", done="verified", needs_human=True)
        def verify(self, p, ctx): ...

        @step(working="delivering", done="delivered")
        def deliver(self, p, ctx): ...

    table = Declared.build_table()
    assert table.allows("fetching", "pending")
    assert not table.allows("fetched", "delivered")


def _broken(edges_patch):
    edges = {k: list(v) for k, v in DESIGN_TABLE.items()}
    edges.update(edges_patch)

    class Broken(Workflow, register=False):
        name = "broken"
        transitions = edges

        @step(working="fetching", done="fetched")
        def fetch(self, p, ctx): ...

        @step(working="extracting", done="extracted")
        def extract(self, p, ctx): ...

        @step(working="verifying", done="verified", needs_human=True)
        def verify(self, p, ctx): ...

        @step(working="delivering", done="delivered")
        def deliver(self, p, ctx): ...

    return Broken


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"fetching": ["fetched", "failed_fetch"]}, "no retry edge back to 'pending'"),
        ({"failed_extract": []}, "failed_extract -> fetched"),
        ({"delivered": ["pending"]}, "terminal state 'delivered' has outgoing edges"),
        ({"extracted": ["verifyng"]}, "edge extracted -> verifyng points to an undeclared state"),
        ({"orphan": ["pending"]}, "'orphan' is unreachable"),
    ],
)
def test_table_validation_names_the_bad_edge(patch, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        _broken(patch).build_table()


def test_a_workflow_without_steps_is_refused():
    class Empty(Workflow, register=False):
        name = "empty"

    with pytest.raises(ImproperlyConfigured, match="declares no steps"):
        Empty.build_table()


def test_two_workflows_with_one_name_are_refused():
    with pytest.raises(ImproperlyConfigured, match="Two workflows are named 'recorded'"):

        class Recorded(Workflow):
            name = "recorded"

            @step
            def a(self, p, ctx): ...


def test_cancel_is_allowed_from_any_non_terminal_state_only():
    table = registry.get("test_pipeline").table
    assert table.allows("extracting", "cancelled")
    assert table.allows("failed_deliver", "cancelled")
    assert not table.allows("delivered", "cancelled")


def test_waiting_states_are_part_of_the_table():
    table = registry.get("sleeper").table
    assert table.kind("waiting_nap") == StateKind.TIMER
    assert table.allows("nap_running", "waiting_nap")
    assert table.allows("waiting_nap", "nap_running")


def test_render_prints_retry_and_requeue_edges():
    text = registry.get("test_pipeline").table.render()
    assert "fetching       -> fetched, failed_fetch, pending    (-> pending = retry)" in text
    assert "failed_deliver -> verified    (an operator requeues)" in text


def test_a_state_with_no_way_out_that_is_not_terminal_is_refused():
    table = TransitionTable(
        edges={"pending": ("stuck",), "stuck": ()},
        kinds={"pending": StateKind.INITIAL, "stuck": StateKind.READY},
    )
    with pytest.raises(ImproperlyConfigured, match="'stuck' has no way out"):
        table.validate("t")


def test_states_for_names_a_steps_states_as_the_table_declares_them():
    table = registry.get("sleeper").table
    states = table.states_for("nap")
    assert states.timer == "waiting_nap" and states.working == "nap_running"
    assert table.step_of(states.timer) is states
    assert table.states_for("no_such_step") is None


def test_notes_name_the_retry_and_requeue_edges():
    table = registry.get("test_pipeline").table
    assert table.notes("fetching") == [("retry", "pending")]
    assert table.notes("failed_deliver") == [("requeue", "verified")]
    assert table.notes("needs_human") == [] and table.notes("delivered") == []
