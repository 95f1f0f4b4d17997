"""The README's model adapters and price table ("Write an agent"), run against the fake model server."""

from decimal import Decimal

import pytest

from durable.testing import FakeModelServer, reply

from .test_docs import ROOT, module_for, run, samples

pytest.importorskip("openai")
pytest.importorskip("anthropic")


def readme_block(marker):
    blocks = [s for s in samples(ROOT / "README.md") if marker in s.code]
    assert len(blocks) == 1, f"the README has one sample with {marker!r}"
    module = module_for(ROOT / "README.md")
    run(blocks[0], module)
    return module


def test_the_readme_adapters_have_explicit_timeouts_and_no_retries_of_their_own():
    module = readme_block("local = OpenAIChat(")
    try:
        assert str(module.local.client.base_url) == "http://127.0.0.1:11434/v1/"
        assert (module.local.client.max_retries, module.claude.client.max_retries) == (0, 0)
        assert (module.local.timeout.read, module.local.timeout.connect) == (300, 2)
        assert module.claude.timeout.read == 60 and module.claude.defaults["max_tokens"] == 1024
    finally:
        module.local.close()
        module.claude.close()


@pytest.mark.parametrize("adapter", ["OpenAIChat", "AnthropicMessages"])
def test_the_readme_price_table_prices_each_call_and_a_dated_name_by_its_family(settings, adapter):
    import durable.agents.llm

    table = readme_block('DURABLE["MODEL_PRICES"] = {').DURABLE["MODEL_PRICES"]
    settings.DURABLE = {**settings.DURABLE, "MODEL_PRICES": table}
    name = "gpt-4o-mini" if adapter == "OpenAIChat" else "claude-haiku-4-5"
    answered = f"{name}-2026-01-01"
    with FakeModelServer([reply("Hello.", usage=(2000, 500), model=answered)]) as server:
        url = server.url if adapter == "OpenAIChat" else server.root_url
        with getattr(durable.llm, adapter)(name, base_url=url) as model:
            result = model.complete([{"role": "user", "content": "Hi"}])
    prices = {key: Decimal(value) for key, value in table[name].items()}
    assert result.model == answered and result.priced == "table"
    assert result.cost == (prices["input"] * 2000 + prices["output"] * 500) / 1_000_000 > 0


def test_the_readme_tool_schema_comes_from_the_hints_and_docstring_and_checks_the_arguments():
    module = readme_block("def open_ticket(")
    tool = module.open_ticket
    assert tool.is_action and tool.kind == "ticket"
    parameters = tool.schema["function"]["parameters"]
    assert tool.schema["function"]["description"] == "Open a ticket in the CRM."
    assert parameters["required"] == ["order_id", "subject"]
    assert parameters["properties"]["priority"] == {
        "enum": ["low", "normal", "high"], "type": "string",
        "description": "How soon a person should look at it.", "default": "normal"}
    assert tool.errors({"order_id": "A-1", "priority": "urgent"}) == [
        "arguments: missing required argument 'subject'",
        "priority: 'urgent' is not one of ['low', 'normal', 'high']"]
    assert tool.errors({"order_id": "A-1", "subject": "Broken"}) == []
