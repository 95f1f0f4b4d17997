"""What is failing, and is it one cause or many: failed jobs grouped by cause.

The first article's query 3, with a sharper key than the first 60 characters of the
error: the step, the error class and the message with ids, numbers and quoted values
masked (HTTP status codes kept), hashed into a fingerprint.
"""

import datetime
import functools
import hashlib
import re
from dataclasses import dataclass, field

from django.db.models import Count, Max, Min, Q

from ..core.workflows import registry
from ..models import Job
from .scopes import Epoch, failed_q, scoped

# An HTTP status names the cause ("404 Client Error", "HTTP 503", "status code 429"):
# it is kept when ids, counts and ports are masked.
_STATUS_BEFORE = re.compile(r"(?:\bHTTP(?:/[\d.]+)?|\bstatus(?: code)?|\bcode)[\s:=]*$", re.I)
_STATUS_AFTER = re.compile(r"\s+(?:Client|Server) Error\b", re.I)


def _masked_number(match):
    number = match[0]
    if re.fullmatch(r"[1-5]\d\d", number) and (
        _STATUS_AFTER.match(match.string, match.end())
        or _STATUS_BEFORE.search(match.string, 0, match.start())
    ):
        return number
    return "<n>" if len(number) < 8 else "<hex>"


_CLASS = re.compile(r"^([A-Za-z_][\w.]*)(?::\s*|$)")
_NORMALISERS = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I), "<uuid>"),
    (re.compile(r"'[^']*'"), "'…'"),
    (re.compile(r'"[^"]*"'), '"…"'),
    (re.compile(r"\b[0-9a-f]*\d[0-9a-f]*\b", re.I), lambda m: _masked_number(m)),
    (re.compile(r"\s+"), " "),
]
MESSAGE_CHARS = 160


@functools.lru_cache(maxsize=50_000)
def split_error(text):
    """``(error class, normalised message)`` of a ``last_error``: ids, numbers and quotes removed."""
    text = (text or "").strip()
    cls = ""
    match = _CLASS.match(text)
    if match:
        cls, text = match[1], text[match.end():]
    for pattern, replacement in _NORMALISERS:
        text = pattern.sub(replacement, text)
    return cls, text.strip()[:MESSAGE_CHARS]


def step_of_state(workflow, state):
    if workflow in registry:
        states = registry.get(workflow).table.step_of(state)
        if states is not None:
            return states.step
    return state.removeprefix("failed_")


def fingerprint(workflow, state, last_error):
    """The failure's cause: workflow, step, error class and normalised message, hashed."""
    # Cached per process (a dashboard reads every failed job's error), keyed by the
    # registry's generation: a step's name comes from the tables.
    return _fingerprint(registry.generation, workflow, state, last_error)


@functools.lru_cache(maxsize=50_000)
def _fingerprint(generation, workflow, state, last_error):
    cls, message = split_error(last_error)
    step = step_of_state(workflow, state)
    digest = hashlib.sha256(f"{workflow}\0{step}\0{cls}\0{message}".encode()).hexdigest()[:16]
    return digest, step, cls, message


@dataclass
class FailureGroup:
    fingerprint: str
    workflow: str
    step: str
    error_class: str
    message: str
    example: str
    count: int = 0
    first_seen: datetime.datetime | None = None
    last_seen: datetime.datetime | None = None
    states: set = field(default_factory=set)

    def __post_init__(self):
        # {(workflow, state): {last_error, …}}: the errors as written, to find the group's
        # jobs by. Not a field: the group as data (``dataclasses.asdict``) stays JSON.
        self.errors = {}


def failed_jobs(workflow=None):
    return scoped(Job.objects.filter(failed_q()), workflow)


def failure_groups(*, workflow=None):
    """Jobs in failed states grouped by cause, most frequent first.

    The article's query 3, with a sharper key than the first 60 characters: the step,
    the error class and the message with ids, numbers and quoted values removed, so
    "document 'a-17' not found" and "document 'b-9' not found" are one cause.
    First and last seen are when those jobs entered their failed state.
    """
    groups = {}
    rows = (
        failed_jobs(workflow)
        .values("workflow", "state", "last_error")
        # Seconds, not datetimes: thousands of distinct messages are thousands of rows,
        # and a float is read far faster than a timestamp with its zone.
        .annotate(count=Count("pk"), first=Min(Epoch("updated")), last=Max(Epoch("updated")))
        .order_by()
    )
    for row in rows:
        digest, step, cls, message = fingerprint(row["workflow"], row["state"], row["last_error"])
        group = groups.get(digest)
        if group is None:
            group = groups[digest] = FailureGroup(
                digest, row["workflow"], step, cls, message, row["last_error"]
            )
        group.count += row["count"]
        group.states.add(row["state"])
        group.errors.setdefault((row["workflow"], row["state"]), set()).add(row["last_error"])
        group.first_seen = min(filter(None, (group.first_seen, row["first"])))
        group.last_seen = max(filter(None, (group.last_seen, row["last"])))
    for group in groups.values():
        group.first_seen = _moment(group.first_seen)
        group.last_seen = _moment(group.last_seen)
    return sorted(groups.values(), key=lambda g: (-g.count, g.workflow, g.step, g.message))


def _moment(seconds):
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(round(seconds, 6), tz=datetime.UTC)


def failure_group(digest, *, workflow=None):
    """The group with this fingerprint, or None when no failed job has it any more."""
    return next((g for g in failure_groups(workflow=workflow) if g.fingerprint == digest), None)


# Beyond this many distinct messages in one group, its jobs are found key by key.
ERRORS_BY_VALUE = 5000


def jobs_in_failure_group(digest, *, workflow=None, group=None):
    """A queryset of the failed jobs whose fingerprint is ``digest`` (``group``: its FailureGroup).

    Their errors as written (one grouped query) select them on the (workflow, state)
    index; a group of very many distinct messages is matched job by job instead.
    """
    if group is None:
        group = failure_group(digest, workflow=workflow)
    if group is None:
        return Job.objects.none()
    if sum(len(errors) for errors in group.errors.values()) <= ERRORS_BY_VALUE:
        q = Q(pk__in=[])
        for (wf, state), errors in sorted(group.errors.items()):
            q |= Q(workflow=wf, state=state, last_error__in=sorted(errors))
        return failed_jobs(workflow).filter(q)
    pks = [
        pk
        for pk, wf, state, error in failed_jobs(workflow).values_list(
            "pk", "workflow", "state", "last_error"
        )
        if fingerprint(wf, state, error)[0] == digest
    ]
    return Job.objects.filter(pk__in=pks)
