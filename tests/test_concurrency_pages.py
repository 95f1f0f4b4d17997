"""The console's concurrency keys: the limits page's busy keys and the job page's key.

Jobs are submitted under keys and let in or handed back by the store and the engine
(``durable.store.concurrency.admit``, the runner's hand-back), so the rows and the words
are theirs; each page must say what those rows say: who holds a key, who waits, in what
order, and why a waiting job is throttled.
"""

import re

import pytest
from django.db import transaction
from django.test import override_settings

import durable
from durable.models import ConcurrencyKey, Job, JobEvent
from durable.reads import concurrency as reads
from durable.store import concurrency as store
from durable.store import locking
from tests.test_console_support import make_user
from tests.test_limits_pages import text

pytestmark = pytest.mark.django_db

URL = "/admin/durable/limits/"
KEY = "conversation:1"
DECLARED = {"conversation:*": 1, "tenant:*": 3}


def claim(job_id):
    """Claim due jobs until ``job_id`` is claimed (the others stay leased, as by other workers)."""
    claimed = locking.claim_job("w", 60)
    while claimed is not None and claimed.id != job_id:
        claimed = locking.claim_job("w", 60)
    assert claimed is not None, job_id
    return claimed


def hand_back(claimed):
    """Ask the engine to run the claimed job's step: not let in under its key, it is handed back throttled."""
    from durable.engine.worker import Worker

    runner = Worker(name="w", burst=True).runner
    runner.heartbeat = None
    assert runner.run_step(runner._begin(claimed)) is None


@pytest.fixture
def conversation():
    """Three messages of one conversation: c0 let in and running, c1 handed back, c2 not taken yet.

    Beside it: a tenant with two jobs let in and one waiting behind them (the key allows 3
    at once, so it is free, not yet taken), and a conversation whose only job finished.
    """
    for n in range(3):
        durable.submit("recorded", f"c{n}", {}, concurrency_key=KEY)
    first = claim("c0")
    assert store.admit(first.id, KEY, first.concurrency_seq).go
    hand_back(claim("c1"))
    for n in range(3):
        durable.submit("recorded", f"t{n}", {}, concurrency_key="tenant:1")
    for n in range(2):
        claimed = claim(f"t{n}")
        assert store.admit(claimed.id, "tenant:1", claimed.concurrency_seq).go
    durable.submit("recorded", "old", {}, concurrency_key="conversation:2")
    Job.objects.filter(pk="old").update(state="c_done", next_run_at=None)


def from_rows(key):
    """What the rows say of ``key``: its active jobs, how many wait, the first of them in line."""
    holders = list(ConcurrencyKey.objects.get(pk=key).holders)
    active = sorted(store.unfinished(key).filter(pk__in=holders).values_list("pk", flat=True))
    waiting = store.unfinished(key).exclude(pk__in=active).order_by("concurrency_seq")
    return active, waiting.count(), waiting.values_list("pk", flat=True).first()


def key_row(html, key):
    found = re.search(rf'<tr class="durable-key-row" data-key="{re.escape(key)}">(.*?)</tr>', html, re.S)
    assert found is not None, key
    return found[1]


# The reads ------------------------------------------------------------------------------------


def test_the_busy_keys_are_what_the_rows_say_the_busiest_first(conversation):
    busy = reads.busy()
    assert busy.problem == "" and busy.more == 0 and busy.patterns == tuple(DECLARED.items())
    # As busy as each other (3 unfinished jobs), by name; conversation:2 has no unfinished job.
    assert [key.key for key in busy.keys] == [KEY, "tenant:1"]
    for key in busy.keys:
        active, waiting, oldest = from_rows(key.key)
        assert [m.job_id for m in key.active] == active
        assert key.waiting == waiting and key.oldest.job_id == oldest
    conv, tenant = busy.keys
    assert (conv.limit, conv.pattern, conv.unfinished, conv.free) == (1, "conversation:*", 3, 0)
    assert [m.job_id for m in conv.active] == ["c0"] and conv.waiting == 2 and conv.oldest.job_id == "c1"
    assert (tenant.limit, tenant.pattern, tenant.waiting, tenant.free, tenant.oldest.job_id) == (
        3, "tenant:*", 1, 1, "t2")


def test_a_holder_that_finished_no_longer_counts_and_the_next_in_line_is_the_oldest_waiting(conversation):
    Job.objects.filter(pk="c0").update(state="c_done", lease_owner=None, lease_until=None, next_run_at=None)
    conv = {key.key: key for key in reads.busy().keys}[KEY]
    assert conv.active == [] and conv.waiting == 2 and conv.oldest.job_id == "c1"
    assert conv.free == 1
    assert ConcurrencyKey.objects.get(pk=KEY).holders == {"c0": 0}  # the row still names it


def test_the_busy_keys_are_read_in_a_few_queries_however_many_keys_are_busy(django_assert_max_num_queries,
                                                                            monkeypatch):
    for n in range(12):
        for m in range(2):
            durable.submit("recorded", f"k{n}-{m}", {}, concurrency_key=f"tenant:{n}")
    for n in range(12):
        claimed = claim(f"k{n}-0")
        assert store.admit(claimed.id, f"tenant:{n}", claimed.concurrency_seq).go
    with django_assert_max_num_queries(6):
        busy = reads.busy()
    assert len(busy.keys) == 12 and all(len(k.active) == 1 and k.waiting == 1 for k in busy.keys)
    assert all(k.oldest.job_id == f"k{k.key.split(':')[1]}-1" for k in busy.keys)
    monkeypatch.setattr(reads, "KEYS_SHOWN", 5)
    with django_assert_max_num_queries(6):
        busy = reads.busy()
    assert len(busy.keys) == 5 and busy.more == 7


def test_beyond_the_busiest_keys_the_others_are_counted(monkeypatch, conversation):
    monkeypatch.setattr(reads, "KEYS_SHOWN", 1)
    busy = reads.busy()
    assert [key.key for key in busy.keys] == [KEY] and busy.more == 1


# The limits page -------------------------------------------------------------------------------


def test_the_limits_page_names_each_busy_key_its_active_jobs_and_its_oldest_waiting(client, conversation):
    client.force_login(make_user("viewer", "view_job"))
    html = client.get(URL).content.decode()
    body = text(html)
    assert "Concurrency keys" in body
    assert 'Declared in DURABLE["CONCURRENCY"]: conversation:* 1 at once, tenant:* 3 at once.' in body
    active, waiting, oldest = from_rows(KEY)
    assert (active, waiting, oldest) == (["c0"], 2, "c1")
    row = key_row(html, KEY)
    assert text(row) == f"{KEY} 1 at once c0 (number 1) 2 c1 (number 2, submitted 0 s ago) conversation:*"
    assert 'href="/admin/durable/job/c0/change/"' in row and 'href="/admin/durable/job/c1/change/"' in row
    assert "c2" not in row
    tenant = text(key_row(html, "tenant:1"))
    assert tenant.startswith("tenant:1 3 at once t0 (number 1), t1 (number 2) 1 t2 (number 3,")
    assert "conversation:2" not in body  # its only job finished
    # The busiest key first.
    assert html.index(f'data-key="{KEY}"') < html.index('data-key="tenant:1"')


def test_beyond_the_busiest_keys_the_page_says_how_many_more(client, monkeypatch, conversation):
    monkeypatch.setattr(reads, "KEYS_SHOWN", 1)
    client.force_login(make_user("viewer", "view_job"))
    body = text(client.get(URL))
    assert "… and 1 more key with unfinished jobs, not shown." in body
    assert 'data-key="tenant:1"' not in client.get(URL).content.decode()


def test_a_key_whose_pattern_changed_or_went_says_so(client, conversation):
    client.force_login(make_user("viewer", "view_job"))
    with override_settings(DURABLE={"CONCURRENCY": {"conversation:*": 2}}):
        html = client.get(URL).content.decode()
    # The row still lets one in at once: the setting is taken at the key's next submit.
    assert "1 at once" in text(key_row(html, KEY))
    assert "conversation:* (now 2 at once: the key takes it at its next submit)" in text(key_row(html, KEY))
    assert "no pattern covers it now" in text(key_row(html, "tenant:1"))


def test_when_no_key_is_busy_the_page_says_so(client):
    client.force_login(make_user("viewer", "view_job"))
    body = text(client.get(URL))
    assert "No concurrency key is busy: every job submitted under a key has finished." in body
    assert "No concurrency key is declared" not in body


def test_when_no_key_is_declared_the_page_says_how_to_declare_one(client):
    client.force_login(make_user("viewer", "view_job"))
    with override_settings(DURABLE={"CONCURRENCY": {}}):
        body = text(client.get(URL))
    assert "No concurrency key is declared" in body and "No concurrency key is busy" not in body
    assert "&quot;CONCURRENCY&quot;: {" in body and "&quot;conversation:*&quot;: 1," in body


def test_a_concurrency_setting_declared_wrong_is_named(client, conversation):
    client.force_login(make_user("viewer", "view_job"))
    with override_settings(DURABLE={"CONCURRENCY": {"conversation:*": 0}}):
        html = client.get(URL).content.decode()
    assert "CONCURRENCY[&#x27;conversation:*&#x27;] must be a whole number of jobs at once" in html
    assert "no pattern covers it now" in text(key_row(html, KEY))  # the rows are still shown


def test_staff_without_a_view_permission_are_refused_the_keys(client, conversation):
    client.force_login(make_user("nobody"))
    response = client.get(URL)
    assert response.status_code == 403 and KEY not in response.content.decode()
    client.force_login(make_user("limits-only", "view_limit"))
    assert 'data-key="conversation:1"' in client.get(URL).content.decode()


# The job page ---------------------------------------------------------------------------------


def job_page(client, job_id):
    return client.get(f"/admin/durable/job/{job_id}/change/").content.decode()


def part(html, element_id):
    found = re.search(rf'<div class="[^"]*" id="{element_id}"[^>]*>(.*?)</div>', html, re.S)
    return None if found is None else found[1]


def test_a_job_waiting_for_its_key_is_throttled_and_its_page_says_for_whom(client, conversation):
    event = JobEvent.objects.filter(job_id="c1", message__startswith="throttled until").get()
    assert "after 0 recorded calls: concurrency key conversation:1 (1 at once): job c0 is active" in event.message
    client.force_login(make_user("viewer", "view_job"))
    html = job_page(client, "c1")
    key = part(html, "job-concurrency")
    assert text(key).startswith(f"Concurrency key {KEY} (1 at once, declared by conversation:*): number 2 under it."
                                " Waiting for its turn: c0 is active.")
    assert 'href="/admin/durable/job/c0/change/"' in key and 'href="/admin/durable/limits/#concurrency-keys"' in key
    throttled = text(re.search(r'id="job-throttled">(.*?)</div>\s*</div>', html, re.S)[1])
    due = Job.objects.get(pk="c1").next_run_at
    assert throttled.startswith(f"Throttled: it waits its turn under its concurrency key {KEY}.")
    assert f"A worker looks again at {due:%H:%M:%S} UTC" in throttled
    assert "or as soon as a job of its key finishes" in throttled
    assert "after 0 recorded calls: concurrency key conversation:1 (1 at once): job c0 is active" in throttled
    assert "429" not in throttled and "provider" not in throttled


def test_a_job_not_taken_yet_waits_behind_the_one_submitted_before_it(client, conversation):
    client.force_login(make_user("viewer", "view_job"))
    html = job_page(client, "c2")
    assert "number 3 under it. Waiting for its turn: c0 is active; 1 submitted before it waits too." in text(
        part(html, "job-concurrency"))
    assert 'id="job-throttled"' not in html  # no worker handed it back: it was never taken


def test_the_active_job_s_page_says_it_holds_the_key_and_how_many_wait(client, conversation):
    client.force_login(make_user("viewer", "view_job"))
    key = text(part(job_page(client, "c0"), "job-concurrency"))
    assert "number 1 under it. Active: it holds one of the key's places until it finishes. 2 jobs of the key" \
           " wait for it." in key.replace("&#x27;", "'")
    tenant = text(part(job_page(client, "t0"), "job-concurrency"))
    assert "Active: it holds one of the key's places until it finishes, beside t1. 1 job of the key waits" \
           " for it." in tenant.replace("&#x27;", "'")
    assert "A place is free: the next worker to take it lets it in." in text(part(job_page(client, "t2"),
                                                                                 "job-concurrency"))


def test_once_the_active_job_finishes_the_next_is_woken_and_no_longer_throttled(client, conversation):
    with transaction.atomic():
        Job.objects.filter(pk="c0").update(state="c_done", lease_owner=None, lease_until=None, next_run_at=None)
        assert store.wake(KEY) == "c1"
    client.force_login(make_user("viewer", "view_job"))
    html = job_page(client, "c1")
    assert 'id="job-throttled"' not in html  # due now: the next worker lets it in
    assert "Waiting for its turn: no job of the key is active. A place is free: the next worker to take it" \
           " lets it in." in text(part(html, "job-concurrency"))
    assert "Finished: it holds none of the key" in text(part(job_page(client, "c0"), "job-concurrency"))


def test_a_job_with_no_key_shows_none(client, conversation):
    durable.submit("recorded", "plain", {})
    client.force_login(make_user("viewer", "view_job"))
    assert 'id="job-concurrency"' not in job_page(client, "plain")


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_counts_the_jobs_waiting_for_their_concurrency_key(client):
    for n in range(3):
        durable.submit("recorded", f"d{n}", {}, concurrency_key="conversation:2")
    durable.submit("recorded", "other", {})
    first = locking.claim_job("w", 60)
    assert first.id == "d0" and store.admit(first.id, "conversation:2", first.concurrency_seq).go
    # One holds the conversation; two wait for it; a job with no key is not counted.
    assert reads.waiting_total() == 2
    Job.objects.filter(pk="d0").update(state="c_done")
    assert reads.waiting_total() == 2  # the place is free, and both still wait to be let in
    assert store.admit("d1", "conversation:2", 2).go
    assert reads.waiting_total() == 1
    client.force_login(make_user("viewer", "view_job"))
    html = client.get("/admin/durable/dashboard/").content.decode()
    counter = re.search(r'<a href="([^"]*)" data-kind="keys"><span class="n">(\d+)</span>', html)
    assert counter is not None and counter.groups() == ("/admin/durable/limits/#concurrency-keys", "1")
