"""A job's question for a person, answered on its page: the value, corrected and sent on.

The job page shows the question (``durable.verbs.answers.question``) with the value the step
asked about as a form: one field per value when it is a flat object (a number stays a
number), its JSON otherwise. The answer posts here and calls ``durable.verbs.answers.answer``.
"""

import json

from django.contrib import messages
from django.contrib.admin.utils import quote, unquote
from django.http import HttpResponseRedirect

from ..exceptions import DurableError, OperatorError
from ..models import Job
from ..verbs import answers
from .base import admin_url, form_reason, job_url, require, short_hashes

# The permission to answer: answering sends the job on, as a send back does.
PERMISSION = "durable.send_back_job"


def _is_flat(value):
    return isinstance(value, dict) and value and all(
        v is None or isinstance(v, (str, int, float, bool)) for v in value.values())


def _field(key, value):
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": "true" if value else "false"}
    if isinstance(value, (int, float)):
        return {"key": key, "type": "number", "value": json.dumps(value)}
    if value is None:
        return {"key": key, "type": "empty", "value": ""}
    return {"key": key, "type": "text", "value": value, "long": len(value) > 80}


def answer_form(admin_site, job, user):
    """What the job page shows for a question: None when there is none, or no permission."""
    q = answers.question(job)
    if q is None:
        return None
    flat = _is_flat(q.value)
    return {
        "question": short_hashes(q.question), "step": q.step, "example": q.example,
        "fields": [_field(k, v) for k, v in q.value.items()] if flat else [],
        "json": "" if flat else json.dumps(q.value, indent=2, ensure_ascii=False),
        "again": [{"state": state, "step": name, "asked": name == q.step}
                  for name, state in reversed(q.again)],
        "url": admin_url(admin_site, "durable_job_answer", quote(job.pk)),
        "may": user.has_perm(PERMISSION),
    }


def _parsed(q, post):
    """The answer in the form: from its fields (each read as the type it had) or its JSON."""
    if not _is_flat(q.value):
        try:
            return json.loads(post.get("answer", ""))
        except ValueError as exc:
            raise OperatorError(f"the answer is not JSON ({exc})") from None
    return answers.from_fields(q.value, {k: post.get(f"field:{k}", "") for k in q.value})


def job_answer(request, model_admin, object_id):
    """Answer a job's question (POST): the value becomes the step's output; back to the job."""
    job_id = unquote(object_id)
    back = job_url(model_admin.admin_site, job_id)
    require(request, PERMISSION, "answer jobs' questions", back)
    reason = form_reason(request)
    if not reason:
        messages.error(request, "Answer: give a reason; it is recorded in the job's history. "
                                "Nothing was changed.")
        return HttpResponseRedirect(back)
    job = Job.objects.filter(pk=job_id).first()
    q = answers.question(job) if job is not None else None
    try:
        if q is None:
            raise OperatorError(f"Job {job_id} has no question waiting for an answer"
                                + (f"; it is {job.state}" if job else ""))
        job = answers.answer(job_id, _parsed(q, request.POST), user=request.user, reason=reason)
    except DurableError as exc:
        messages.error(request, f"Answer refused: {exc}. Nothing was changed.")
    else:
        messages.success(request, f"Job {job_id} answered; {q.step} now holds your answer and the "
                                  f"job goes on from there (it is {job.state}, due now).")
    return HttpResponseRedirect(back)
