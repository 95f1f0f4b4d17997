"""A scripted model that answers in-process, for tests and examples: every agent path, offline.

It speaks through the same code as the real adapters: each scripted reply (built with
``durable.testing.fake_openai.reply`` and ``tool_call``) becomes the chat.completion the fake
server would send, parsed by ``durable.llm.reply_from_completion``. The reply a call
gets is chosen by the conversation's turn (how many assistant messages it holds), so
a resumed run asking again for turn 3 gets turn 3's reply. ``calls`` lists the turns
asked, in order: each one a paid call. An entry ``{"raw": "..."}`` is a reply that
cannot be parsed (``ModelReplyInvalid``, with the text kept).

For a model behind a real HTTP server (a worker killed during a network wait), use
``durable.testing.fake_openai.FakeModelServer`` with ``durable.llm.OpenAIChat``.
"""

from ..agents.llm import ModelReplyInvalid, reply_from_completion
from .fake_openai import completion, reply, turn_of


class ScriptedModel:
    """A model adapter that answers from a script, in this process."""

    def __init__(self, script, model="scripted", prices=None):
        self.script = list(script)
        self.model = model
        self.prices = prices
        self.calls = []

    def complete(self, messages, tools=None, **params):
        body = {"messages": messages, "model": self.model}
        turn = turn_of(body)
        self.calls.append(turn + 1)
        entry = self.script[turn] if turn < len(self.script) else reply(
            f"(no scripted reply for turn {turn + 1})")
        if "raw" in entry:
            raise ModelReplyInvalid(f"unusable reply from {self.model}", raw=str(entry["raw"]))
        return reply_from_completion(completion(entry, body, turn, self.model), self.model,
                                     self.prices)


__all__ = ["ScriptedModel"]
