"""Concurrency keys: at most N jobs of a key active at once, in the order submitted.

The rules (``durable.core.concurrency``): the patterns a site declares and the errors a
bad one gets. The rows (``durable.store.concurrency``): numbering at submit, letting jobs
in by a compare-and-swap, waking the next one when a job finishes. Runs (in this
process): a second message of a conversation waits for the first, is refused, or
interrupts it at its next model call, as its workflow says.
"""

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

import durable
from durable.core import concurrency as rules
from durable.models import ConcurrencyKey, EventKind, Job, JobEvent, Reservation, ReservationState, StepResult
from durable.store import concurrency as store
from durable.store import locking
from durable.testing import reply, tool_call
from durable.verbs import jobs as verbs

from .conftest import wait_for
from .test_limits import claim as _claim

ANSWER = [reply("Done.", usage=(10, 2))]


def _drain(run_worker_inline, keys, timeout=30):
    """Run the worker here until the jobs ``keys`` exist and are finished."""
    from durable.store.wakeups import settled_q

    def finished():
        run_worker_inline()
        return Job.objects.filter(pk__in=keys).filter(settled_q()).count() == len(keys)

    wait_for(finished, timeout=timeout, message=f"jobs {keys} to finish")


# The rules -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting, message", [
    ([("a:*", 1)], "CONCURRENCY must be a dict"),
    ({"": 1}, "a concurrency key pattern must be a string"),
    ({"a:*": 0}, "must be a whole number of jobs at once, 1 or more, not 0"),
    ({"a:*": 1.5}, "not 1.5"),
    ({"a:*": True}, "not True"),
])
def test_a_concurrency_setting_declared_wrong_is_refused_with_what_is_wrong(setting, message):
    with pytest.raises(rules.ConcurrencyConfigError, match=message):
        rules.parse(setting)


@pytest.mark.django_db
def test_the_system_check_names_a_concurrency_setting_declared_wrong():
    with override_settings(DURABLE={"CONCURRENCY": {"tenant:*": -1}}), \
            pytest.raises(SystemCheckError, match=r"durable.E047.*CONCURRENCY\['tenant:\*'\]"):
        call_command("check")


def test_a_key_takes_the_first_pattern_that_covers_it():
    setting = {"conversation:vip-*": 2, "conversation:*": 1}
    assert rules.limit_for("conversation:vip-7", setting) == 2
    assert rules.limit_for("conversation:7", setting) == 1
    with pytest.raises(rules.ConcurrencyConfigError, match="matches no pattern"):
        rules.limit_for("tenant:4", setting)


def test_a_workflow_with_a_policy_we_do_not_know_is_refused_where_it_is_declared():
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="when_busy must be one of queue, reject, interrupt"):
        class Bad(durable.Workflow, register=False):
            when_busy = "drop"

            @durable.step()
            def a(self, payload, ctx):
                return {}


# Submitting ----------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("key, message", [
    ("", "The concurrency key must be a string"),
    ("x" * 201, "The concurrency key must be a string"),
    (42, "The concurrency key must be a string"),
    ("shop:1", "matches no pattern of DURABLE\\['CONCURRENCY'\\]"),
])
def test_a_bad_concurrency_key_is_refused_and_nothing_is_written(key, message):
    with pytest.raises((durable.PayloadInvalid, rules.ConcurrencyConfigError), match=message):
        durable.submit("recorded", "j1", {}, concurrency_key=key)
    assert not Job.objects.exists() and not ConcurrencyKey.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_jobs_of_a_key_are_numbered_in_the_order_submitted_and_a_resubmit_must_name_the_same_key():
    jobs = [durable.submit("recorded", f"j{n}", {}, concurrency_key="tenant:1") for n in range(3)]
    assert [job.concurrency_seq for job in jobs] == [1, 2, 3]
    assert dict(Job.objects.values_list("pk", "concurrency_seq")) == {"j0": 1, "j1": 2, "j2": 3}
    assert durable.submit("recorded", "j1", {}, concurrency_key="tenant:1").concurrency_seq == 2
    with pytest.raises(durable.IdempotencyConflict, match="concurrency key: it has 'tenant:1'"):
        durable.submit("recorded", "j1", {}, concurrency_key="tenant:2")
    assert ConcurrencyKey.objects.get(pk="tenant:1").limit == 3


# Letting jobs in -----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_key_lets_in_as_many_jobs_as_it_allows_in_the_order_submitted():
    for n in range(3):
        durable.submit("recorded", f"c{n}", {}, concurrency_key="conversation:1")
    first, second, third = (_claim(f"c{n}") for n in range(3))
    # The third asks first: the second was submitted before it and waits too.
    assert not store.admit(third.id, "conversation:1", third.concurrency_seq).go
    assert store.admit(first.id, "conversation:1", first.concurrency_seq).go
    waiting = store.admit(second.id, "conversation:1", second.concurrency_seq)
    assert not waiting.go and "job c0 is active" in waiting.why
    assert (waiting.due - locking.db_now()).total_seconds() == pytest.approx(store.RECHECK, abs=1)
    behind = store.admit(third.id, "conversation:1", third.concurrency_seq)
    assert "1 submitted before it is waiting too" in behind.why
    assert behind.due > waiting.due  # further back, it looks again later
    # The first finishes: the next in line goes, not the one that asked last.
    Job.objects.filter(pk="c0").update(state="c_done")
    assert not store.admit(third.id, "conversation:1", third.concurrency_seq).go
    assert store.admit(second.id, "conversation:1", second.concurrency_seq).go
    assert list(ConcurrencyKey.objects.get(pk="conversation:1").holders) == ["c1"]


@pytest.mark.django_db(transaction=True)
def test_two_workers_letting_jobs_in_at_once_never_both_take_the_last_place(monkeypatch):
    for n in range(2):
        durable.submit("recorded", f"c{n}", {}, concurrency_key="tenant:9")
    Job.objects.filter(pk="c1").update(concurrency_seq=1)  # as if neither were before the other
    ConcurrencyKey.objects.filter(pk="tenant:9").update(limit=1)
    # The other worker takes the place between this worker's read and its write.
    real = store.ConcurrencyKey.objects.filter

    def racing(*args, **kwargs):
        if "version" in kwargs and not racing.done:
            racing.done = True
            ConcurrencyKey.objects.filter(pk="tenant:9").update(holders={"c0": 0}, version=99)
        return real(*args, **kwargs)

    racing.done = False
    monkeypatch.setattr(store.ConcurrencyKey.objects, "filter", racing)
    turn = store.admit("c1", "tenant:9", 1)
    assert not turn.go and "job c0 is active" in turn.why
    monkeypatch.undo()
    assert dict(ConcurrencyKey.objects.get(pk="tenant:9").holders) == {"c0": 0}


# Runs -----------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_second_message_waits_for_the_first_run_and_goes_as_soon_as_it_finishes(run_worker_inline, tmp_path):
    log = tmp_path / "steps.log"
    durable.submit("recorded", "first", {"log": str(log)}, concurrency_key="conversation:7")
    durable.submit("recorded", "second", {"log": str(log)}, concurrency_key="conversation:7")
    # The worker takes the second first (due earlier: claimed in due order).
    Job.objects.filter(pk="second").update(next_run_at=locking.now_plus(-5))
    second = _claim("second")
    from durable.engine.worker import Worker

    runner = Worker(name="w", burst=True).runner
    runner.heartbeat = None
    assert runner.run_step(runner._begin(second)) is None  # handed back: its turn is after the first's
    event = JobEvent.objects.filter(job_id="second", message__contains="concurrency key conversation:7").get()
    assert "1 submitted before it is waiting too" in event.message  # the first, not started yet
    assert Job.objects.get(pk="second").attempts == 0  # waiting its turn spends no attempt
    _drain(run_worker_inline, ["first", "second"])
    ran = [line.split()[:2] for line in log.read_text().splitlines()]
    assert ran == [["first", "a"], ["first", "b-start"], ["first", "b"], ["first", "c"],
                   ["second", "a"], ["second", "b-start"], ["second", "b"], ["second", "c"]]


@pytest.mark.django_db(transaction=True)
def test_a_workflow_that_rejects_a_second_message_raises_key_busy_and_writes_nothing():
    durable.submit("test_agent_rejecting", "m1", {"script": ANSWER}, concurrency_key="conversation:3")
    with pytest.raises(durable.KeyBusy, match="job 'm1' is active") as busy:
        durable.submit("test_agent_rejecting", "m2", {"script": ANSWER}, concurrency_key="conversation:3")
    assert busy.value.active == ("m1",)
    assert list(Job.objects.values_list("pk", flat=True)) == ["m1"]
    assert ConcurrencyKey.objects.get(pk="conversation:3").last_seq == 1  # the refused submit's number rolled back
    Job.objects.filter(pk="m1").update(state="done")
    assert durable.submit("test_agent_rejecting", "m2", {"script": ANSWER},
                          concurrency_key="conversation:3").concurrency_seq == 2


@pytest.mark.django_db(transaction=True)
def test_a_new_message_interrupts_the_active_run_at_its_next_model_call_keeping_its_memos(run_worker_inline):
    key = "conversation:5"
    script = [reply(tool_calls=[tool_call("user_writes_again", {"text": "Actually, cancel it"}, id="u1")],
                    usage=(10, 2)),
              reply("The order is delivered.", usage=(10, 2))]
    then = {"workflow": "test_agent_interrupting", "key": key, "script": [reply("Cancelled.", usage=(10, 2))]}
    durable.submit("test_agent_interrupting", "m1", {"script": script, "then": then}, concurrency_key=key)
    _drain(run_worker_inline, ["m1-again"])
    first, again = Job.objects.get(pk="m1"), Job.objects.get(pk="m1-again")
    assert first.state == "cancelled"
    event = first.events.get(to_state="cancelled")
    assert "interrupted by job m1-again" in event.message and "the 2 calls it recorded are kept" in event.message
    # Its first model call and the tool call that sent the message are on record; it paid
    # for no second model call.
    assert list(StepResult.objects.filter(job_id="m1").order_by("seq").values_list("step", flat=True)) == [
        "t1/model", "t1/tool/u1"]
    assert again.state == "done" and again.result == {"answer": "Cancelled.", "turns": 1}
    assert again.events.filter(kind=EventKind.CLAIMED).order_by("id").first().at >= event.at


@pytest.mark.django_db(transaction=True)
def test_a_job_requeued_after_its_key_moved_on_waits_its_turn_first_in_line(run_worker_inline):
    durable.submit("recorded", "a", {}, concurrency_key="conversation:8")
    a = _claim("a")
    assert store.admit(a.id, "conversation:8", a.concurrency_seq).go
    Job.objects.filter(pk="a").update(state="failed_b", lease_owner=None, next_run_at=None)
    durable.submit("recorded", "b", {}, concurrency_key="conversation:8")
    b = _claim("b")
    assert store.admit(b.id, "conversation:8", b.concurrency_seq).go  # the failed job no longer holds it
    Job.objects.filter(pk="a").update(state="pending")  # an operator requeues it
    assert not store.admit("a", "conversation:8", a.concurrency_seq).go  # b is active


@pytest.mark.django_db(transaction=True)
def test_cancelling_a_job_gives_back_its_shares_of_provider_limits_and_wakes_the_next_of_its_key():
    from durable.core import limits as limit_rules
    from durable.store import limits as limits_store

    durable.submit("recorded", "a", {}, concurrency_key="conversation:4")
    durable.submit("recorded", "b", {}, concurrency_key="conversation:4")
    a = _claim("a")
    store.admit(a.id, "conversation:4", a.concurrency_seq)
    specs = limit_rules.parse({"slots": {"concurrent": 1}})
    limits_store.reserve(specs, a.id, a.lease_token, "t1/model", 10)
    Job.objects.filter(pk="b").update(next_run_at=locking.now_plus(300))
    verbs.cancel("a", reason="the customer left")
    assert set(Reservation.objects.filter(job_id="a").values_list("state", flat=True)) == {
        ReservationState.RELEASED}
    assert Job.objects.get(pk="b").next_run_at <= locking.db_now()  # woken: its turn now
