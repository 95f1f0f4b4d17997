"""The approval pages: the queue of open proposals, and one proposal with its decision.

Decisions go through the services in ``durable.approvals`` (approve, reject, prepare
again), which re-check the proposal's hash under a row lock. A decision they refuse shows
the proposal again, as it is now, with the reason (403 when the user may not decide, 409
when the proposal or the job moved). The rest of this module reads what the pages show.
"""

import json
import logging
from decimal import Decimal

from django.contrib import messages
from django.contrib.admin.utils import quote
from django.db.models import Sum
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse

from ..actions import approvals, kinds
from ..agents import outbox as agent_outbox
from ..agents import tools as agent_actions
from ..core import formats
from ..core.workflows import Action, registry
from ..exceptions import DecisionForbidden, DecisionRefused
from ..models import Approval, ApprovalStatus, EventKind, JobEvent, StepResult
from ..reads import reports
from ..store import locking
from .agents import turn_support
from .base import admin_url, context, require_view, show_json, url_or_blank

logger = logging.getLogger("durable.approvals")

# Decided or replaced proposals listed under the queue.
RECENT = 20
# Proposals listed in the queue (the oldest: they expire first); the total is shown.
QUEUE_ROWS = 200
_MICRO = Decimal("0.000001")

# Who may see proposals: view or change Approval, or decide them.
VIEW_PERMISSIONS = ("durable.view_approval", "durable.change_approval", approvals.PERMISSION)


# The pages ---------------------------------------------------------------------------------


def queue(request, admin_site):
    """Every job awaiting a decision (open or expired proposals), oldest first, then the latest decisions.

    At most QUEUE_ROWS are listed (the oldest, which expire first), with the total.
    """
    require_view(request, *VIEW_PERMISSIONS)
    now = locking.db_now()
    waiting = pending_proposals()
    total = waiting.count()
    pending = [
        {"approval": a, "url": admin_url(admin_site, "durable_approval", a.pk),
         "job_url": url_or_blank(admin_site, "durable_job_change", quote(a.job_id)),
         **_timing(a, now)}
        for a in waiting[:QUEUE_ROWS]
    ]
    recent = (
        Approval.objects.exclude(status=ApprovalStatus.REQUESTED)
        .select_related("job", "decided_by").order_by("-id")[:RECENT]
    )
    ctx = context(
        request, admin_site, "Proposals awaiting approval", "approvals",
        opts=Approval._meta,
        pending=pending,
        pending_total=total,
        pending_more=max(total - len(pending), 0),
        recent=[{"approval": a, "url": admin_url(admin_site, "durable_approval", a.pk),
                 "job_url": url_or_blank(admin_site, "durable_job_change", quote(a.job_id)),
                 "story": story(a, now)}
                for a in recent],
        can_decide=approvals.can_decide(request.user),
        now=now,
    )
    return TemplateResponse(request, "admin/durable/approvals/queue.html", ctx)


def detail(request, admin_site, pk):
    """One proposal: what approving it does; on POST, the decision."""
    require_view(request, *VIEW_PERMISSIONS)
    if request.method == "POST":
        return _decide(request, admin_site, pk)
    return _proposal_page(request, admin_site, pk)


def _proposal_page(request, admin_site, pk, *, status=200):
    try:
        approval = Approval.objects.select_related("job", "decided_by").get(pk=pk)
    except Approval.DoesNotExist:
        raise Http404(f"There is no proposal {pk}") from None
    job = approval.job
    now = locking.db_now()
    proposal = approval.proposal or {}
    values = proposal.get("values") or {}
    rows = []
    for key in sorted(values, key=str):
        text, block = _render_value(values[key])
        rows.append({"key": key, "text": text, "block": block})
    diff = []
    if approval.status == ApprovalStatus.REQUESTED:
        for row in record_diff(current_record(approval), values):
            before, _ = _render_value(row["before"])
            after, _ = _render_value(row["after"])
            diff.append({**row, "before": "—" if row["new"] else before, "after": after})
    timing = _timing(approval, now)
    history = list(
        Approval.objects.filter(job_id=job.pk, step=approval.step).exclude(pk=approval.pk)
        .select_related("decided_by").order_by("-id")
    )
    earlier = [a for a in history if a.pk < approval.pk]
    later = [a for a in history if a.pk > approval.pk]
    # Open: the job waits on this proposal (the latest), undecided or expired undecided.
    open_ = (approval.status in (ApprovalStatus.REQUESTED, ApprovalStatus.EXPIRED)
             and not later and job.state == approvals.awaiting_state(approval))
    may_decide = approvals.can_decide(request.user)
    replaced = earlier[0] if earlier else None
    call = agent_actions.editable_call(approval) if _turn_based(approval) else None
    ctx = context(
        request, admin_site, f"Proposal {approval.pk} for {job.workflow}.{approval.step}",
        "approvals",
        opts=Approval._meta,
        queue_url=admin_url(admin_site, "durable_approvals"),
        approval=approval,
        job=job,
        proposal=proposal,
        values=rows,
        diff=diff,
        cost=cost_so_far(job.pk, approval.step),
        timing=timing,
        can_decide=may_decide,
        show_decision=may_decide and open_ and not timing["expired"],
        show_prepare_again=may_decide and open_ and timing["expired"],
        story=story(approval, now, later=later),
        on_reject=_on_reject(job, approval, call),
        told_on_reject=call is not None and call[0].on_reject == "note",
        model_message=approvals.MODEL_MESSAGE,
        arguments=_argument_fields(*call) if call else [],
        sources=[{**src, "text": _render_value(src.get("value"))[0]} for src in approval.sources or []],
        replaced=replaced,
        replaced_url=admin_url(admin_site, "durable_approval", replaced.pk) if replaced else "",
        changes=value_changes(replaced, approval) if replaced else [],
        history=[(heading, [{"approval": a, "url": admin_url(admin_site, "durable_approval", a.pk)}
                            for a in group])
                 for heading, group in (("Earlier proposals for this step", earlier),
                                        ("Later proposals for this step", list(reversed(later))))],
        # The console may be installed on a site that does not register Job.
        job_url=url_or_blank(admin_site, "durable_job_change", quote(job.pk)),
        # An agent's proposal: its turn on the job page, and the reads it was based on.
        turn=turn_support(approval, lambda value: show_json(value, request.user, limit=1500)),
    )
    return TemplateResponse(request, "admin/durable/approvals/detail.html", ctx, status=status)


def _decide(request, admin_site, pk):
    decision = request.POST.get("decision", "")
    seen = request.POST.get("proposal_hash", "")
    try:
        if not approvals.can_decide(request.user):
            raise DecisionForbidden(
                "You may view proposals but not decide them: the permission"
                f" '{approvals.PERMISSION}' is missing. Nothing was changed."
            )
        warning = ""
        if decision == "approve":
            approval = approvals.approve(pk, seen, request.user, request.POST.get("note", ""))
            done, warning = _after_approval(approval)
        elif decision == "approve_edited":
            original = _original(pk)
            arguments = edited_arguments(request.POST, original)
            approval = agent_actions.approve_edited(pk, seen, request.user, arguments,
                                                    request.POST.get("note", ""))
            done, warning = _after_approval(approval)
        elif decision == "reject":
            approval = approvals.reject(pk, seen, request.user, request.POST.get("reason", ""),
                                        request.POST.get("model_message"))
            done = _after_rejection(approval)
        elif decision == "prepare_again":
            approvals.prepare_again(pk, request.user, request.POST.get("reason", ""))
            done = "The step will prepare a new proposal from current inputs."
        else:
            raise DecisionRefused(f"Unknown decision {decision!r}; use the buttons.")
    except DecisionForbidden as exc:
        messages.error(request, str(exc))
        return _proposal_page(request, admin_site, pk, status=403)
    except DecisionRefused as exc:
        messages.error(request, str(exc))
        return _proposal_page(request, admin_site, pk, status=409)
    if warning:
        messages.warning(request, warning)
    else:
        messages.success(request, done)
    return HttpResponseRedirect(admin_url(admin_site, "durable_approvals"))


def _original(pk):
    try:
        return Approval.objects.select_related("job").get(pk=pk)
    except (Approval.DoesNotExist, ValueError, TypeError):
        raise DecisionRefused(f"There is no proposal {pk!r}") from None


def _turn_based(approval):
    """Whether the proposal's action is decided turn by turn (an agent's tool call), as its kind says."""
    job = approval.job
    return job.workflow in registry and kinds.of(job.definition).turn_based


def _open_left(approval):
    return Approval.objects.filter(job_id=approval.job_id, status=ApprovalStatus.REQUESTED).count()


def _after_approval(approval):
    """``(success, warning)``: what the approver is told will happen, the check before dispatch run now."""
    if _turn_based(approval):
        return _after_agent_approval(approval)
    changed = inputs_changed(approval)
    if changed:
        return "", (f"Approved, but nothing will be sent: {changed}. The check before dispatch"
                    " sets this approval aside and the step prepares a new proposal from current"
                    " inputs; it will appear in the queue for review.")
    return ("Approved. The dispatcher checks once more that the inputs are unchanged and the "
            "approval has not expired, then sends it; the job page shows the outcome."), ""


def _after_agent_approval(approval):
    """An agent's tool call: sent by its run once every proposal of the turn is decided."""
    job = approval.job
    what = f"{approval.proposal.get('operation')} to {approval.proposal.get('destination')}"
    call = agent_actions.editable_call(approval)
    changes = []
    if not _same_model_reply(approval):
        return "", ("Approved, but nothing will be sent as approved: the model reply that proposed"
                    " this call is no longer the one recorded, so the run proposes again from the"
                    " conversation as it is now; the new proposal will appear in the queue.")
    if call is not None and approval.sources:
        ctx = agent_outbox.OutsideRun(job, locking.db_now())
        changes = agent_outbox.changed_sources(ctx, call[0], job.definition, approval)
    if changes:
        return "", (f"Approved, but nothing will be sent: what this call was prepared from changed"
                    f" since it was proposed ({'; '.join(changes)}). Just before sending, the"
                    " check sets this approval aside and the agent is told, so it proposes again"
                    " from fresh data.")
    left = _open_left(approval)
    when = (f"once the {left} other proposal{'s' if left != 1 else ''} of this turn"
            f" {'are' if left != 1 else 'is'} decided" if left else "now: the agent resumes")
    again = (" Just before sending, what it was prepared from is read once more; if it changed,"
             " nothing is sent." if approval.sources else "")
    return (f"Approved: {approval.summary}. It will be sent ({what}, with the values on the"
            f" proposal, once) {when}.{again} The job page shows the outcome."), ""


def _same_model_reply(approval):
    """Whether the model reply an agent's proposal was prepared from is still the recorded one."""
    prefix = f"t{approval.turn}/model:"
    if not approval.input_version.startswith(prefix):
        return True  # prepared outside a turn's model call: nothing to compare
    fingerprint = StepResult.objects.filter(job_id=approval.job_id, step=prefix[:-1]).values_list(
        "fingerprint", flat=True).first() or ""
    return approval.input_version[len(prefix):].startswith(fingerprint[:16]) and bool(fingerprint)


def _after_rejection(approval):
    """What the rejecter is told happens next."""
    job = approval.job
    if not _turn_based(approval):
        if job.state == "cancelled":
            return "Rejected: nothing was sent, and the job is cancelled."
        return f"Rejected: nothing was sent; the job is now {job.state}, where a person takes it from there."
    call = agent_actions.editable_call(approval)
    left = _open_left(approval)
    when = (f" once the {left} other proposal{'s' if left != 1 else ''} of this turn"
            f" {'are' if left != 1 else 'is'} decided" if left else " now")
    if call is not None and call[0].on_reject == "cancel":
        return f"Rejected: nothing was sent. {call[0].name} cancels the job when rejected: its run stops{when}."
    return (f"Rejected: nothing was sent. The agent is told “{approval.model_message}” (your reason"
            f" stays in the audit trail) and its run goes on{when}.")


def inputs_changed(approval):
    """Why the proposal's inputs no longer hold, in words ("" when they do), as of now."""
    job = approval.job
    try:
        workflow = registry.get(job.workflow)
        st = workflow.steps_by_name[approval.step]
        current = approvals.version_text(workflow.input_version(job, approvals.context_for(job, st)))
    except Exception as exc:  # noqa: BLE001 - an unverifiable input is not a current one
        logger.exception("input_version failed for approval %s", approval.pk)
        return f"the inputs could not be read again to check them ({type(exc).__name__})"
    if current != approval.input_version:
        return "the inputs changed since this proposal was prepared"
    return ""


# Approving with edits: one field per argument of the tool's schema ---------------------------

_FIELD = "arg:"


def _argument_fields(tool, arguments):
    """The edit form's fields: name, kind of input, current text, choices, help."""
    schema = tool.parameters
    required = set(schema.get("required", []))
    fields = []
    for name, spec in schema.get("properties", {}).items():
        value = arguments.get(name)
        kind = spec.get("type")
        if "enum" in spec:
            widget = "select"
        elif kind in ("integer", "number"):
            widget = "number"
        elif kind == "boolean":
            widget = "boolean"
        elif kind == "string":
            widget = "text"
        else:
            widget = "json"
        text = ("" if value is None else json.dumps(value, ensure_ascii=False)
                if widget in ("json", "select") or kind == "boolean" else str(value))
        fields.append({
            "name": name, "field": f"{_FIELD}{name}", "widget": widget, "text": text,
            "step": "1" if kind == "integer" else "any", "required": name in required,
            "choices": [json.dumps(c, ensure_ascii=False) for c in spec.get("enum", [])],
            "help": spec.get("description", ""),
        })
    return fields


def edited_arguments(post, approval):
    """The arguments an edit form posted, read by the tool's schema; raises DecisionRefused."""
    call = agent_actions.editable_call(approval)
    if call is None:
        raise DecisionRefused("Only an agent's tool call can be approved with edits; this"
                              " proposal's arguments cannot be changed. Nothing was changed.")
    tool, _ = call
    properties = tool.parameters.get("properties", {})
    required = set(tool.parameters.get("required", []))
    arguments, problems = {}, []
    for field, text in post.items():
        if not field.startswith(_FIELD):
            continue
        name = field[len(_FIELD):]
        spec = properties.get(name)
        if spec is None:
            problems.append(f"{tool.name} has no argument {name!r}")
            continue
        text = text.strip()
        if not text and name not in required:
            continue  # left blank: the tool's default
        if spec.get("type") == "string" and "enum" not in spec:
            arguments[name] = text
            continue
        try:
            arguments[name] = json.loads(text)
        except ValueError:
            problems.append(f"{name}: {text[:80]!r} is not a valid {spec.get('type') or 'JSON value'}")
    if problems:
        raise DecisionRefused(f"These arguments do not fit {tool.name}: {'; '.join(problems)}."
                              " Nothing was changed.")
    return arguments


def _why(approval):
    """The last line of the note: why the engine closed the proposal."""
    lines = [line for line in (approval.note or "").splitlines() if line.strip()]
    return lines[-1].strip().rstrip(".") if lines else ""


def _at(moment):
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC" if moment else ""


def story(approval, now, *, later=()):
    """What happened to a proposal, in one or two sentences, for its page and its job's."""
    who = approval.decided_by.get_username() if approval.decided_by_id else ""
    status = approval.status
    if status == ApprovalStatus.REQUESTED and approval.expires_at > now:
        return f"Waiting for a decision; it expires at {_at(approval.expires_at)}."
    if status == ApprovalStatus.REQUESTED or (status == ApprovalStatus.EXPIRED and not who):
        text = f"Expired at {_at(approval.expires_at)} before anyone decided."
        return text + ("" if later else " Prepare it again to review a new proposal from current inputs.")
    if status == ApprovalStatus.APPROVED and approval.edited_from_id:
        return (f"Approved with changes by {who or 'someone'} at {_at(approval.decided_at)}:"
                f" it replaces proposal {approval.edited_from_id}, whose arguments they edited.")
    if status == ApprovalStatus.APPROVED:
        return f"Approved by {who or 'someone'} at {_at(approval.decided_at)}."
    if status == ApprovalStatus.REJECTED:
        return f"Rejected by {who or 'someone'} at {_at(approval.decided_at)}: {approval.note}"
    verb = "Superseded" if status == ApprovalStatus.SUPERSEDED else "Expired"
    why = _why(approval)
    if who:
        after = ("the agent is told and proposes again from fresh data" if _turn_based(approval)
                 else "the step prepares a new proposal from current inputs")
        return (f"Approved by {who} at {_at(approval.decided_at)}. {verb} before it was sent"
                f"{': ' + why if why else ''}. Nothing was sent; {after}.")
    return f"{verb}{': ' + why if why else ''}."


def value_changes(before, after):
    """The values that differ between two proposals: ``[{field, before, after}]``."""
    old = (before.proposal or {}).get("values") or {}
    new = (after.proposal or {}).get("values") or {}
    rows = []
    for key in sorted(set(old) | set(new), key=str):
        if key not in old or key not in new or (
                approvals.canonical_json(old[key]) != approvals.canonical_json(new[key])):
            rows.append({"field": key, "before": _render_value(old.get(key))[0] if key in old else "—",
                         "after": _render_value(new.get(key))[0] if key in new else "—"})
    return rows


def _on_reject(job, approval, call):
    """What a rejection does, in words: for an agent's tool call, what its tool says (``on_reject``)."""
    if call is not None:
        if call[0].on_reject == "cancel":
            return (f"Rejecting sends nothing and cancels the job ({call[0].name} cancels the run"
                    " when rejected): the agent stops for good.")
        return ("Rejecting sends nothing. The agent is told it was declined, in the message to the"
                " model below (your reason stays in the audit trail), and its run goes on.")
    definition = registry.get(job.workflow) if job.workflow in registry else None
    st = definition.steps_by_name.get(approval.step) if definition else None
    target = st.on_reject if st else "cancelled"
    if target == "cancelled":
        return "Rejecting cancels the job: nothing is sent and the job stops for good."
    return f"Rejecting sends nothing and moves the job to {target}, where a person takes it from there."


def _timing(approval, now):
    expired = approval.expires_at <= now
    return {
        "age": formats.age(now - approval.requested_at),
        "expired": expired,
        "expires_in": "" if expired else formats.age(approval.expires_at - now),
    }


def _render_value(value):
    if isinstance(value, (dict, list)):
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False), True
    if value is None:
        return "—", False
    return str(value), False


# What the pages read -----------------------------------------------------------------------


def pending_proposals():
    """The proposal of every job awaiting a decision (open or expired), oldest first."""
    return reports.awaiting_decision().select_related("job").order_by("requested_at", "id")


def cost_so_far(job_id, step=None):
    """The job's cost so far: its memos, plus the run that prepared ``step``'s proposal.

    An action step's memo is written only when its action is confirmed; until then its
    cost (the model call that prepared the proposal) is recorded on the proposal's event.
    """
    total = StepResult.objects.filter(job_id=job_id).aggregate(total=Sum("cost"))["total"]
    total = Decimal(total or 0)
    if step and not StepResult.objects.filter(job_id=job_id, step=step).exists():
        data = (
            JobEvent.objects.filter(job_id=job_id, step=step, kind=EventKind.ACTION,
                                    data__phase="enqueued")
            .order_by("-id").values_list("data", flat=True).first()
        ) or {}
        try:
            total += Decimal(str(data.get("cost", "0")))
        except ArithmeticError:
            pass
    return total.quantize(_MICRO)


def record_diff(current, values):
    """Rows comparing the target record now with the record after the proposal is applied."""
    if not isinstance(current, dict):
        return []
    rows = []
    for key in sorted(set(current) | set(values), key=str):
        before = current.get(key)
        after = values.get(key, before)
        rows.append({
            "field": key,
            "before": before,
            "after": after,
            "new": key not in current,
            "changed": key in values and (key not in current or approvals.canonical_json(before)
                                          != approvals.canonical_json(after)),
        })
    return rows


def current_record(approval):
    """The target record as the workflow reads it now, or None when it cannot tell."""
    job = approval.job
    if _turn_based(approval):
        return None  # an agent's tool call: what it was prepared from is shown instead
    try:
        workflow = registry.get(job.workflow)
        st = workflow.steps_by_name[approval.step]
        proposal = approval.proposal
        action = Action(proposal["destination"], proposal["operation"], proposal["values"],
                        approval.summary)
        return workflow.current_record(action, approvals.context_for(job, st))
    except Exception:  # noqa: BLE001 - the page still shows the proposal without a diff
        logger.exception("current_record failed for approval %s", approval.pk)
        return None
