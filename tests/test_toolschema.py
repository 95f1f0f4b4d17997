"""Tool schemas built from Python functions, and the model's arguments checked against them."""

import enum
from typing import Literal

import pytest

from durable.toolschema import ToolSchemaError, schema_for, validate_arguments


class Reason(enum.Enum):
    DAMAGED = "damaged"
    LATE = "late"


def issue_refund(ctx, order_id: str, amount_cents: int, reason: Reason = Reason.LATE,
                 note: str | None = None, tags: list[str] = ()) -> dict:
    """Refund part or all of an order.

    Only for orders that were delivered.

    Args:
        order_id: The order's id, as the customer wrote it.
        amount_cents: Amount to refund, in cents; at most the order's total.
        reason: Why the refund is given.
    """


def lookup(ctx, sku: str, mode: Literal["stock", "price"], limit: float = 1.5) -> dict:
    """Look a product up.

    :param sku: the product's stock-keeping unit
    :param mode: what to read
    """


def test_the_schema_names_the_function_and_its_summary_and_leaves_ctx_out():
    function = schema_for(issue_refund)["function"]
    assert function["name"] == "issue_refund"
    assert function["description"] == "Refund part or all of an order."
    assert list(function["parameters"]["properties"]) == ["order_id", "amount_cents", "reason", "note", "tags"]


def test_parameters_carry_types_descriptions_defaults_and_required_names():
    parameters = schema_for(issue_refund)["function"]["parameters"]
    properties = parameters["properties"]
    assert properties["order_id"] == {"type": "string", "description": "The order's id, as the customer wrote it."}
    assert properties["amount_cents"]["type"] == "integer"
    assert properties["amount_cents"]["description"].endswith("at most the order's total.")
    assert properties["reason"] == {"enum": ["damaged", "late"], "type": "string",
                                    "description": "Why the refund is given.", "default": "late"}
    assert properties["note"] == {"type": "string", "nullable": True, "default": None}
    assert properties["tags"]["items"] == {"type": "string"}
    assert parameters["required"] == ["order_id", "amount_cents"]
    assert parameters["additionalProperties"] is False


def test_sphinx_param_lines_and_literals_are_read_too():
    properties = schema_for(lookup)["function"]["parameters"]["properties"]
    assert properties["sku"]["description"] == "the product's stock-keeping unit"
    assert properties["mode"] == {"enum": ["stock", "price"], "type": "string", "description": "what to read"}
    assert properties["limit"] == {"type": "number", "default": 1.5}


def test_arguments_that_fit_have_no_problems():
    schema = schema_for(issue_refund)
    assert validate_arguments(schema, {"order_id": "A-1", "amount_cents": 500, "reason": "damaged"}) == []
    assert validate_arguments(schema, {"order_id": "A-1", "amount_cents": 5, "note": None, "tags": ["x"]}) == []


@pytest.mark.parametrize(("arguments", "problem"), [
    ({"amount_cents": 5}, "missing required argument 'order_id'"),
    ({"order_id": "A-1", "amount_cents": "5"}, "amount_cents: expected integer, got str"),
    ({"order_id": "A-1", "amount_cents": True}, "amount_cents: expected integer, got bool"),
    ({"order_id": "A-1", "amount_cents": 5, "reason": "bored"}, "'bored' is not one of ['damaged', 'late']"),
    ({"order_id": "A-1", "amount_cents": 5, "refund_all": True}, "unexpected argument 'refund_all'"),
    ({"order_id": "A-1", "amount_cents": 5, "tags": ["ok", 3]}, "tags[1]: expected string, got int"),
    (["A-1", 5], "arguments must be a JSON object, got list"),
])
def test_arguments_that_do_not_fit_are_described_in_words_the_model_can_act_on(arguments, problem):
    problems = validate_arguments(schema_for(issue_refund), arguments)
    assert any(problem in text for text in problems), problems


def test_a_parameter_without_a_type_hint_is_a_clear_programming_error():
    def tool(ctx, order_id):
        """Do it."""

    with pytest.raises(ToolSchemaError, match="parameter 'order_id' needs a type hint"):
        schema_for(tool)


def test_a_type_a_model_cannot_be_told_about_is_refused_with_its_name():
    def tool(ctx, when: object):
        """Do it."""

    with pytest.raises(ToolSchemaError, match="cannot describe"):
        schema_for(tool)


def test_a_tool_name_the_api_would_refuse_is_refused_here():
    with pytest.raises(ToolSchemaError, match="1-64 letters"):
        schema_for(lookup, name="look up!")
