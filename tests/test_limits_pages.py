"""The console's limits: the limits page, its unpause button, the job page's throttled line, the dashboard.

Rows are written with the ORM as the runs leave them (``durable.store.limits``): a limit
with its schedule and its last 429, calls answered, refused, in flight, and runs waiting
their turn; each page must say what those rows say.
"""

import datetime
import re

import pytest
from django.contrib.admin.models import LogEntry
from django.test import override_settings
from django.utils.html import escape

import durable
from durable.models import EventKind, Job, JobEvent, Limit, Reservation, ReservationState
from durable.reads import limits as reads
from durable.store import locking
from durable.testing import FakeModelServer, reply
from tests.test_console_support import make_user

pytestmark = pytest.mark.django_db

LIMITS = {
    "fake": {"models": ["fake-model"], "requests_per_minute": 60, "tokens_per_minute": 10_000,
             "concurrent": 4, "headroom": 0},
    "other": {"providers": ["openai"], "concurrent": 2},
}
URL = "/admin/durable/limits/"
UNPAUSE = "/admin/durable/limits/unpause/"
DASHBOARD = "/admin/durable/dashboard/"


@pytest.fixture(autouse=True)
def declared():
    with override_settings(DURABLE={"LIMITS": LIMITS}):
        yield


def at(now, seconds):
    return now + datetime.timedelta(seconds=seconds)


def job(key, *, lease=False, due=0, now):
    """A job in its first step; ``lease``: a worker holds it now; ``due``: seconds until it is due
    (None: not due, as a cancelled or finished job)."""
    Job.objects.create(id=key, workflow="recorded", state="a_running", payload={}, lease_token=7,
                       next_run_at=None if due is None else at(now, due),
                       lease_owner="w1" if lease else None, lease_until=at(now, 60) if lease else None)
    return key


def reservation(limit, job_id, state, *, now, created=-1, settled=None, starts=None, tokens=0, used=None):
    return Reservation.objects.create(
        limit=limit, job_id=job_id, key=f"t{Reservation.objects.count()}/model", state=state, lease_token=7,
        created=at(now, created), settled_at=None if settled is None else at(now, settled),
        starts_at=None if starts is None else at(now, starts), tokens=tokens, used_tokens=used)


@pytest.fixture
def scene():
    """A limit at work: its schedule booked ahead, paused by a 429, calls answered, waiting, in flight.

    What the pages must show, from these rows alone:
    - fake: 3 calls answered in the last minute (600 tokens); 5 in the hour (700 tokens) and
      one 429; one call in flight (a live lease; the call whose lease passed is not); three runs
      throttled (booked, its turn in 30 s; queued for a slot; booked on both limits); paused 2 min
      by a 429; the runs a worker holds or that were cancelled do not wait;
    - other: one run throttled, also on fake (it counts once across limits);
    - retired: a row no longer declared.
    """
    now = locking.db_now()
    epoch = now.timestamp()
    Limit.objects.create(name="fake", requests_free=epoch + 30, tokens_free=epoch + 10, paused_until=epoch + 120,
                         token_ratio=1.25, refused_at=at(now, -20 * 60), refusal="HTTP 429: Rate limit reached",
                         refusals=3)
    Limit.objects.create(name="other")
    Limit.objects.create(name="retired", token_ratio=0.8)
    done = job("done-1", due=None, now=now)
    for seconds, used in ((-10, 100), (-20, 200), (-30, 300)):
        reservation("fake", done, ReservationState.SETTLED, now=now, created=seconds - 2, settled=seconds,
                    used=used, tokens=used)
    for _ in range(2):
        reservation("fake", done, ReservationState.SETTLED, now=now, created=-20 * 60 - 2, settled=-20 * 60,
                    used=50, tokens=60)
    reservation("fake", done, ReservationState.REFUSED, now=now, created=-20 * 60 - 1, settled=-20 * 60, used=0)
    # Two hours ago: outside the hour.
    reservation("fake", done, ReservationState.SETTLED, now=now, created=-7202, settled=-7200, used=999)
    calling = job("calling-1", lease=True, now=now)
    reservation("fake", calling, ReservationState.CALLING, now=now, created=-3, starts=-3, tokens=80)
    dead = job("dead-1", due=5, now=now)
    reservation("fake", dead, ReservationState.CALLING, now=now, created=-90, starts=-90, tokens=80)
    booked = job("booked-1", due=29, now=now)
    reservation("fake", booked, ReservationState.BOOKED, now=now, created=-40, starts=30, tokens=120)
    JobEvent.objects.create(
        job_id=booked, kind=EventKind.TRANSITION, step="a", actor="w1", from_state="a_running",
        to_state="a_running",
        message=f"throttled until {at(now, 29).isoformat(timespec='milliseconds')} after 2 recorded calls:"
                f" limit fake: its turn at {at(now, 30).isoformat()} (60 requests/min, 10,000 tokens/min)")
    queued = job("queued-1", due=5, now=now)
    reservation("fake", queued, ReservationState.QUEUED, now=now, created=-30)
    both = job("both-1", due=40, now=now)
    reservation("fake", both, ReservationState.BOOKED, now=now, created=-5, starts=41, tokens=40)
    reservation("other", both, ReservationState.BOOKED, now=now, created=-5, starts=41)
    # Not throttled: a worker holds it (it came back for its turn), or it was cancelled.
    held = job("held-1", lease=True, now=now)
    reservation("fake", held, ReservationState.BOOKED, now=now, created=-50, starts=1)
    gone = job("cancelled-1", due=None, now=now)
    reservation("fake", gone, ReservationState.BOOKED, now=now, created=-60, starts=2)
    return now


# Tags inside a line of text; every other tag ends a piece of text (a cell, a paragraph).
INLINE = re.compile(r"</?(?:a|strong|span|code|em|small|time|b|i)\b[^>]*>")


def text(html):
    """A page's (or a piece's) text without tags or runs of white space: what a reader reads."""
    html = html if isinstance(html, str) else html.content.decode()
    return " ".join(re.sub(r"<[^>]+>", " ", INLINE.sub("", html)).split())


# The reads --------------------------------------------------------------------------------------


def test_each_limit_s_use_is_counted_from_its_rows(scene):
    found, problem = reads.overview(scene)
    assert problem == ""
    assert [limit.name for limit in found] == ["fake", "other", "retired"]
    fake, other, retired = found
    assert (fake.calling, fake.requests_last_minute, fake.tokens_last_minute) == (1, 3, 600)
    assert (fake.hour_requests, fake.hour_tokens, fake.hour_refused) == (5, 700, 1)
    # The calls of 20 minutes ago are in the bucket that holds that moment, and only there.
    twenty = at(scene, -20 * 60)
    holding = [b for b in fake.hour if b.start <= twenty < b.start + datetime.timedelta(minutes=5)]
    assert [(b.requests, b.tokens, b.refused) for b in holding] == [(2, 100, 1)]
    assert len(fake.hour) == reads.BUCKETS and fake.hour[-1].start <= scene
    assert fake.waiting == 3 and [w.job_id for w in fake.oldest] == ["booked-1", "queued-1", "both-1"]
    assert [w.turn for w in fake.oldest] == [at(scene, 30), None, at(scene, 41)]
    assert fake.paused_until == Limit.moment(scene.timestamp() + 120)
    assert fake.next_free == fake.paused_until  # the pause ends after the last moment booked
    assert (other.waiting, other.calling, other.hour_requests) == (1, 0, 0)
    assert other.paused_until is None and other.next_free is None
    assert not retired.declared and retired.spec is None


def test_throttled_runs_are_counted_once_across_limits_and_paused_limits_are_named(scene):
    assert reads.throttled_count() == 3
    assert reads.throttled_count("recorded") == 3 and reads.throttled_count("elsewhere") == 0
    assert [limit.name for limit in reads.paused_limits(scene)] == ["fake"]
    Limit.objects.filter(pk="fake").update(paused_until=scene.timestamp() - 1)
    assert reads.paused_limits() == []


# The limits page ------------------------------------------------------------------------------


def test_the_page_says_what_each_limit_allows_its_use_and_who_waits(client, scene):
    client.force_login(make_user("viewer", "view_job"))
    response = client.get(URL)
    assert response.status_code == 200
    body = text(response)
    assert "fake — 60 requests/min, 10,000 tokens/min, 4 at once" in body
    assert "Counts the calls of models fake-model." in body
    assert "Counts the calls of every model of openai." in body
    assert "1 call of 4 at once" in body
    assert "3 requests (5 % of 60) · 600 tokens (6 % of 10,000)" in body
    assert "3 runs throttled" in body and "1 run throttled" in body
    until = Limit.moment(scene.timestamp() + 120)
    assert (f"Paused until {until:%H:%M:%S} UTC by the provider's 429: HTTP 429: Rate limit reached"
            in body)
    assert "3 in all" in body and "1.25 learnt from the replies' usage" in body
    assert "5 calls answered, 700 tokens, 1 refused (429)" in body
    assert f"{at(scene, 30):%H:%M:%S} UTC" in body and "when a call in flight ends" in body
    assert 'href="/admin/durable/job/booked-1/change/"' in response.content.decode()
    assert "retired" in body and "no longer declared" in body
    for gone in ("held-1", "cancelled-1", "dead-1"):
        assert gone not in body
    # Seen without the permission to lift a pause: no button.
    assert "Unpause now" not in body and UNPAUSE not in response.content.decode()


def test_the_page_is_in_the_console_s_tabs_and_the_app_index(client):
    client.force_login(make_user("viewer", "view_job"))
    html = client.get(DASHBOARD).content.decode()
    assert re.search(r'<nav class="durable-tabs".*href="/admin/durable/limits/"[^>]*>Limits</a>', html, re.S)
    assert URL in client.get("/admin/durable/").content.decode()


def test_staff_without_a_view_permission_are_refused_the_page(client):
    client.force_login(make_user("nobody"))
    assert client.get(URL).status_code == 403
    client.force_login(make_user("limits-only", "view_limit"))
    assert client.get(URL).status_code == 200


def test_with_no_limit_declared_the_page_says_how_to_declare_one(client):
    client.force_login(make_user("viewer", "view_job"))
    with override_settings(DURABLE={"LIMITS": {}}):
        body = text(client.get(URL))
    assert "No limit is declared" in body
    assert "&quot;requests_per_minute&quot;: 500" in body and "&quot;LIMITS&quot;" in body


def test_a_limit_declared_wrong_is_named_and_its_rows_still_shown(client, scene):
    client.force_login(make_user("viewer", "view_job"))
    with override_settings(DURABLE={"LIMITS": {"fake": {"rpm": 5}}}):
        body = text(client.get(URL))
    assert "LIMITS[&#x27;fake&#x27;] has unknown keys [&#x27;rpm&#x27;]" in body
    assert "no longer declared" in body  # without a declaration the rows are still there


# Unpause ----------------------------------------------------------------------------------------


def paused_until(name):
    return Limit.objects.get(pk=name).paused_until


def test_an_operator_lifts_a_pause_with_a_reason_and_it_is_recorded(client, scene):
    before = paused_until("fake")
    user = make_user("ops", "view_job", "pause_workflow")
    client.force_login(user)
    body = client.get(URL).content.decode()
    assert f'action="{UNPAUSE}"' in body and 'name="limit" value="fake"' in body
    assert body.count("Unpause now</button>") == 1  # only the paused limit has one
    refused = text(client.post(UNPAUSE, {"limit": "fake", "reason": "  "}, follow=True))
    assert "give a reason" in refused and paused_until("fake") == before
    response = client.post(UNPAUSE, {"limit": "fake", "reason": "the provider raised our tier"}, follow=True)
    assert response.redirect_chain == [(URL, 302)]
    assert "Limit fake unpaused" in text(response) and "Paused until" not in text(response)
    assert paused_until("fake") is None
    # Nothing else of the limit moved: its schedule, its last 429 and its count stay.
    row = Limit.objects.get(pk="fake")
    assert (row.requests_free, row.refusals, row.refusal) == (scene.timestamp() + 30, 3,
                                                              "HTTP 429: Rate limit reached")
    entry = LogEntry.objects.get(user=user)
    assert entry.object_repr == "fake" and "the provider raised our tier" in entry.change_message
    again = text(client.post(UNPAUSE, {"limit": "fake", "reason": "again"}, follow=True))
    assert "Limit fake is not paused now; nothing changed." in again


def test_an_unpause_without_the_permission_is_refused_and_changes_nothing(client, scene):
    before = paused_until("fake")
    client.force_login(make_user("viewer", "view_job"))
    response = client.post(UNPAUSE, {"limit": "fake", "reason": "x"})
    assert response.status_code == 403
    assert "durable.pause_workflow" in response.content.decode() and "Nothing was changed" in text(response)
    assert paused_until("fake") == before
    assert not LogEntry.objects.exists()


def test_a_tampered_unpause_naming_no_limit_says_so_and_changes_nothing(client, scene):
    before = paused_until("fake")
    client.force_login(make_user("ops", "view_job", "pause_workflow"))
    for name in ("nope", "", "fake'; --"):
        body = text(client.post(UNPAUSE, {"limit": name, "reason": "x"}, follow=True))
        assert escape(f"There is no limit {name!r}") in body
        assert "Nothing was changed." in body
    assert paused_until("fake") == before and not LogEntry.objects.exists()
    # A GET of the button's address explains instead of acting.
    response = client.get(UNPAUSE)
    assert response.status_code == 405 and paused_until("fake") == before


# The job page -----------------------------------------------------------------------------------


def job_page(client, key):
    return client.get(f"/admin/durable/job/{key}/change/")


def test_a_throttled_job_s_page_says_which_limit_until_when_and_why(client, scene):
    client.force_login(make_user("viewer", "view_job"))
    response = job_page(client, "booked-1")
    body = text(response)
    assert "Throttled: its next model call waits its turn under a provider limit." in body
    assert (f"Limit fake: its turn is at {at(scene, 30):%H:%M:%S} UTC, after the provider's pause (a 429)"
            f" that lasts until {Limit.moment(scene.timestamp() + 120):%H:%M:%S} UTC.") in body
    assert f"a worker takes the job again at {at(scene, 29):%H:%M:%S} UTC, just before it" in body
    assert "after 2 recorded calls: limit fake: its turn at" in body
    html = response.content.decode()
    assert re.search(r'id="job-throttled".*href="/admin/durable/limits/"', html, re.S)
    queued = text(job_page(client, "queued-1"))
    assert "every call it allows at once is in flight; it waits for one to finish" in queued
    both = text(job_page(client, "both-1"))
    assert "Limit fake: its turn" in both and "Limit other: its turn" in both


def test_a_job_a_worker_holds_or_that_was_cancelled_is_not_called_throttled(client, scene):
    client.force_login(make_user("viewer", "view_job"))
    for key in ("held-1", "cancelled-1", "done-1", "calling-1"):
        assert 'id="job-throttled"' not in job_page(client, key).content.decode(), key


def test_the_run_a_429_refused_waits_out_the_pause_and_its_page_says_so(client, scene):
    refused = job("refused-1", due=120, now=scene)
    reservation("fake", refused, ReservationState.REFUSED, now=scene, created=-2, settled=-1)
    JobEvent.objects.create(
        job_id=refused, kind=EventKind.TRANSITION, step="a", actor="w1", from_state="a_running",
        to_state="a_running",
        message=f"throttled until {at(scene, 120).isoformat(timespec='milliseconds')} after 1 recorded calls:"
                " limit fake: paused 120 s by the provider's 429")
    client.force_login(make_user("viewer", "view_job"))
    body = text(job_page(client, refused))
    assert "Throttled: the provider refused its model call (429), and it waits out the pause." in body
    until = Limit.moment(scene.timestamp() + 120)
    assert f"Limit fake: paused by the provider's 429 until {until:%H:%M:%S} UTC." in body
    assert "limit fake: paused 120 s by the provider&#x27;s 429" in body
    # Once the job moved on (a later event), the old reason no longer holds.
    JobEvent.objects.create(job_id=refused, kind=EventKind.OPERATOR, message="retry now")
    assert 'id="job-throttled"' not in job_page(client, refused).content.decode()


# The dashboard ----------------------------------------------------------------------------------


def test_the_dashboard_counts_throttled_runs_and_alerts_on_a_paused_limit(client, scene):
    client.force_login(make_user("viewer", "view_job"))
    html = client.get(DASHBOARD).content.decode()
    counter = re.search(r'<a href="([^"]*)" data-kind="throttled"><span class="n">(\d+)</span>', html)
    assert counter is not None and counter.groups() == (URL, "3")
    until = Limit.moment(scene.timestamp() + 120)
    alert = re.search(r'data-alert="limit_paused">(.*?)</div>\s*</div>', html, re.S)
    assert alert is not None
    words = text(alert[1])
    assert escape(f"Limit fake is paused by the provider's 429 until {until:%H:%M:%S} UTC") in words
    assert "3 runs wait on it" in words and "HTTP 429: Rate limit reached" in words
    assert f'href="{URL}"' in alert[1]
    # The pause over, the alert is gone; the runs still wait their turn.
    Limit.objects.filter(pk="fake").update(paused_until=None)
    html = client.get(DASHBOARD).content.decode()
    assert 'data-alert="limit_paused"' not in html
    assert re.search(r'data-kind="throttled"><span class="n">3</span>', html)


def test_durable_status_check_fails_while_a_429_pauses_a_limit_and_says_which(scene):
    from io import StringIO

    from django.core.management import CommandError, call_command

    out = StringIO()
    with pytest.raises(CommandError, match="alert") as raised:
        call_command("durable", "status", "--check", stdout=out)
    assert raised.value.returncode == 1
    assert "Limit fake is paused by the provider's 429" in out.getvalue()


def test_the_dashboard_counts_no_throttled_run_when_none_waits(client):
    client.force_login(make_user("viewer", "view_job"))
    html = client.get(DASHBOARD).content.decode()
    assert re.search(r'data-kind="throttled"><span class="n">0</span>', html)
    assert 'data-alert="limit_paused"' not in html


# A run a worker throttled -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_run_a_worker_throttled_is_shown_where_it_waits_on_every_page(client, run_worker_inline):
    """The engine's own rows and words, not ones written for the test: two agent runs at 6
    calls a minute, the second parked until its turn 10 s after the first's."""
    limit = {"fake": {"models": ["fake-model"], "requests_per_minute": 6, "headroom": 0}}
    with override_settings(DURABLE={"LIMITS": limit}), FakeModelServer([reply("Delivered.", usage=(30, 4))]) as server:
        for n in range(2):
            durable.submit("test_agent", f"a{n}", {"model_url": server.url, "message": f"Where is a{n}"})
        run_worker_inline()
        waiting = Job.objects.exclude(state="done").get(pk__in=["a0", "a1"])
        # Its turn is 10 s away, beyond the 3 s a limit's schedule is booked ahead: it queues.
        assert Reservation.objects.get(job=waiting).state == ReservationState.QUEUED
        client.force_login(make_user("viewer", "view_job"))
        page = text(job_page(client, waiting.pk))
        limits = text(client.get(URL))
        dashboard = client.get(DASHBOARD).content.decode()
    assert "Throttled: its next model call waits its turn under a provider limit." in page
    assert ("Limit fake: its schedule is booked as far ahead as it goes; the run waits in the limit's queue,"
            " 0 runs of its priority or higher before it") in page
    assert re.search(rf"A worker takes the job again at {waiting.next_run_at:%H:%M:%S} UTC \(in [^)]+\) to book"
                     r" its turn, or sooner, woken by a call that goes\.", page), page
    assert ("after 0 recorded calls: limit fake: 0 calls queued before it, of its priority (0) or higher"
            " (6 requests/min)") in page
    assert "1 run throttled" in limits and f"{waiting.pk} " in limits
    assert "1 call answered" in limits
    assert re.search(r'data-kind="throttled"><span class="n">1</span>', dashboard)
