"""Provider limits: declared in settings, paced in the database, obeyed by every run.

The rules (``durable.core.limits``): what a limit declares and the errors a bad one gets,
the virtual schedule that spaces calls. The rows (``durable.store.limits``): booking
moments in order, concurrent slots that a dead lease gives back, a 429 that pauses a
limit. Runs (an agent against the fake model server, in this process): a call whose
turn is later parks the job throttled, spending no attempt, and finishes at its turn.
"""

import datetime
import time

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db.models import F
from django.db.models.functions import Now
from django.test import override_settings

import durable
from durable.core import limits as rules
from durable.models import EventKind, Job, JobEvent, Limit, Reservation, ReservationState
from durable.store import limits as store
from durable.store import locking
from durable.testing import FakeModelServer, reply

LIMIT = {"models": ["fake-model"], "requests_per_minute": 60, "headroom": 0}


# The rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting, message", [
    ([1], "LIMITS must be a dict of limits by name, not list"),
    ({"a": {}}, "LIMITS['a'] limits nothing: declare requests_per_minute, tokens_per_minute or concurrent"),
    ({"a": {"requests_per_minute": 0}}, "LIMITS['a']['requests_per_minute'] must be a number above 0, not 0"),
    ({"a": {"tokens_per_minute": "lots"}}, "must be a number above 0, not 'lots'"),
    ({"a": {"concurrent": 2.5}}, "LIMITS['a']['concurrent'] must be a whole number, not 2.5"),
    ({"a": {"concurrent": True}}, "must be a number above 0, not True"),
    ({"a": {"concurrent": 2, "headroom": 0.7}}, "headroom'] must be a share from 0 to below 0.5"),
    ({"a": {"concurrent": 2, "models": []}}, "LIMITS['a']['models'] must be a non-empty list"),
    ({"a": {"concurrent": 2, "rpm": 5}}, "LIMITS['a'] has unknown keys ['rpm']"),
    ({"": {"concurrent": 2}}, "a limit's name must be a string of 1 to 100 characters"),
])
def test_a_limit_declared_wrong_is_refused_with_what_is_wrong(setting, message):
    with pytest.raises(rules.LimitConfigError) as refused:
        rules.parse(setting)
    assert message in str(refused.value)


@pytest.mark.django_db  # Django 6's check command also runs the checks that read the database
def test_the_system_check_names_a_limit_declared_wrong():
    with override_settings(DURABLE={"LIMITS": {"openai": {"requests_per_minute": -5}}}):
        with pytest.raises(SystemCheckError) as refused:
            call_command("check")
    assert "durable.E045" in str(refused.value)
    assert "LIMITS['openai']['requests_per_minute'] must be a number above 0, not -5" in str(refused.value)


def test_a_call_may_be_late_for_its_moment_by_the_slack_its_headroom_leaves_in_the_provider_s_window():
    [minute, short] = rules.parse({"minute": {"requests_per_minute": 60},
                                   "short": {"requests_per_minute": 60, "window": 6, "headroom": 0.05}})
    assert minute.late_allowed() == pytest.approx(1.8)
    assert short.late_allowed() == pytest.approx(0.3)


def test_a_limit_covers_the_models_and_providers_it_names():
    [spec] = rules.parse({"gpt": {"models": ["gpt-4o*"], "providers": ["openai"], "concurrent": 3}})
    assert spec.covers("openai", "gpt-4o-mini")
    assert not spec.covers("anthropic", "gpt-4o-mini")
    assert not spec.covers("openai", "o3")


def test_calls_booked_in_order_are_spaced_by_the_rate_and_by_their_tokens():
    [spec] = rules.parse({"a": {"requests_per_minute": 120, "tokens_per_minute": 6000, "headroom": 0}})
    schedule, starts = rules.Schedule(), []
    for tokens in (100, 100, 1000, 10):
        start, schedule = rules.book(spec, schedule, 1000.0, tokens)
        starts.append(start)
    # 0.5 s per request; 0.01 s per token: the 1,000-token call holds the tokens for 10 s.
    assert starts == [1000.0, 1001.0, 1002.0, 1012.0]
    # Tokens booked and not used come back to the calls after.
    assert rules.give_back(spec, schedule.tokens_at, 10, 4) == pytest.approx(schedule.tokens_at - 0.06)


def test_a_pause_holds_every_call_back_until_it_ends():
    [spec] = rules.parse({"a": {"requests_per_minute": 6000}})
    start, _ = rules.book(spec, rules.Schedule(paused_until=1030.0), 1000.0, 5)
    assert start == 1030.0


def test_a_call_s_tokens_are_estimated_from_its_text_and_reserved_with_its_output_cap():
    messages = [{"role": "user", "content": "x" * 300}]
    estimate = rules.estimate_tokens(messages)
    assert estimate >= 100  # at least a token per 3 characters
    assert rules.estimate_tokens(messages, [{"type": "function", "function": {"name": "f" * 90}}]) > estimate + 29
    assert rules.tokens_to_reserve(estimate, 1.0, 50) == estimate + 50
    assert rules.tokens_to_reserve(estimate, 0.5, None) == -(-estimate // 2)  # no max_tokens: the request only
    assert rules.tokens_to_reserve(estimate, 1.0, None, 700) == estimate + 700


def test_the_ratio_of_the_provider_s_count_to_the_estimate_is_learnt_from_the_calls_settled():
    ratio = 1.0
    for _ in range(30):
        ratio = rules.learn(ratio, estimate=100, input_tokens=40)
    assert ratio == pytest.approx(0.4, abs=0.01)
    assert rules.learn(ratio, 0, 40) == ratio and rules.learn(ratio, 100, 0) == ratio
    assert rules.learn(1.0, 1, 10_000) == pytest.approx(0.8 + 0.2 * rules.RATIO_BOUNDS[1])


# The rows ---------------------------------------------------------------------------------------


def claim(key):
    """Claim jobs until the claim is the job ``key``'s (the others are leased meanwhile)."""
    claimed = locking.claim_job("w", 60)
    while claimed is not None and claimed.id != key:
        claimed = locking.claim_job("w", 60)
    return claimed


def _job(key):
    durable.submit("recorded", key, {})
    return claim(key)


@pytest.mark.django_db(transaction=True)
def test_calls_on_one_limit_get_moments_in_the_order_they_asked_and_a_run_finds_its_own_again():
    specs = rules.parse({"a": LIMIT})
    jobs = [_job(f"j{n}") for n in range(3)]
    decisions = [store.reserve(specs, job.id, job.lease_token, "t1/model", 50) for job in jobs]
    assert decisions[0].go
    assert [d.go for d in decisions[1:]] == [False, False]
    gaps = [(d.at - decisions[0].at).total_seconds() for d in decisions]
    assert gaps == pytest.approx([0.0, 1.0, 2.0], abs=0.05)
    assert "limit a: its turn at" in decisions[2].why
    # The third run comes back for its call: it finds the moment it booked, not a new one.
    again = store.reserve(specs, jobs[2].id, jobs[2].lease_token, "t1/model", 50)
    assert again.at == decisions[2].at and again.ids == decisions[2].ids
    assert Reservation.objects.filter(state=ReservationState.BOOKED).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_booked_moment_that_passed_unused_is_given_back_and_a_new_one_booked():
    specs = rules.parse({"a": LIMIT})
    first, second = _job("j1"), _job("j2")
    store.reserve(specs, first.id, first.lease_token, "k", 10)
    late = store.reserve(specs, second.id, second.lease_token, "k", 10)
    Reservation.objects.filter(pk__in=late.ids).update(
        starts_at=late.at - datetime.timedelta(seconds=specs[0].late_allowed() + 5))
    again = store.reserve(specs, second.id, second.lease_token, "k", 10)
    assert again.ids != late.ids
    assert Reservation.objects.get(pk=late.ids[0]).state == ReservationState.RELEASED


@pytest.mark.django_db(transaction=True)
def test_a_concurrent_slot_is_held_while_the_lease_is_and_given_back_when_it_passes():
    specs = rules.parse({"a": {"concurrent": 1}})
    first, second = _job("j1"), _job("j2")
    assert store.reserve(specs, first.id, first.lease_token, "k", 10).go
    waiting = store.reserve(specs, second.id, second.lease_token, "k", 10)
    assert (waiting.go, waiting.queued) == (False, True)
    assert "all 1 calls at once are in flight" in waiting.why
    # The first run dies mid-call: once its lease has passed, its slot is free again.
    Job.objects.filter(pk=first.id).update(lease_until=locking.now_plus(-1))
    assert store.reserve(specs, second.id, second.lease_token, "k", 10).go
    assert Reservation.objects.get(job_id=first.id).state == ReservationState.RELEASED


@pytest.mark.django_db(transaction=True)
def test_a_settled_call_wakes_the_run_that_queued_longest_for_its_slot():
    specs = rules.parse({"a": {"concurrent": 1}})
    first, second, third = _job("j1"), _job("j2"), _job("j3")
    calling = store.reserve(specs, first.id, first.lease_token, "k", 10)
    for job in (second, third):
        store.reserve(specs, job.id, job.lease_token, "k", 10)
        # Throttled, the run gives its job back, due when it looks again.
        assert locking.hand_back(job, actor="w", step="run", message="throttled",
                                 due=locking.db_now() + datetime.timedelta(minutes=5))
    store.settle(calling.ids, 5, 2, specs)
    due = dict(Job.objects.filter(pk__in=["j2", "j3"]).values_list("pk", "next_run_at"))
    assert due["j2"] <= locking.db_now() < due["j3"]
    assert Reservation.objects.get(pk=calling.ids[0]).used_tokens == 7
    # The request used 5 tokens where 10 were estimated: the limit learns it.
    assert Limit.objects.get(pk="a").token_ratio == pytest.approx(0.9)


@pytest.mark.django_db(transaction=True)
def test_a_slot_given_back_wakes_the_waiting_run_of_the_highest_priority_first():
    specs = rules.parse({"a": {"concurrent": 1}})
    first, low, high = _job("j1"), _job("j2"), _job("j3")
    calling = store.reserve(specs, first.id, first.lease_token, "k", 10)
    for job, priority in ((low, 0), (high, 10)):
        store.reserve(specs, job.id, job.lease_token, "k", 10, priority=priority)
        assert locking.hand_back(job, actor="w", step="run", message="throttled",
                                 due=locking.db_now() + datetime.timedelta(minutes=5))
    store.settle(calling.ids, 5, 2, specs)
    due = dict(Job.objects.filter(pk__in=["j2", "j3"]).values_list("pk", "next_run_at"))
    assert due["j3"] <= locking.db_now() < due["j2"]  # queued later, but of a higher priority


@pytest.mark.django_db(transaction=True)
def test_a_429_pauses_the_limit_for_every_run_until_its_retry_after():
    specs = rules.parse({"a": LIMIT})
    first, second = _job("j1"), _job("j2")
    calling = store.reserve(specs, first.id, first.lease_token, "k", 10)
    store.refuse(calling.ids, 30, "HTTP 429: Rate limit reached", specs)
    limit = Limit.objects.get(pk="a")
    assert limit.refusals == 1 and limit.refusal == "HTTP 429: Rate limit reached"
    later = store.reserve(specs, second.id, second.lease_token, "k", 10)
    assert not later.go and later.queued
    # The pause ends beyond the horizon a limit books ahead: the run comes back to book the
    # moment the pause ends once that is within it.
    assert (later.at - later.now).total_seconds() == pytest.approx(30 - store.HORIZON, abs=1)
    assert "paused by the provider's 429" in later.why


# Runs ---------------------------------------------------------------------------------------------


LOOKUP_THEN_ANSWER = [reply(tool_calls=[], usage=(20, 5)), reply("Delivered.", usage=(30, 4))]


def _drain(run_worker_inline, keys, timeout=30):
    deadline = time.monotonic() + timeout
    while Job.objects.filter(pk__in=keys).exclude(state="done").exists():
        assert time.monotonic() < deadline, list(Job.objects.values_list("pk", "state", "next_run_at"))
        run_worker_inline()
        time.sleep(0.1)


@pytest.mark.django_db(transaction=True)
def test_runs_over_a_limit_wait_their_turn_throttled_and_spend_no_attempt(run_worker_inline):
    with override_settings(DURABLE={"LIMITS": {"fake": {**LIMIT, "requests_per_minute": 20}}}), \
            FakeModelServer([reply("Delivered.", usage=(30, 4))]) as server:
        for n in range(3):
            durable.submit("test_agent", f"a{n}", {"model_url": server.url, "message": f"Where is a{n}"})
        _drain(run_worker_inline, ["a0", "a1", "a2"])
        calls = server.paid_calls()
    # 20 a minute: the three calls' turns three seconds apart, whatever the worker's threads,
    # and no call went before its turn.
    turns = dict(Reservation.objects.values_list("job_id", "starts_at"))
    moments = sorted(turns.values())
    assert [(b - a).total_seconds() for a, b in zip(moments, moments[1:], strict=False)] == pytest.approx(
        [3.0, 3.0], abs=0.01)
    assert len(calls) == 3
    for call in calls:
        job = call.body["messages"][1]["content"].split()[-1]
        assert call.at >= turns[job].timestamp() - 0.05, (job, call.at, turns[job])
    throttled = JobEvent.objects.filter(kind=EventKind.TRANSITION, message__startswith="throttled until")
    assert throttled.count() >= 2
    assert "limit fake: its turn at" in throttled.first().message
    for job in Job.objects.filter(pk__in=["a0", "a1", "a2"]):
        assert job.result == {"answer": "Delivered.", "turns": 1}
        assert job.attempts <= 1  # waiting its turn is not a failed attempt
    assert set(Reservation.objects.values_list("state", flat=True)) == {ReservationState.SETTLED}
    assert sorted(Reservation.objects.values_list("used_tokens", flat=True)) == [34, 34, 34]


@pytest.mark.django_db(transaction=True)
def test_a_429_under_a_limit_pauses_it_and_the_run_waits_instead_of_failing(run_worker_inline):
    with override_settings(DURABLE={"LIMITS": {"fake": {**LIMIT, "requests_per_minute": 6000}}}), \
            FakeModelServer([reply("Delivered.", usage=(30, 4))]) as server:
        server.fault("rate_limited", times=1, retry_after=2)
        durable.submit("test_agent", "r1", {"model_url": server.url})
        _drain(run_worker_inline, ["r1"])
        answered = server.paid_calls()
        refused = [call for call in server.calls if call.outcome == "rate_limited"]
    assert len(refused) == 1 and len(answered) == 1
    assert answered[0].at - refused[0].at >= 1.9  # the pause held until the Retry-After
    limit = Limit.objects.get(pk="fake")
    assert limit.refusals == 1 and "429" in limit.refusal
    job = Job.objects.get(pk="r1")
    assert job.result == {"answer": "Delivered.", "turns": 1} and job.attempts <= 1
    assert JobEvent.objects.filter(job_id="r1", message__contains="paused 2 s by the provider's 429").exists()
    assert not JobEvent.objects.filter(job_id="r1", kind=EventKind.RETRY).exists()


@pytest.mark.django_db(transaction=True)
def test_the_orm_s_booking_for_other_databases_books_the_same_moments_as_the_statement(monkeypatch):
    specs = rules.parse({"a": {**LIMIT, "tokens_per_minute": 6000}})
    by_statement = [store.reserve(specs, job.id, job.lease_token, "k", 100) for job in (_job("s1"), _job("s2"))]
    Limit.objects.all().delete()
    monkeypatch.setattr(store, "BOOK", {})  # as on a database with no statement of its own
    by_orm = [store.reserve(specs, job.id, job.lease_token, "k", 100) for job in (_job("o1"), _job("o2"))]
    gap = [(d[1].at - d[0].at).total_seconds() for d in (by_statement, by_orm)]
    assert gap[0] == pytest.approx(gap[1], abs=0.01) == pytest.approx(1.0, abs=0.01)
    assert Limit.objects.get(pk="a").booked_tokens == Reservation.objects.get(job_id="o2").tokens


@pytest.mark.django_db(transaction=True)
def test_a_call_that_waited_for_its_moment_does_not_go_if_a_429_paused_the_limit_meanwhile(monkeypatch):
    from types import SimpleNamespace

    from durable.steps import limits as pacing

    specs = {"a": LIMIT}
    first, second = _job("j1"), _job("j2")
    adapter = SimpleNamespace(provider="openai", model="fake-model", defaults={})
    sent = []

    def call(name):
        return lambda: sent.append(name) or SimpleNamespace(input_tokens=5, output_tokens=1)

    with override_settings(DURABLE={"LIMITS": specs}):
        pacing.paced(adapter, [], None, {}, call("first"), job_id=first.id, lease_token=first.lease_token, key="k")
        # The second call's moment is a second later (60 a minute): while it waits for it,
        # another call of the fleet is refused and the provider pauses the limit.
        other = _job("j3")
        refused = store.reserve(rules.parse(specs), other.id, other.lease_token, "k", 10)

        def meanwhile(seconds):
            assert 0 < seconds <= pacing.SHORT_WAIT
            store.refuse(refused.ids, 30, "HTTP 429", rules.parse(specs))

        monkeypatch.setattr(pacing, "time", SimpleNamespace(sleep=meanwhile, monotonic=time.monotonic))
        with pytest.raises(pacing.Throttled) as throttled:
            pacing.paced(adapter, [], None, {}, call("second"), job_id=second.id,
                         lease_token=second.lease_token, key="k")
    assert sent == ["first"]  # the second call never went
    assert "paused by the provider's 429 while the call waited" in throttled.value.why
    assert (throttled.value.until - locking.db_now()).total_seconds() == pytest.approx(30, abs=2)
    assert Reservation.objects.get(job_id="j2").state == ReservationState.RELEASED


@pytest.mark.django_db(transaction=True)
def test_beyond_the_horizon_calls_queue_by_priority_and_a_call_that_goes_wakes_the_first_of_them():
    specs = rules.parse({"a": LIMIT})  # 60 a minute: one call a second
    ahead = [_job(f"b{n}") for n in range(int(store.HORIZON) + 1)]
    for job in ahead:  # the horizon's worth of calls book their moments, a second apart
        assert not store.reserve(specs, job.id, job.lease_token, "k", 10).queued
    low, same, high = _job("low"), _job("same"), _job("high")
    decisions = {}
    for job, priority in ((low, -5), (same, 0), (high, 10)):
        decisions[job.id] = store.reserve(specs, job.id, job.lease_token, "k", 10, priority=priority)
        assert decisions[job.id].queued and not decisions[job.id].go
        assert locking.hand_back(job, actor="w", step="run", message="throttled", due=decisions[job.id].at)
    assert "0 calls queued before it, of its priority (-5) or higher" in decisions["low"].why
    # The high one asked last but is first in line; the low one waits behind both.
    assert store._queued_ahead(specs[0], Reservation.objects.get(job_id="high"), 10) == 0
    assert store._queued_ahead(specs[0], Reservation.objects.get(job_id="low"), -5) == 2
    # A newcomer of priority 0 queues behind the one of its priority that asked before it.
    newcomer = _job("new")
    queued = store.reserve(specs, newcomer.id, newcomer.lease_token, "k", 10)
    assert queued.queued and "2 calls queued before it" in queued.why
    # A booked call's moment comes (the second's, within the 2 s it may wait for it in its
    # thread): it goes, and wakes the first run queued.
    Job.objects.filter(pk="new").update(next_run_at=None)
    assert store.reserve(specs, ahead[1].id, ahead[1].lease_token, "k", 10, soon=2).go
    due = dict(Job.objects.filter(pk__in=["low", "same", "high"]).values_list("pk", "next_run_at"))
    assert due["high"] <= locking.db_now() < min(due["same"], due["low"])
    # Two seconds later (the schedule's end comes nearer as the booked calls go), woken, it
    # books the moment at the horizon's end: nothing is queued before it.
    Limit.objects.filter(pk="a").update(requests_free=F("requests_free") - 2)
    woken = store.reserve(specs, high.id, high.lease_token, "k", 10, priority=10)
    assert not woken.queued and Reservation.objects.get(job_id="high").state == ReservationState.BOOKED


@pytest.mark.django_db(transaction=True)
def test_runs_queued_in_the_same_millisecond_are_still_one_behind_the_other():
    specs = rules.parse({"a": LIMIT})
    for n in range(int(store.HORIZON) + 1):
        job = _job(f"b{n}")
        store.reserve(specs, job.id, job.lease_token, "k", 10)
    first, second = _job("first"), _job("second")
    for job in (first, second):
        assert store.reserve(specs, job.id, job.lease_token, "k", 10).queued
    # Written in the same millisecond (SQLite's stamps are to the millisecond).
    Reservation.objects.filter(job_id__in=["first", "second"]).update(created=Now())
    Limit.objects.filter(pk="a").update(requests_free=F("requests_free") - 2)
    assert not store.reserve(specs, first.id, first.lease_token, "k", 10).queued


@pytest.mark.django_db(transaction=True)
def test_a_pipeline_step_that_calls_the_model_itself_waits_its_turn_and_runs_again_at_it(run_worker_inline):
    with override_settings(DURABLE={"LIMITS": {"fake": {**LIMIT, "requests_per_minute": 20}}}), \
            FakeModelServer([reply("Short.", usage=(12, 3))]) as server:
        for n in range(3):
            durable.submit("test_model_step", f"s{n}", {"model_url": server.url})
        _drain_finished(run_worker_inline, ["s0", "s1", "s2"])
        calls = server.paid_calls()
    assert len(calls) == 3  # each step's call paid once, however often the step was handed back
    turns = dict(Reservation.objects.values_list("job_id", "starts_at"))
    moments = sorted(turns.values())
    assert [(b - a).total_seconds() for a, b in zip(moments, moments[1:], strict=False)] == pytest.approx(
        [3.0, 3.0], abs=0.01)
    for call in calls:
        job = call.body["messages"][0]["content"].split()[-1]
        assert call.at >= turns[job].timestamp() - 0.05, (job, call.at, turns[job])
    assert set(Reservation.objects.values_list("key", "state")) == {("summarise/model/1", ReservationState.SETTLED)}
    assert JobEvent.objects.filter(message__contains="throttled until", step="summarise").count() >= 2
    for job in Job.objects.filter(pk__in=["s0", "s1", "s2"]):
        assert job.result == {"summary": "Short."}
    # Waiting its turn is not a failed attempt: no retry, and every claim after a hand-back
    # counts the same first attempt.
    assert not JobEvent.objects.filter(kind__in=[EventKind.RETRY, EventKind.FAILED]).exists()
    assert set(JobEvent.objects.filter(kind=EventKind.RECLAIMED).values_list("message", flat=True)) <= {
        "taken over after it was handed back; attempt 1"}


def _drain_finished(run_worker_inline, keys, timeout=30):
    deadline = time.monotonic() + timeout
    while Job.objects.filter(pk__in=keys, result__isnull=True).exists():
        assert time.monotonic() < deadline, list(Job.objects.values_list("pk", "state", "next_run_at"))
        run_worker_inline()
        time.sleep(0.1)
