"""Agents: a workflow whose code decides the next model or tool call at run time.

What users write is here (``from durable.agents import AgentWorkflow, tool``); the parts:

- ``workflow``: ``AgentWorkflow``, ``@tool`` and what a model is to the run;
- ``run``: one execution of ``run()``: keys, memos, bounds, divergence, and the outcome
  the engine's runner matches;
- ``tools``: an action tool's proposals, its outbox row and the bounds an operator grants;
- ``outbox``: the action kind of a tool call (which turn, what is checked, how it settles);
- ``llm`` and ``toolschema``: the model adapters, and a tool's schema from its signature.
"""

from .base import Divergence, DuplicateKey, Model, Tool, ToolError, agent_table, tool
from .llm import ModelReply, ModelReplyInvalid, ToolCall


def __getattr__(name):
    # AgentWorkflow is loaded on first use: it runs through the outbox and the store, which
    # load Django's models, and a process without Django settings (a receiver, a fake
    # model server) imports this package for its model adapters alone.
    if name == "AgentWorkflow":
        from .workflow import AgentWorkflow

        return AgentWorkflow
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AgentWorkflow", "Divergence", "DuplicateKey", "Model", "ModelReply", "ModelReplyInvalid",
    "Tool", "ToolCall", "ToolError", "agent_table", "tool",
]
