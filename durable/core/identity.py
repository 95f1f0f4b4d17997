"""Canonical JSON and every hash and key derived from a value: pure, no database.

Two text forms, each for a reason that outlives a refactor:

``canonical_json``
    The form a person's approval is bound to: sorted keys, no whitespace, one spelling
    per number (``42``, ``42.0`` and ``Decimal("42.00")`` are all ``42``), so that a value
    read back from a JSON column (or PostgreSQL's numeric) hashes the same.
    ``proposal_hash`` and ``version_text`` use it.

``_sorted_json``
    ``json.dumps`` with sorted keys and no whitespace, as the first release wrote it.
    ``params_hash`` (stored on every outbox row and part of the idempotency key a
    destination has seen) and ``output_hash`` (stored in replay events) are taken over
    it: another spelling would make an unsettled action look like a different one after
    an upgrade, and its resend would carry a different key.

``storable_json`` is the text the store writes (what both SQLite and PostgreSQL accept);
``has_nul`` and ``has_lone_surrogate`` are its checks, shared with ``submit``'s.
"""

import hashlib
import json
import math
import re
from decimal import Decimal

from django.core.serializers.json import DjangoJSONEncoder

# Approval.input_version is a CharField; longer fingerprints are stored as their hash.
_VERSION_MAX = 255


# Canonical JSON ------------------------------------------------------------------------------


def _number(value):
    """One spelling per numeric value: 42, 42.0 and Decimal('42.00') are all ``42``."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} cannot be part of a proposal (not a finite number)")
        # repr is the shortest text that round-trips, so a float read back from a
        # JSON column (or PostgreSQL's jsonb numeric) spells the same.
        value = Decimal(repr(value))
    if not value.is_finite():
        raise ValueError(f"{value!r} cannot be part of a proposal (not a finite number)")
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def _canonical(value):
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (float, Decimal)):
        return _number(value)
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"proposal keys must be strings, not {type(key).__name__} {key!r}")
        items = sorted(value.items())
        return "{" + ",".join(f"{_canonical(k)}:{_canonical(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    # Dates, UUIDs and the like: as DjangoJSONEncoder would send them.
    return _canonical(DjangoJSONEncoder().default(value))


def canonical_json(value):
    """Return ``value`` as canonical JSON: sorted keys, no whitespace, one spelling per number."""
    return _canonical(value)


def _sorted_json(value):
    """The first release's hash text: ``json.dumps`` with sorted keys (see the module docstring)."""
    return json.dumps(value, cls=DjangoJSONEncoder, sort_keys=True, separators=(",", ":"))


def _sha256(text):
    return hashlib.sha256(text.encode()).hexdigest()


# Proposals -----------------------------------------------------------------------------------


def make_proposal(destination, operation, values, input_version):
    """Return the proposal dict that is stored, shown and hashed."""
    return {
        "destination": destination,
        "operation": operation,
        "values": values,
        "input_version": input_version,
    }


def proposal_hash(proposal):
    """Return the sha256 (hex) of a proposal's canonical JSON."""
    return _sha256(canonical_json(proposal))


def hash_of_row(row, input_version):
    """Return the proposal hash of what an outbox row is about to send."""
    return proposal_hash(make_proposal(row.destination, row.operation, row.payload, input_version))


def version_text(value):
    """Return an input version as stored: a string of at most 255 characters."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else canonical_json(value)
    if len(text) > _VERSION_MAX:
        text = "sha256:" + _sha256(text)
    return text


# Actions -------------------------------------------------------------------------------------


def wire_values(values):
    """Return ``values`` as they are stored and sent: JSON types only (a Decimal is its string).

    Hashes are taken over this form, so they are hashes of exactly what the destination
    receives, and reading the row back from the database cannot change them.
    """
    if not isinstance(values, dict):
        raise TypeError(f"an action's values must be a dict, not {type(values).__name__}")
    try:
        return json.loads(json.dumps(values, cls=DjangoJSONEncoder, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the action's values are not JSON-serialisable: {exc}") from None


def params_hash(destination, operation, values):
    """sha256 of what the action does: changed parameters are a different operation."""
    return _sha256(_sorted_json({"destination": destination, "operation": operation,
                                 "values": wire_values(values)}))


_READABLE = re.compile(r"^[A-Za-z0-9._~-]{1,100}$")


def idempotency_key(job_id, kind, params):
    """The key sent with every attempt of this action: the job, the step and the parameters.

    Readable (``job.kind.hash``) when the job key is short and header-safe; otherwise
    a hash of all three, so any job key gives a valid, bounded header value.
    """
    if _READABLE.match(job_id) and _READABLE.match(kind):
        return f"{job_id}.{kind}.{params[:16]}"
    digest = _sha256(f"{job_id}\x00{kind}\x00{params}")
    return f"durable-{digest[:40]}"


def action_identity(job_id, kind, destination, operation, values):
    """``(params_hash, idempotency_key)`` of an action, the same in every process."""
    params = params_hash(destination, operation, values)
    return params, idempotency_key(job_id, kind, params)


# Memos ---------------------------------------------------------------------------------------


def output_hash(output):
    """A stable hash of a memo's output, to bind a decision to the memo it was made on."""
    return _sha256(_sorted_json(output))


# Storable JSON -------------------------------------------------------------------------------

# A NUL escape json.dumps wrote, not the text "\\u0000" a user wrote (its backslash doubled).
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def is_unicode(text):
    """Whether ``text`` is valid Unicode (no lone UTF-16 surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def has_nul(text):
    """Whether JSON ``text`` (written by json.dumps) holds a NUL character."""
    return "\\u0000" in text and bool(_NUL.search(text))


def has_lone_surrogate(text, value):
    """Whether ``value``, whose ASCII JSON is ``text``, holds a lone UTF-16 surrogate."""
    return "\\ud" in text and not is_unicode(json.dumps(value, cls=DjangoJSONEncoder,
                                                         ensure_ascii=False))


def storable_json(value, **kwargs):
    """JSON text of ``value`` that SQLite and PostgreSQL can both store.

    Raises TypeError for values JSON cannot represent and ValueError for NaN/infinity
    and for NUL characters and lone surrogates, which PostgreSQL's jsonb refuses at
    commit time (SQLite stores them, so development would not notice).
    """
    text = json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False, **kwargs)
    if has_nul(text):
        raise ValueError("it contains a NUL character (\\u0000), which PostgreSQL cannot store")
    if has_lone_surrogate(text, value):
        raise ValueError("it contains a lone UTF-16 surrogate, which is not Unicode")
    return text


def same_json(a, b):
    """Whether two JSON values are equal, numbers compared by value.

    PostgreSQL's jsonb stores numbers as numeric and may give a float back as an int
    (5.952212542729497e+16 returns as 59522125427294970): the same payload resubmitted
    must not look different.
    """
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        if a == b:
            return True
        try:
            return float(a) == float(b)
        except OverflowError:
            return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return a == b
