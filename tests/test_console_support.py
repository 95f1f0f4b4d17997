"""Factories shared by the console and report tests: jobs, histories, memos and users.

Rows are written directly (not through workers) so a test can place jobs in any
state with any age; the timestamps that matter are then set with ``update()``,
which leaves ``auto_now`` alone.
"""

import datetime
from decimal import Decimal

from django.contrib.auth.models import Permission, User

from durable.models import EventKind, Job, JobEvent, Outbox, StepResult
from durable.store import locking

PIPELINE = "test_pipeline"


def ago(now, seconds):
    return now - datetime.timedelta(seconds=seconds)


def make_job(key, state, *, workflow=PIPELINE, age=0, now=None, history=None, **fields):
    """A job in ``state`` whose row last changed ``age`` seconds ago.

    ``history`` is a list of ``(from_state, to_state, seconds_ago)`` events; without it
    the job gets one event entering ``state`` ``age`` seconds ago.
    """
    now = now or locking.db_now()
    fields.setdefault("payload", {"doc": key})
    job = Job.objects.create(id=key, workflow=workflow, state=state, **fields)
    when = ago(now, age)
    Job.objects.filter(pk=key).update(updated=when, created=when)
    if history is None:
        history = [("", state, age)]
    elif history and not any(frm == "" for frm, _, _ in history):
        # As durable writes every job: created with its "submitted" event, entering the
        # state its first recorded move leaves.
        frm, _, seconds = max(history, key=lambda h: h[2])
        history = [("", frm, seconds), *history]
    for frm, to, seconds in history:
        event = JobEvent.objects.create(
            job_id=key, kind=EventKind.TRANSITION if frm else EventKind.SUBMITTED,
            from_state=frm, to_state=to,
        )
        JobEvent.objects.filter(pk=event.pk).update(at=ago(now, seconds))
    if history:
        first = max(seconds for _, _, seconds in history)
        Job.objects.filter(pk=key).update(created=ago(now, first))
    job.refresh_from_db()
    return job


def make_memo(job, step, cost, *, now=None, age=0, output=None, workflow=None, ms=10):
    now = now or locking.db_now()
    memo = StepResult.objects.create(
        job=job, step=step, cost=Decimal(str(cost)), output=output or {"step": step},
        duration=datetime.timedelta(milliseconds=ms), workflow=workflow or job.workflow,
    )
    StepResult.objects.filter(pk=memo.pk).update(at=ago(now, age))
    memo.refresh_from_db()
    return memo


def make_action(job, kind="deliver", *, status="unknown", **fields):
    fields.setdefault("destination", "crm")
    fields.setdefault("operation", "create_ticket")
    fields.setdefault("payload", {"title": f"ticket for {job.pk}"})
    fields.setdefault("params_hash", "0" * 64)
    fields.setdefault("idempotency_key", f"{job.pk}:{kind}:0000")
    return Outbox.objects.create(job=job, kind=kind, status=status, **fields)


def make_user(username, *perms, staff=True, superuser=False):
    """A user with the given ``durable.<codename>`` permissions (and ``password`` as password)."""
    user = User.objects.create_user(username, password="password", is_staff=staff,
                                    is_superuser=superuser)
    for perm in perms:
        app, codename = perm.split(".") if "." in perm else ("durable", perm)
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return User.objects.get(pk=user.pk)  # drop the permission cache


VIEW = ("view_job", "view_stepresult", "view_outbox", "view_approval", "view_jobevent",
        "view_pause")
OPERATE = (*VIEW, "requeue_job", "retry_job", "cancel_job", "send_back_job", "replay_step",
           "pause_workflow", "reconcile_action", "view_payload")


def make_finished(specs, *, now=None, workflow=PIPELINE, state="delivered"):
    """Finished jobs with memos, in a few queries: ``specs`` is ``[(key, age, {step: cost})]``."""
    now = now or locking.db_now()
    jobs = Job.objects.bulk_create(
        [Job(id=key, workflow=workflow, state=state, payload={}) for key, _, _ in specs]
    )
    memos = []
    for job, (_, age, costs) in zip(jobs, specs, strict=True):
        job.created = job.updated = ago(now, age)
        for i, (step, cost) in enumerate(costs.items()):
            memos.append(StepResult(job=job, step=step, cost=Decimal(str(cost)), workflow=workflow,
                                    output={"step": step}, duration=datetime.timedelta(seconds=1),
                                    at=ago(now, age + 30 * (len(costs) - i))))
    # bulk_update sets the timestamps as given: auto_now applies to save() only.
    Job.objects.bulk_update(jobs, ["created", "updated"])
    when = {(m.job_id, m.step): m.at for m in memos}
    StepResult.objects.bulk_create(memos)
    for memo in memos:
        memo.at = when[memo.job_id, memo.step]
    StepResult.objects.bulk_update(memos, ["at"])
    return jobs


def log_in(page, live_server, username, *, to="/admin/durable/dashboard/", viewport=None,
           password="password"):
    """Sign ``username`` in through the admin's login form in Chromium; the page lands on ``to``."""
    if viewport:
        page.set_viewport_size(viewport)
    page.goto(f"{live_server.url}/admin/login/?next={to}")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{to}")
    page.base = live_server.url
    return page
