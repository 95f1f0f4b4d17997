"""Console POST abuse beyond CSRF and permissions (tested with the views): junk form
fields, junk job ids and NUL characters never cause a server error or a change.
"""

import itertools
import os
from urllib.parse import quote

import pytest
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable.models import Job, JobEvent
from tests.test_console_support import make_job

pytestmark = pytest.mark.django_db

_keys = itertools.count()
FUZZ = settings(max_examples=int(os.environ.get("DURABLE_PROPERTY_EXAMPLES", 25)), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Printable junk without NUL (NUL is its own, known case below).
junk = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=300)
VERBS = ["requeue", "retry", "cancel", "send_back"]


def act(pk, verb):
    return reverse("admin:durable_job_act", args=[pk, verb])


@FUZZ
@given(verb=st.sampled_from(VERBS), reason=junk, fields=st.dictionaries(junk, junk, max_size=4),
       state=st.sampled_from(["failed_fetch", "fetching", "delivered", "needs_human"]))
def test_any_form_body_on_a_job_verb_is_answered_without_a_server_error(
    operator, verb, reason, fields, state
):
    pk = f"fuzz-{next(_keys)}"
    make_job(pk, state)
    response = operator.post(act(pk, verb), {**fields, "reason": reason})
    assert response.status_code < 500
    job = Job.objects.get(pk=pk)
    assert job.state in job.table.kinds
    if response.status_code != 302 or not reason.split():
        # Refused (or no reason given): nothing may have moved.
        assert job.state == state


@FUZZ
@given(pk=junk.filter(lambda s: s.strip("/")), verb=st.sampled_from([*VERBS, "explode"]))
def test_a_junk_job_id_in_the_url_is_refused_not_a_server_error(operator, pk, verb):
    events = JobEvent.objects.count()
    response = operator.post(f"/admin/durable/job/{quote(pk, safe='')}/act/{verb}/",
                             {"reason": "fuzz"})
    assert response.status_code < 500
    assert JobEvent.objects.count() == events


def test_a_nul_character_in_a_reason_is_refused_and_changes_nothing(operator):
    make_job("bad0", "failed_fetch")
    events = JobEvent.objects.count()
    response = operator.post(act("bad0", "requeue"), {"reason": "looked at it\x00"})
    assert response.status_code == 400
    assert b"NUL character" in response.content
    assert Job.objects.get(pk="bad0").state == "failed_fetch"
    assert JobEvent.objects.count() == events


def test_a_nul_character_in_a_job_id_is_refused_never_a_server_error(operator):
    make_job("bad0", "failed_fetch")
    response = operator.post(act("bad\x000", "requeue"), {"reason": "x"})
    assert response.status_code == 400
    assert Job.objects.get(pk="bad0").state == "failed_fetch"


def test_a_nul_character_in_the_job_page_address_is_refused_never_a_server_error(operator):
    make_job("bad0", "failed_fetch")
    response = operator.get("/admin/durable/job/bad%000/change/")
    assert response.status_code == 400 and b"NUL character" in response.content
    assert response["X-Frame-Options"] == "DENY"
