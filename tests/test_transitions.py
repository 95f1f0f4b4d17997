"""The single writer of state: checked edges and compare-and-swap."""

import pytest

import durable
from durable.exceptions import IllegalTransition
from durable.models import Job
from durable.store import locking

pytestmark = pytest.mark.django_db


def test_an_illegal_transition_raises_and_writes_nothing():
    job = durable.submit("test_pipeline", "j", {})
    with pytest.raises(IllegalTransition, match="pending -> delivered is not in the transition table"):
        locking.transition(job, "delivered")
    assert Job.objects.get(pk="j").state == "pending"
    assert job.events.count() == 1


def test_the_compare_and_swap_loses_cleanly_when_another_writer_moved_the_job():
    job = durable.submit("test_pipeline", "j", {})
    stale = Job.objects.get(pk="j")
    assert locking.transition(job, "fetching")
    assert locking.transition(stale, "fetching") is False
    assert Job.objects.get(pk="j").state == "fetching"
    assert job.events.filter(to_state="fetching").count() == 1


def test_a_fenced_write_with_an_old_lease_token_is_refused():
    job = durable.submit("test_pipeline", "j", {})
    from django.db import transaction

    with transaction.atomic():
        claimed = locking.claim_job("w1", 60)
    assert claimed.lease_token == 1
    with transaction.atomic():
        assert locking.transition(claimed, "fetching", token=0) is False
        assert locking.transition(claimed, "fetching", token=1)
    assert Job.objects.get(pk=job.pk).state == "fetching"


def test_a_fenced_write_after_the_lease_expired_is_refused():
    durable.submit("test_pipeline", "j", {})
    from django.db import transaction

    with transaction.atomic():
        claimed = locking.claim_job("w1", 60)
    Job.objects.filter(pk="j").update(lease_until=locking.now_plus(-1))
    with transaction.atomic():
        assert locking.transition(claimed, "fetching", token=claimed.lease_token) is False


def test_a_path_of_two_edges_is_checked_edge_by_edge():
    job = durable.submit("test_pipeline", "j", {})
    locking.transition(job, "fetching")
    with pytest.raises(IllegalTransition, match="fetched -> verifying"):
        locking.transition(job, ["fetched", "verifying"])
    assert locking.transition(job, ["fetched", "extracting"])
    assert [e.to_state for e in job.events.order_by("id")][-2:] == ["fetched", "extracting"]
