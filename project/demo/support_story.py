"""The support agent's part of ``manage.py demo``: start its world, crash it, tell what happened.

The model is a ``FakeModelServer`` in the demo's own process (its request log is what a
provider would have billed), reached by the workers through the real ``openai``
client; the CRM is the pipeline's, which loses some replies after acting; refunds go to
a payments service of their own. One request's model call is held on purpose while
the worker that made it is SIGKILLed, so the newcomer sees the agent resume from its
memos and pay for that one call again, and nothing else.
"""

import os
import signal
import time
from collections import Counter
from decimal import Decimal

from django.conf import settings
from django.db.models import Sum
from django.urls import reverse

from durable.core import formats
from durable.models import Approval, Budget, BudgetHold, EventKind, HoldState, Job, JobEvent, Outbox, StepResult
from durable.testing import FakeModelServer, ReceiverProcess, read_store
from durable.testing.fake_openai import turn_of
from durable.verbs import jobs as services

from .processes import in_group, pid_of
from .support import MODEL, REFUND_APPROVAL_ABOVE, REQUESTS
from .support_model import conversation, support_script

WORKFLOW = "customer_support"
# The shop is the demo's one tenant: its model calls spend from DURABLE["BUDGETS"]["tenant:*"].
TENANT = "tenant:demo-shop"
# The request whose model call is interrupted: the large refund, at its third call
# (after the order was looked up and the ticket opened), so the resumed run replays
# a read tool and an action from their memos before it asks the model again.
VICTIM = 1
VICTIM_TURN = 2  # assistant messages already in the conversation: the third model call


def _is_victim(body):
    return conversation(body) == REQUESTS[VICTIM] and turn_of(body) == VICTIM_TURN


class SupportStory:
    """The agent's world, its jobs and its report, for the demo command."""

    def __init__(self, command, folder, lose_replies):
        self.command = command
        self.folder = folder
        self.lose_replies = lose_replies
        self.model = None
        self.refunds = None
        self.keys = []
        self.workflow = WORKFLOW

    def say(self, text):
        self.command.say(text)

    # The outside world -------------------------------------------------------------

    def start(self, started, crm):
        """Start the model server and the payments service; return the workers' environment."""
        self.crm = crm
        self.model = FakeModelServer(support_script, model=MODEL).start()
        self.model.hold(_is_victim)  # held until the worker that asked is killed
        started.append(("model", self.model))
        self.refunds = ReceiverProcess(self.folder / "refunds.jsonl", seed=11).start()
        started.append(("refunds", self.refunds))
        prices = settings.DURABLE.get("MODEL_PRICES", {}).get(MODEL, {})
        self.say(f"   model server     {self.model.url}  (OpenAI chat completions; {MODEL} at"
                 f" {prices.get('input', '?')} / {prices.get('output', '?')} per million tokens"
                 " in / out)")
        self.say(f"   payments         {self.refunds.url}  (refunds; idempotency keys, lookup)")
        return {"DEMO_MODEL_URL": self.model.url, "DEMO_REFUNDS_URL": self.refunds.url}

    def submit(self, run):
        for n, message in enumerate(REQUESTS, start=1):
            key = f"support-{n}-{run}"
            services.submit(WORKFLOW, key, {"message": message}, submitted_by="demo", budget_key=TENANT)
            self.keys.append(key)
        self.say(f"   {len(self.keys)} customer messages for the support agent ({self.keys[0]} .."
                 f" {self.keys[-1]}); refunds above {REFUND_APPROVAL_ABOVE} EUR need approval")

    # The crash ---------------------------------------------------------------------

    def kill_mid_call(self, runworkers, timeout=90):
        """SIGKILL the worker waiting on the held model call, then let the server answer."""
        key = self.keys[VICTIM]
        try:
            self.model.wait_for_calls(1, timeout=timeout, match=_is_victim)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                job = Job.objects.get(pk=key)
                pid = pid_of(job.lease_owner or "")
                if job.state == "running" and pid and in_group(pid, runworkers.pid):
                    os.kill(pid, signal.SIGKILL)
                    self.say(f"   SIGKILL worker pid {pid} while it waited for the model's reply"
                             f" to {key}, turn {VICTIM_TURN + 1}; the model server answers"
                             " anyway (a provider bills a call the caller never reads)")
                    return {"job": key, "pid": pid}
                time.sleep(0.05)
            self.say(f"   the worker of {key} could not be found; nothing was killed")
            return None
        except TimeoutError:
            self.say(f"   {key} never reached its model call; nothing was killed")
            return None
        finally:
            self.model.release()

    # The report --------------------------------------------------------------------

    def summary(self, killed):
        self.command.heading("What the support agent did")
        jobs = {job.pk: job for job in Job.objects.filter(pk__in=self.keys)}
        states = Counter(job.state for job in jobs.values())
        self.say(f"   customers answered          {states['done']} of {len(self.keys)}"
                 f"  ({', '.join(f'{n} {s}' for s, n in sorted(states.items()))})")
        memos = StepResult.objects.filter(job_id__in=self.keys, kind="model")
        paid = Counter(conversation(call.body) for call in self.model.paid_calls())
        recorded = Counter(jobs[m.job_id].payload["message"] for m in memos)
        extra = sum(paid.values()) - sum(recorded.values())
        why = f" ({extra} more: the call the kill interrupted, asked again)" if extra else ""
        self.say(f"   model calls                 {sum(recorded.values())} recorded, one memo each;"
                 f" the model server was paid for {sum(paid.values())}{why}")
        tickets = [r for r in read_store(self.crm.store_path) if r["body"].get("type") == "ticket"]
        per_request = Counter(r["body"]["request"] for r in tickets)
        lost = Outbox.objects.filter(job_id__in=self.keys, kind="ticket", lookups__gt=0).count()
        twice = sorted(request for request, n in per_request.items() if n > 1)
        each = f"TWICE for {', '.join(twice)}" if twice else "one per request at most"
        self.say(f"   CRM tickets                 {len(tickets)} for {len(self.keys)} requests"
                 f" ({each}, {len({r['key'] for r in tickets})} distinct idempotency keys);"
                 f" {lost} lost replies settled by looking the key up")
        refunds = read_store(self.refunds.store_path)
        self.say(f"   refunds sent                {len(refunds)}"
                 f" ({', '.join(r['body']['amount'] + ' EUR' for r in refunds) or 'none'})")
        if killed:
            job = jobs[killed["job"]]
            taken = JobEvent.objects.filter(job_id=job.pk, kind=EventKind.RECLAIMED).first()
            replayed = memos.filter(job_id=job.pk, turn__lte=VICTIM_TURN).count()
            self.say(f"   the killed worker's request {job.pk}: "
                     + (f"taken over by {taken.actor} once the lease expired; " if taken else "")
                     + f"its first {replayed} model calls and their tool calls came from memos,"
                     f" the interrupted one was asked again; now {job.state}")
        self.say("   cost per model call:")
        for memo in memos.order_by("job_id", "seq"):
            self.say(f"      {memo.job_id:24} {memo.step:9} {memo.model:11} {memo.input_tokens:5} in"
                     f" {memo.output_tokens:4} out  {formats.money(memo.cost)}")
        total = memos.aggregate(total=Sum("cost"))["total"] or Decimal(0)
        # Model cost is in DURABLE["CURRENCY"] (the price list's), as the console writes it.
        self.say(f"      {'total':24} {'':9} {'':11} {'':5}    {'':4}  {formats.money(total)}")
        budget = Budget.objects.filter(scope=TENANT).order_by("-period_start").first()
        if budget is not None:
            held = BudgetHold.objects.filter(budget=budget, state=HoldState.OPEN).aggregate(
                total=Sum("worst"))["total"] or Decimal(0)
            self.say(f"   the shop's daily budget     {formats.money(budget.spent)} of {formats.money(budget.limit)}"
                     f" spent ({formats.money(budget.written_off)} of it the worst case of calls cut off by a"
                     f" kill), {formats.money(held)} reserved")

    def proposals(self):
        """The refunds waiting for a person: (approval, console path)."""
        waiting = Approval.objects.filter(job_id__in=self.keys, status="requested").order_by("pk")
        return [(a, reverse("admin:durable_approval", args=[a.pk])) for a in waiting]

    def where_to_look(self, base):
        for approval, path in self.proposals():
            self.say(f"   {'refund proposal':15} {base}{path}")
            self.say(f"   {'':15} {approval.summary}")
            self.say(f"   {'':15} (tool call {approval.step} of {approval.job_id}: approve it and"
                     " the refund is sent; reject it and the agent reads the message to the"
                     " model, never your reason)")

