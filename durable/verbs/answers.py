"""A question for a person, answered: the value the step asked about, or steps run again.

A step declared ``needs_human=True`` raises ``NeedsHuman(reason)`` when it cannot decide
("the model is only 45% sure of the budget"); the job waits in ``needs_human`` with the
question as its last error. A person then either

- answers (:func:`answer`): corrects or supplies the value the step asked about (its
  input, laid out in the fields of the step's output) and it becomes the step's output,
  written by that person with their reason; the job returns to the step's start, where
  the worker finds that memo and goes on to the next step, as after a step it ran; or
- asks again (:func:`ask_again`): the job returns to the start of the asking step, or of
  an earlier one where the workflow's table lets a person send it there (a re-fetch), with
  the memos from there on set aside (their costs stay counted), so those steps run again.

The answer is checked like a step's output: JSON both databases store, within the
payload limit, and of the shape of the step's latest output in another job (its input's
when it has none yet): every field there, each of the same type (a number stays a
number) unless it was empty there.
"""

import datetime
import json
from dataclasses import dataclass

from django.db import transaction

from ..conf import durable_settings
from ..core.identity import same_json, storable_json
from ..core.states import StateKind
from ..core.workflows import registry
from ..exceptions import OperatorError
from ..models import EventKind, Job, StepResult
from ..store import audit, ledger, locking, moves
from . import jobs as services

# How far back an output of the asking step is looked for, as the answer's shape.
EXAMPLE_WINDOW = datetime.timedelta(days=30)
# JSON types by name, for the shape check and its messages.
_TYPES = ((bool, "true/false"), ((int, float), "a number"), (str, "text"), (list, "a list"),
          (dict, "an object"))


@dataclass(frozen=True)
class Question:
    """What a job in needs_human asks: the step, its question, the value it asked about."""

    job: Job
    step: str  # the step that asked
    question: str  # its NeedsHuman reason (the job's last error)
    value: object  # what a person corrects: the step's input, in the fields of its output
    shape: object  # what the answer must look like: an output of the step, else its input
    example: str  # the job whose output of this step gave the shape ("" when none did)
    start: str  # the state before the step: where the job returns
    # Steps a person may send the job back to, earliest first: (step name, state before it).
    again: tuple


def question(job):
    """The question ``job`` waits on, or None when it is not waiting for a person's answer.

    None as well for an agent (it is granted more, not answered) and for a job that
    reached needs_human otherwise (a rejected proposal's ``on_reject``).
    """
    if job.workflow not in registry or job.definition.runs_itself:
        return None
    table = job.table
    if table.kinds.get(job.state) != StateKind.HUMAN:
        return None
    arrived = job.events.filter(to_state=job.state).order_by("-id").first()
    states = table.step_of(arrived.from_state) if arrived else None
    if states is None or states.human != job.state:
        return None
    definition = job.definition
    steps = definition.steps
    index = next(i for i, s in enumerate(steps) if s.name == states.step)
    if steps[index].action:
        return None  # an action's output is its confirmed result, never typed in
    allowed = table.edges.get(job.state, ())
    again = tuple((s.name, table.states_for(s.name).before) for s in steps[:index + 1]
                  if table.states_for(s.name).before in allowed)
    if index == 0:
        given = job.payload
    else:
        memo = StepResult.objects.filter(job=job, step=steps[index - 1].name).first()
        given = memo.output if memo is not None else None
    example = _recent_output(job, states.step)
    shape = example.output if example is not None else given
    value = given
    if isinstance(shape, dict) and isinstance(given, dict):
        value = {key: given.get(key) for key in shape}
    return Question(job=job, step=states.step, question=job.last_error, value=value, shape=shape,
                    example=example.job_id if example is not None else "", start=states.before,
                    again=again)


def _recent_output(job, step):
    """The latest output of ``step`` by another job of the workflow (the last 30 days), or None.

    Bounded by the memo index (at, workflow, step), read from the newest end.
    """
    since = locking.db_now() - EXAMPLE_WINDOW
    return (StepResult.objects.filter(at__gte=since, workflow=job.workflow, step=step)
            .exclude(job_id=job.pk).order_by("-at").only("job_id", "output").first())


def check_shape(expected, value, path="the answer"):
    """Raise OperatorError when ``value`` does not have the shape of ``expected``.

    Every field of an object stays and keeps its type; a field that was empty (null)
    may take any value; new fields may be added. Lists are checked as lists only.
    """
    if expected is None:
        return
    want = next((name for kinds, name in _TYPES if isinstance(expected, kinds)), None)
    got = next((name for kinds, name in _TYPES if isinstance(value, kinds)), "null")
    if want is None:
        return
    if want != got or (want != "true/false" and isinstance(value, bool)):
        raise OperatorError(f"{path} must be {want}, like the step's output, not {got}")
    if isinstance(expected, dict):
        missing = [k for k in expected if k not in value]
        if missing:
            raise OperatorError(f"{path} leaves out {', '.join(map(repr, missing))}: the step's "
                                "output has every one of these fields")
        for key, inner in expected.items():
            check_shape(inner, value[key], key if path == "the answer" else f"{path}.{key}")


def check_answer(q, value):
    """``value`` as it will be stored, checked like a step's output; OperatorError if not."""
    try:
        text = storable_json(value, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise OperatorError(f"The answer cannot be stored as a step's output: {exc}") from None
    limit = durable_settings.MAX_PAYLOAD_BYTES
    if len(text.encode()) > limit:
        raise OperatorError(f"The answer is {len(text.encode())} bytes of JSON, over the limit "
                            f"of {limit} (DURABLE['MAX_PAYLOAD_BYTES'])")
    check_shape(q.shape, value)


def from_fields(expected, texts):
    """An answer built from ``expected`` (a flat object) with fields typed as text.

    ``texts`` maps field names to text (a form's fields, ``--set key=value``); a field
    not in it keeps its value. Each is read as the type the field had: text stays text,
    a number or true/false is read as JSON, an empty field may take either.
    """
    if not isinstance(expected, dict):
        raise OperatorError("the value asked about is not an object: give the whole answer as JSON")
    unknown = [k for k in texts if k not in expected]
    if unknown:
        raise OperatorError(f"the value asked about has no field {', '.join(map(repr, unknown))}"
                            f" (its fields: {', '.join(expected)})")
    value = dict(expected)
    for key, text in texts.items():
        old = expected[key]
        if isinstance(old, str):
            value[key] = text
            continue
        text = text.strip()
        if old is None and text == "":
            value[key] = None
            continue
        try:
            value[key] = json.loads(text)
        except ValueError:
            if old is not None:
                want = "true or false" if isinstance(old, bool) else "a number"
                raise OperatorError(f"{key} must be {want}, not {text!r}") from None
            value[key] = text
    return value


def changes(before, after):
    """The top-level fields an answer changed: ``{field: [before, after]}``."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return {} if same_json(before, after) else {"value": [before, after]}
    return {k: [before.get(k), v] for k, v in after.items()
            if k not in before or not same_json(before[k], v)}


def _locked_question(job_id):
    try:
        job = Job.objects.select_for_update().get(pk=job_id)
    except Job.DoesNotExist:
        raise OperatorError(f"There is no job {job_id!r}") from None
    q = question(job)
    if q is None:
        raise OperatorError(_nothing_to_answer(job))
    return q


def _nothing_to_answer(job):
    kind = registry.kind_of(job.workflow, job.state)
    if kind == StateKind.HUMAN and job.definition.runs_itself:
        return (f"Job {job.pk} is an agent waiting for a person: give it more turns or budget"
                f" (durable grant {job.pk} --turns N --budget X) or cancel it")
    if kind == StateKind.HUMAN:
        return (f"Job {job.pk} waits for a person but not on a step's question (a rejected"
                " proposal?): send it back or cancel it on its page")
    if kind == StateKind.FAILED:
        return f"Job {job.pk} is {job.state}, not waiting for a person: requeue it (durable requeue {job.pk})"
    return f"Job {job.pk} is {job.state}, not waiting for a person's answer"


def _reason(reason):
    reason = " ".join(str(reason or "").split())
    if not reason:
        raise OperatorError("Give a reason; it is recorded in the job's history")
    return reason


def answer(job_id, value, *, user=None, reason=""):
    """Answer the step's question with ``value``: it becomes the step's output; the job goes on."""
    reason = _reason(reason)
    with transaction.atomic():
        q = _locked_question(job_id)
        check_answer(q, value)
        job = q.job
        changed = changes(q.value, value)
        StepResult.objects.filter(job=job, step=q.step).delete()  # none: the step raised
        StepResult.objects.create(job=job, workflow=job.workflow, step=q.step, output=value,
                                  duration=ledger.ZERO, attempt=max(job.attempts, 1))
        said = ", ".join(f"{k} {b!r} → {a!r}" for k, (b, a) in changed.items()) or "as it was"
        _move(job, q.start, user, f"answered {q.step}: {said}. {reason}", "answer",
              {"step": q.step, "changed": changed})
    return job


def ask_again(job_id, *, step=None, user=None, reason=""):
    """Run ``step`` (default: the one that asked) and the steps after it again."""
    reason = _reason(reason)
    with transaction.atomic():
        q = _locked_question(job_id)
        job = q.job
        target = dict(q.again).get(step or q.step)
        if target is None:
            allowed = ", ".join(name for name, _ in q.again) or "none"
            raise OperatorError(f"Job {job.pk} cannot be sent back to step {step!r}; its table "
                                f"lets a person send it back to: {allowed}")
        names = [s.name for s in job.definition.steps]
        rerun = names[names.index(step or q.step):names.index(q.step) + 1]
        set_aside = ledger.set_aside(job.pk, rerun)
        # Recorded as a send back: the move it is, which a step may look for in the history.
        _move(job, target, user, f"run {' → '.join(rerun)} again. {reason}", "send back",
              {"steps": rerun, "set_aside": set_aside})
    return job


def send_back(job_id, *, to_state=None, user=None, reason=""):
    """Send a job waiting for a person back to ``to_state`` (a step's start).

    A job waiting on a step's question runs that step, and every step after ``to_state``,
    again (:func:`ask_again`); any other job waiting for a person takes the table's edge
    (``services.send_back``).
    """
    with transaction.atomic():
        job = Job.objects.filter(pk=job_id).first()
        q = question(job) if job is not None else None
        if q is None:
            return services.send_back(job_id, to_state=to_state, user=user, reason=reason)
        steps = {state: name for name, state in q.again}
        if to_state is not None and to_state not in steps:
            allowed = ", ".join(f"{state} (run {name} again)" for name, state in q.again)
            raise OperatorError(f"{job.state} -> {to_state} is not allowed; choose one of {allowed}")
        return ask_again(job_id, step=steps.get(to_state), user=user, reason=reason)


def _move(job, to, user, message, verb, data):
    ok = locking.transition(
        job, to, actor=audit.actor(user), message=message, kind=EventKind.OPERATOR,
        data={"verb": verb, **data},
        move=moves.run_again(error=""),
    )
    if not ok:
        raise OperatorError(f"Job {job.pk} moved while you were acting on it; reload and retry")
    audit.admin_log(user, job, f"{verb}: {job.state}. {message}")
