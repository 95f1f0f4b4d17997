"""The demo pipeline from the first article: fetch -> extract -> verify -> deliver.

    fetch    reads a lead over HTTP from the demo's document source
    extract  asks the simulated model for its fields (slow, priced, sometimes overloaded)
    verify   checks the fields; a doubtful budget goes to a person
    deliver  creates the lead in the CRM: an action, approved by a person above a threshold

``python manage.py demo`` starts the source and the CRM on 127.0.0.1 and submits a batch.
Beside it runs the support agent of the second article (``support.py``).
"""

import hashlib
import os
import re
from decimal import Decimal

import requests

from durable import Action, NeedsHuman, Output, Retry, Workflow, step

from . import model
from .support import SupportAgent  # noqa: F401 - registers the "customer_support" agent

# Deals at or above this many euros wait for a person's approval before the CRM sees them.
APPROVAL_THRESHOLD = Decimal(os.environ.get("DEMO_APPROVAL_THRESHOLD", "10000"))
# Below this confidence in the budget, verify asks a person.
CONFIDENCE_FLOOR = 0.7
# The demo's clock: 1.0 is real time; tests run the same pipeline faster.
SPEED = float(os.environ.get("DEMO_SPEED", "1.0"))

EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$")


def needs_approval(action, ctx):
    """Large deals need a person's approval before they are sent."""
    return Decimal(str(action.values["amount"])) >= APPROVAL_THRESHOLD


def reviewed_by_person(job_id):
    """Whether an operator sent this job back after looking at it."""
    from durable.models import EventKind, JobEvent

    return JobEvent.objects.filter(job_id=job_id, kind=EventKind.OPERATOR,
                                   data__verb="send back").exists()


class LeadPipeline(Workflow):
    name = "pipeline"
    version = 1

    @step(working="fetching", done="fetched", timeout=6,
          retry=Retry(max_attempts=4, base=0.2, cap=2.0))
    def fetch(self, payload, ctx):
        # (connect, read): a source that accepts and never answers costs 3s, not a lease.
        response = requests.get(payload["url"], timeout=(1.0, 3.0))
        response.raise_for_status()  # 5xx and 429 retry (honouring Retry-After), 404 is poison
        # A NUL character cannot be stored in PostgreSQL's jsonb (the memo): drop it here,
        # where the text enters the system, rather than fail at the commit.
        text = response.text.replace("\x00", "")
        return {"url": payload["url"], "text": text,
                "sha256": hashlib.sha256(text.encode()).hexdigest()}

    @step(working="extracting", done="extracted", timeout=5,
          retry=Retry(max_attempts=4, base=0.2, cap=2.0))
    def extract(self, doc, ctx):
        fields, cost = model.extract(doc["text"], seed=ctx.job_id, attempt=ctx.attempt,
                                     speed=SPEED)
        return Output(fields, cost=cost)

    @step(working="verifying", done="verified", needs_human=True, timeout=2)
    def verify(self, lead, ctx):
        problems = []
        if not EMAIL.match(lead.get("email", "")):
            problems.append(f"the email {lead.get('email')!r} does not look like an address")
        if lead["amount"] <= 0:
            problems.append("there is no budget")
        if lead["confidence"] < CONFIDENCE_FLOOR:
            problems.append(f"the model is only {lead['confidence']:.0%} sure of the budget")
        if problems and not reviewed_by_person(ctx.job_id):
            # A person looks, then sends the job back to verify (which accepts what
            # they saw) or cancels it.
            raise NeedsHuman("; ".join(problems))
        return {**lead, "verified_by": "a person" if problems else "rules"}

    @step(working="delivering", done="delivered", approval=needs_approval, timeout=5)
    def deliver(self, lead, ctx):
        values = {
            "company": lead["company"],
            "contact": lead["contact"],
            "email": lead["email"],
            "amount": lead["amount"],
            "currency": lead["currency"],
            "source": ctx.payload["url"],
        }
        summary = (f"Create a lead in the CRM for {lead['company']} ({lead['contact']}),"
                   f" budget {lead['amount']:,} {lead['currency']}")
        return Action("crm", "create_lead", values, summary=summary)

    def input_version(self, job, ctx):
        """The document the proposal was prepared from: a re-fetched change supersedes it."""
        return ctx.memos.get("fetch", {}).get("sha256", "")
