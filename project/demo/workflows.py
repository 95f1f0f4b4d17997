"""The demo pipeline from the first article: fetch -> extract -> verify -> deliver."""

from decimal import Decimal

from durable import NeedsHuman, Output, Retry, Workflow, step


class Pipeline(Workflow):
    name = "pipeline"
    version = 1

    @step(working="fetching", done="fetched", timeout=20, retry=Retry(max_attempts=5))
    def fetch(self, payload, ctx):
        return {"url": payload.get("url", ""), "text": payload.get("text", "")}

    @step(working="extracting", done="extracted", timeout=20)
    def extract(self, doc, ctx):
        words = doc["text"].split()
        return Output({"words": len(words), "title": " ".join(words[:5])}, cost=Decimal("0.003"))

    @step(working="verifying", done="verified", needs_human=True)
    def verify(self, extraction, ctx):
        if extraction["words"] == 0:
            raise NeedsHuman("the document is empty")
        return {"ok": True}

    @step(working="delivering", done="delivered")
    def deliver(self, verdict, ctx):
        return {"delivered": True}
