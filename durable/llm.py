"""Model adapters: ``durable.llm.OpenAIChat``, ``AnthropicMessages`` and the reply they return.

The adapters live in ``durable.agents.llm``.
"""

from .agents.llm import AnthropicMessages, ModelReply, ModelReplyInvalid, OpenAIChat, SDKAdapter, ToolCall, price_cost

__all__ = ["AnthropicMessages", "ModelReply", "ModelReplyInvalid", "OpenAIChat", "SDKAdapter", "ToolCall",
           "price_cost"]
