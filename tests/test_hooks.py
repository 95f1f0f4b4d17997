"""The signal webhook: per-source authentication, bounds, and a 4xx for each bad input."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings

import durable
from durable.hooks.views import sign
from durable.models import Job, JobEvent, Signal

from .test_engine import drain

pytestmark = pytest.mark.django_db

SECRET = "whsec-test-7f3a"
TOKEN = "tok-test-91c2"
SOURCES = {"shop": {"SECRET": SECRET}, "crm": {"TOKEN": TOKEN}, "empty": {}}
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(autouse=True)
def sources():
    with override_settings(DURABLE={**settings.DURABLE, "WEBHOOKS": SOURCES,
                                    "WEBHOOK_MAX_BYTES": 2048}):
        yield


@pytest.fixture
def waiting():
    durable.submit("confirm", "order-42", {})
    drain()
    assert Job.objects.get(pk="order-42").state == "awaiting_signal_ask"
    return "order-42"


def body(**fields):
    data = {"job": "order-42", "name": "confirmed", "payload": {"ok": True}, "dedupe_key": "evt-1"}
    data.update(fields)
    return json.dumps({k: v for k, v in data.items() if v is not None}).encode()


def post(client, raw, source="shop", headers=None, secret=SECRET, timestamp=None):
    if headers is None:
        headers = sign(secret, raw, timestamp)
    return client.post(f"/hooks/durable/{source}/", data=raw, content_type="application/json",
                       headers=headers)


def nothing_changed():
    return not Signal.objects.exists() and not JobEvent.objects.filter(kind="signal").exists()


def test_a_signed_request_delivers_the_signal_and_wakes_the_job(client, waiting):
    response = post(client, body())
    assert response.status_code == 201, response.content
    assert response.json()["duplicate"] is False
    sig = Signal.objects.get()
    assert (sig.job_id, sig.name, sig.payload, sig.source) == ("order-42", "confirmed", {"ok": True},
                                                               "webhook:shop")
    assert Job.objects.get(pk="order-42").next_run_at is not None  # due now
    drain()
    assert Job.objects.get(pk="order-42").result == {"signal": {"ok": True}}


def test_the_same_request_replayed_is_one_signal(client, waiting):
    raw = body()
    headers = sign(SECRET, raw)
    assert post(client, raw, headers=headers).status_code == 201
    again = post(client, raw, headers=headers)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert Signal.objects.count() == 1


def test_a_bearer_token_source(client, waiting):
    ok = post(client, body(), source="crm", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 201
    assert Signal.objects.get().source == "webhook:crm"


def finish_then_post(client, raw):
    Job.objects.filter(pk="order-42").update(state="finish_done")
    return post(client, raw)


# How each bad request of the test below is sent, given the client and a good body.
BAD_REQUESTS = {
    "no signature": lambda client, raw: post(client, raw, headers={}),
    "forged signature": lambda client, raw: post(
        client, raw, headers={**sign(SECRET, raw), "X-Durable-Signature": "v1=" + "0" * 64}),
    "other secret": lambda client, raw: post(client, raw, secret="guess"),
    "body changed after signing": lambda client, raw: post(
        client, body(payload={"ok": False}), headers=sign(SECRET, raw)),
    "stale timestamp": lambda client, raw: post(client, raw, timestamp=time.time() - 301),
    # Past the 300 s tolerance by more than a loaded machine takes to answer.
    "future timestamp": lambda client, raw: post(client, raw, timestamp=time.time() + 360),
    "timestamp not a number": lambda client, raw: post(
        client, raw, headers={**sign(SECRET, raw), "X-Durable-Timestamp": "soon"}),
    "not JSON": lambda client, raw: post(client, b"job=order-42&name=confirmed"),
    "not an object": lambda client, raw: post(client, b"[1, 2]"),
    "too large": lambda client, raw: post(client, body(payload="x" * 3000)),
    "unknown source": lambda client, raw: post(client, raw, source="nobody"),
    "source without credential": lambda client, raw: post(client, raw, source="empty"),
    "unknown job": lambda client, raw: post(client, body(job="nobody")),
    "finished job": finish_then_post,
    "missing name": lambda client, raw: post(client, body(name=None)),
    "missing dedupe key": lambda client, raw: post(client, body(dedupe_key=None)),
    "unknown field": lambda client, raw: post(client, json.dumps({**json.loads(raw), "extra": 1}).encode()),
    "payload not storable": lambda client, raw: post(client, body(payload="a\x00b")),
    "no bearer": lambda client, raw: post(client, raw, source="crm", headers={}),
    "wrong bearer": lambda client, raw: post(client, raw, source="crm", headers={"Authorization": "Bearer guess"}),
    "GET": lambda client, raw: client.get("/hooks/durable/shop/"),
}


@pytest.mark.parametrize(("case", "status", "message"), [
    ("no signature", 401, "signs its requests"),
    ("forged signature", 401, "does not match"),
    ("other secret", 401, "does not match"),
    ("body changed after signing", 401, "does not match"),
    ("stale timestamp", 401, "stale"),
    ("future timestamp", 401, "stale"),
    ("timestamp not a number", 401, "whole seconds"),
    ("not JSON", 400, "not JSON"),
    ("not an object", 400, "JSON object"),
    ("too large", 413, "larger than 2048"),
    ("unknown source", 404, "No webhook source"),
    ("source without credential", 404, "neither a SECRET nor a TOKEN"),
    ("unknown job", 404, "no job 'nobody'"),
    ("finished job", 409, "already finished"),
    ("missing name", 400, "'name' is missing"),
    ("missing dedupe key", 400, "'dedupe_key' is missing"),
    ("unknown field", 400, "Unknown fields: extra"),
    ("payload not storable", 400, "NUL"),
    ("no bearer", 401, "needs Authorization: Bearer"),
    ("wrong bearer", 401, "not this source's"),
    ("GET", 405, "POST"),
])
def test_each_bad_request_gets_a_clear_4xx_and_changes_nothing(client, waiting, case, status, message):
    response = BAD_REQUESTS[case](client, body())
    assert response.status_code == status, response.content
    assert message in response.json()["error"]
    assert nothing_changed()
    if case != "finished job":
        assert Job.objects.get(pk="order-42").next_run_at is None  # still parked, not woken


def test_a_conflicting_payload_under_a_delivered_dedupe_key_is_a_409(client, waiting):
    assert post(client, body()).status_code == 201
    response = post(client, body(payload={"ok": False}))
    assert response.status_code == 409 and "first delivery stands" in response.json()["error"]
    assert Signal.objects.get().payload == {"ok": True}


def test_the_view_is_csrf_exempt_under_an_enforcing_client(waiting):
    from django.test import Client

    response = post(Client(enforce_csrf_checks=True), body())
    assert response.status_code == 201


def readme_block(lang, marker):
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"<!-- {marker} -->\n```{lang}\n(?P<code>.*?)^```", text, re.M | re.S)
    assert match, f"README has no {lang} block after <!-- {marker} -->"
    return match["code"]


@pytest.mark.django_db(transaction=True)
def test_the_readme_signing_examples_deliver_a_signal_to_a_live_server(live_server):
    durable.submit("confirm", "order-42", {})
    url = f"{live_server.url}/hooks/durable/shop/"
    namespace = {}
    exec(readme_block("python", "signing example: python"), namespace)  # noqa: S102 - the sample
    response = namespace["send_signal"](url, SECRET, "order-42", "payment.settled",
                                        {"amount": 1200}, "evt_1")
    assert response.status_code == 201, response.text
    shell = subprocess.run(
        ["sh", "-c", readme_block("sh", "signing example: shell")], capture_output=True, text=True,
        env={**os.environ, "URL": url, "SECRET": SECRET}, timeout=30, check=False,
    )
    assert shell.returncode == 0, shell.stderr
    answer = json.loads(shell.stdout)
    assert answer["duplicate"] is False, answer
    got = {s.dedupe_key: s.payload for s in Signal.objects.filter(job_id="order-42")}
    assert got == {"evt_1": {"amount": 1200}, "evt_2": {"amount": 1200}}
