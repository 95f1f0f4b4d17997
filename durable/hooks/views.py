"""The webhook view: authenticate the source, bound the body, deliver one signal.

Every refusal is a 4xx with ``{"error": "..."}`` and writes nothing. The view is
exempt from CSRF by design: its callers are other systems, authenticated by a
signature or a token, never a browser session (no cookie is read).
"""

import hashlib
import hmac
import json
import time

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from ..conf import durable_settings
from ..exceptions import JobFinished, PayloadInvalid, SignalConflict, UnknownJob

SIGNATURE_HEADER = "X-Durable-Signature"
TIMESTAMP_HEADER = "X-Durable-Timestamp"


class Refused(Exception):  # noqa: N818 - an answer, not an error
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def sign(secret, body, timestamp=None):
    """The headers that authenticate ``body`` (bytes) for a ``SECRET`` source."""
    timestamp = str(int(time.time() if timestamp is None else timestamp))
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: f"v1={digest}"}


@csrf_exempt
def receive(request, source):
    """POST hooks/durable/<source>/: deliver the signal in the JSON body; 201, or 200 for a replay."""
    try:
        return _receive(request, source)
    except Refused as refused:
        return JsonResponse({"error": refused.message}, status=refused.status)


def _receive(request, source):
    if request.method != "POST":
        response = JsonResponse({"error": "Send the signal with POST"}, status=405)
        response["Allow"] = "POST"
        return response
    config = (durable_settings.WEBHOOKS or {}).get(source)
    if not isinstance(config, dict):
        raise Refused(404, f"No webhook source is configured as {source!r}")
    body = _body(request)
    _authenticate(request, config, body, source)
    fields = _fields(body)
    from ..steps.inbox import signal

    try:
        sig = signal(fields["job"], fields["name"], fields.get("payload"),
                     dedupe_key=fields["dedupe_key"], source=f"webhook:{source}")
    except UnknownJob as exc:
        raise Refused(404, str(exc)) from None
    except (JobFinished, SignalConflict) as exc:
        raise Refused(409, str(exc)) from None
    except PayloadInvalid as exc:
        raise Refused(400, str(exc)) from None
    return JsonResponse(
        {"job": fields["job"], "name": fields["name"], "signal": sig.pk, "duplicate": sig.duplicate},
        status=200 if sig.duplicate else 201,
    )


def _body(request):
    limit = int(durable_settings.WEBHOOK_MAX_BYTES)
    too_large = Refused(413, f"The body is larger than {limit} bytes")
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise Refused(400, "The Content-Length header is not a number") from None
    if declared > limit:
        raise too_large
    body = request.read(limit + 1)
    if len(body) > limit:
        raise too_large
    return body


def _authenticate(request, config, body, source):
    secret, token = config.get("SECRET"), config.get("TOKEN")
    if secret:
        signature = request.headers.get(SIGNATURE_HEADER, "")
        stamp = request.headers.get(TIMESTAMP_HEADER, "")
        if not signature or not stamp:
            raise Refused(401, f"Source {source!r} signs its requests: send {TIMESTAMP_HEADER} and "
                               f"{SIGNATURE_HEADER}")
        try:
            sent = int(stamp)
        except ValueError:
            raise Refused(401, f"{TIMESTAMP_HEADER} must be the Unix time in whole seconds") from None
        tolerance = float(durable_settings.WEBHOOK_TOLERANCE_SECONDS)
        if abs(time.time() - sent) > tolerance:
            raise Refused(401, f"{TIMESTAMP_HEADER} is more than {tolerance:g} s away from now: "
                               "the request is stale or the sender's clock is wrong")
        expected = sign(secret, body, sent)[SIGNATURE_HEADER]
        if not hmac.compare_digest(expected.encode(), signature.strip().encode()):
            raise Refused(401, "The signature does not match the body: check the secret and sign "
                               "the timestamp, a dot and the raw body")
    elif token:
        given = request.headers.get("Authorization", "")
        if not given.startswith("Bearer "):
            raise Refused(401, f"Source {source!r} needs Authorization: Bearer <token>")
        if not hmac.compare_digest(given[len("Bearer "):].strip().encode(), str(token).encode()):
            raise Refused(401, "The bearer token is not this source's")
    else:
        raise Refused(404, f"Webhook source {source!r} has neither a SECRET nor a TOKEN configured")


def _fields(body):
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, "The body is not JSON (UTF-8)") from None
    if not isinstance(data, dict):
        raise Refused(400, 'The body must be a JSON object: {"job", "name", "payload", "dedupe_key"}')
    for field in ("job", "name", "dedupe_key"):
        value = data.get(field)
        if not isinstance(value, str) or not value:
            raise Refused(400, f"The field {field!r} is missing or not a non-empty string")
    unknown = sorted(set(data) - {"job", "name", "payload", "dedupe_key"})
    if unknown:
        raise Refused(400, f"Unknown fields: {', '.join(unknown)}")
    return data
