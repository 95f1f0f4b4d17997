"""The stand-in remote system: every mode, switch and way of running it.

The outbox tests trust the receiver's count of applied actions as ground truth,
so the receiver itself is pinned down here. No database is needed.
"""

import subprocess
import sys
import time
import uuid

import pytest
import requests

from durable.testing import Receiver, ReceiverProcess, read_store

# Short enough to keep the suite fast, long enough for a loaded CI machine to
# apply an action before the client gives up.
CLIENT_TIMEOUT = 0.3
SLOW = 2.0


@pytest.fixture
def start_receiver():
    started = []

    def start(**options):
        receiver = Receiver(**options).start()
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.stop()


@pytest.fixture
def receiver(start_receiver):
    return start_receiver()


def post(receiver, body=None, key=None, timeout=5):
    headers = {"Idempotency-Key": key or uuid.uuid4().hex}
    return requests.post(
        f"{receiver.url}/actions",
        json=body or {"subject": "hello"},
        headers=headers,
        timeout=timeout,
    )


def lookup(receiver, key):
    return requests.get(f"{receiver.url}/actions/lookup", params={"key": key}, timeout=5)


# Applying actions


def test_an_action_is_applied_once_and_gets_a_remote_id(receiver):
    response = post(receiver, {"subject": "Printer on fire"}, key="job-1:create_ticket")

    assert response.status_code == 201
    assert response.json() == {"id": "T-000001", "status": "created"}
    [action] = receiver.actions
    assert action["id"] == "T-000001"
    assert action["key"] == "job-1:create_ticket"
    assert action["body"] == {"subject": "Printer on fire"}
    assert action["at"]


def test_remote_ids_follow_the_order_of_application(receiver):
    ids = [post(receiver).json()["id"] for _ in range(3)]

    assert ids == ["T-000001", "T-000002", "T-000003"]


def test_a_replayed_key_returns_the_original_id_without_applying_again(receiver):
    first = post(receiver, key="k")
    replay = post(receiver, key="k")

    assert replay.status_code == 200
    assert replay.json() == {"id": first.json()["id"], "status": "duplicate"}
    assert len(receiver.actions) == 1


def test_a_replayed_key_is_applied_again_when_the_receiver_does_not_deduplicate(start_receiver):
    receiver = start_receiver(idempotent=False)

    first = post(receiver, key="k")
    replay = post(receiver, key="k")

    assert (first.status_code, replay.status_code) == (201, 201)
    assert first.json()["id"] != replay.json()["id"]
    assert len(receiver.actions) == 2


def test_a_key_reused_with_a_different_body_is_refused_and_not_applied(receiver):
    post(receiver, {"amount": 10}, key="k")

    response = post(receiver, {"amount": 99}, key="k")

    assert response.status_code == 422
    assert [action["body"] for action in receiver.actions] == [{"amount": 10}]


def test_an_idempotent_receiver_refuses_a_request_without_a_key(receiver):
    response = requests.post(f"{receiver.url}/actions", json={"a": 1}, timeout=5)

    assert response.status_code == 400
    assert receiver.actions == []


def test_a_receiver_that_does_not_deduplicate_accepts_a_request_without_a_key(start_receiver):
    receiver = start_receiver(idempotent=False)

    response = requests.post(f"{receiver.url}/actions", json={"a": 1}, timeout=5)

    assert response.status_code == 201
    assert receiver.actions[0]["key"] is None


def test_a_body_that_is_not_json_is_refused_and_not_applied(receiver):
    response = requests.post(
        f"{receiver.url}/actions", data=b"{not json", headers={"Idempotency-Key": "k"}, timeout=5
    )

    assert response.status_code == 400
    assert receiver.actions == []


def test_an_unknown_path_is_not_found(receiver):
    assert requests.get(f"{receiver.url}/nothing", timeout=5).status_code == 404
    assert requests.post(f"{receiver.url}/nothing", json={}, timeout=5).status_code == 404


# Lookup


def test_lookup_finds_an_applied_action_by_its_key(receiver):
    post(receiver, {"subject": "hello"}, key="job-1:create_ticket")

    response = lookup(receiver, "job-1:create_ticket")

    assert response.status_code == 200
    assert response.json() == {"found": True, **receiver.actions[0]}


def test_lookup_reports_a_key_that_was_never_applied(receiver):
    response = lookup(receiver, "never-sent")

    assert response.status_code == 404
    assert response.json() == {"found": False}


def test_lookup_needs_a_key(receiver):
    response = requests.get(f"{receiver.url}/actions/lookup", timeout=5)

    assert response.status_code == 400


def test_lookup_is_not_found_when_the_receiver_offers_none(start_receiver):
    receiver = start_receiver(lookup=False)
    post(receiver, key="k")

    response = lookup(receiver, "k")

    assert response.status_code == 404
    assert response.json() == {"error": "lookup not supported"}


def test_lookup_is_not_affected_by_the_behaviour_of_posts(receiver):
    post(receiver, key="k")
    receiver.behave("unavailable")

    assert lookup(receiver, "k").status_code == 200


# Refusals: nothing is applied


@pytest.mark.parametrize(
    ("mode", "status"),
    [("forbidden", 403), ("rate_limited", 429), ("unavailable", 503), ("server_error", 500)],
)
def test_a_refusal_replies_with_its_status_and_applies_nothing(receiver, mode, status):
    receiver.behave(mode)

    response = post(receiver, key="k")

    assert response.status_code == status
    assert receiver.actions == []
    assert lookup(receiver, "k").status_code == 404


@pytest.mark.parametrize("mode", ["rate_limited", "unavailable"])
def test_rate_limited_and_unavailable_replies_say_when_to_retry(receiver, mode):
    receiver.behave(mode, retry_after=7)

    assert post(receiver).headers["Retry-After"] == "7"


def test_retry_after_defaults_to_one_second_and_rounds_up(receiver):
    receiver.behave("rate_limited", times=1)
    assert post(receiver).headers["Retry-After"] == "1"

    receiver.behave("rate_limited", times=1, retry_after=0.2)
    assert post(receiver).headers["Retry-After"] == "1"


def test_forbidden_and_server_error_replies_carry_no_retry_after(receiver):
    receiver.behave("forbidden", times=1)
    assert "Retry-After" not in post(receiver).headers

    receiver.behave("server_error", times=1)
    assert "Retry-After" not in post(receiver).headers


# Failures after acting: applied, but the client cannot know


def test_error_after_acting_applies_the_action_then_replies_500(receiver):
    receiver.behave("error_after_acting")

    response = post(receiver, key="k")

    assert response.status_code == 500
    assert len(receiver.actions) == 1
    assert lookup(receiver, "k").json()["found"] is True


def test_drop_after_acting_applies_the_action_and_closes_without_a_reply(receiver):
    receiver.behave("drop_after_acting")

    with pytest.raises(requests.ConnectionError):
        post(receiver, key="k")

    assert len(receiver.actions) == 1
    assert lookup(receiver, "k").json()["found"] is True


def test_slow_after_acting_applies_the_action_but_replies_after_the_client_gave_up(receiver):
    receiver.behave("slow_after_acting", delay=SLOW)

    with pytest.raises(requests.ReadTimeout):
        post(receiver, key="k", timeout=CLIENT_TIMEOUT)

    assert len(receiver.actions) == 1


def test_slow_after_acting_still_replies_to_a_patient_client(receiver):
    receiver.behave("slow_after_acting", delay=0.1)

    assert post(receiver, timeout=5).status_code == 201


def test_hang_before_acting_times_out_the_client_and_applies_nothing(receiver):
    receiver.behave("hang_before_acting", delay=SLOW)

    with pytest.raises(requests.ReadTimeout):
        post(receiver, key="k", timeout=CLIENT_TIMEOUT)

    assert receiver.actions == []
    assert lookup(receiver, "k").status_code == 404


def test_a_retry_with_the_same_key_after_a_lost_reply_returns_the_original_id(receiver):
    receiver.behave("drop_after_acting", times=1)
    with pytest.raises(requests.ConnectionError):
        post(receiver, key="k")

    retry = post(receiver, key="k")

    assert retry.status_code == 200
    assert retry.json()["id"] == receiver.actions[0]["id"]
    assert len(receiver.actions) == 1


# Behaviour switching


def test_a_behaviour_lasts_for_the_given_number_of_requests_then_reverts_to_ok(receiver):
    receiver.behave("unavailable", times=2)

    statuses = [post(receiver).status_code for _ in range(3)]

    assert statuses == [503, 503, 201]


def test_a_behaviour_without_a_count_lasts_until_changed(receiver):
    receiver.behave("forbidden")
    assert [post(receiver).status_code for _ in range(3)] == [403, 403, 403]

    receiver.behave("ok")
    assert post(receiver).status_code == 201


def test_an_unknown_mode_or_count_is_rejected(receiver):
    with pytest.raises(ValueError, match="unknown mode"):
        receiver.behave("explode")
    with pytest.raises(ValueError, match="times"):
        receiver.behave("forbidden", times=0)


def test_lookups_do_not_use_up_a_counted_behaviour(receiver):
    receiver.behave("forbidden", times=1)
    lookup(receiver, "k")

    assert post(receiver).status_code == 403


# Random reply loss


def lost_replies(receiver, count):
    lost = []
    for n in range(count):
        try:
            post(receiver, key=f"k{n}")
        except requests.ConnectionError:
            lost.append(n)
    return lost


def test_lost_replies_still_apply_the_action_and_repeat_for_the_same_seed(start_receiver):
    first = start_receiver(loss_rate=0.5, seed=7)
    second = start_receiver(loss_rate=0.5, seed=7)

    lost = lost_replies(first, 20)

    assert 0 < len(lost) < 20
    assert len(first.actions) == 20
    assert lost_replies(second, 20) == lost


def test_a_loss_rate_outside_zero_to_one_is_rejected():
    with pytest.raises(ValueError, match="loss_rate"):
        Receiver(loss_rate=1.5)


# Bookkeeping


def test_every_api_request_is_counted_and_logged(receiver):
    receiver.behave("drop_after_acting", times=1)
    with pytest.raises(requests.ConnectionError):
        post(receiver, key="a")
    post(receiver, key="a")
    lookup(receiver, "a")

    assert receiver.requests == 3
    assert [(e["method"], e["key"], e["status"]) for e in receiver.log] == [
        ("POST", "a", None),
        ("POST", "a", 200),
        ("GET", "a", 200),
    ]


def test_the_control_endpoints_change_behaviour_and_show_the_store(receiver):
    control = requests.post(
        f"{receiver.url}/_control", json={"mode": "forbidden", "times": 1}, timeout=5
    )
    assert control.status_code == 200
    assert post(receiver).status_code == 403
    post(receiver, key="k")

    store = requests.get(f"{receiver.url}/_actions", timeout=5).json()

    assert store == {"actions": receiver.actions, "requests": 2}


def test_the_control_endpoint_rejects_an_unknown_mode(receiver):
    response = requests.post(f"{receiver.url}/_control", json={"mode": "explode"}, timeout=5)

    assert response.status_code == 400


def test_the_store_file_holds_every_applied_action(start_receiver, tmp_path):
    store = tmp_path / "actions.jsonl"
    receiver = start_receiver(store_path=store)
    post(receiver, key="a")
    post(receiver, key="b")

    assert read_store(store) == receiver.actions


def test_a_restarted_receiver_remembers_the_keys_in_its_store_file(start_receiver, tmp_path):
    store = tmp_path / "actions.jsonl"
    before = start_receiver(store_path=store)
    original = post(before, key="k").json()["id"]
    before.stop()

    after = start_receiver(store_path=store)

    assert post(after, key="k").json() == {"id": original, "status": "duplicate"}
    assert post(after, key="other").json()["id"] == "T-000002"


def test_a_torn_last_line_in_the_store_file_is_ignored(tmp_path):
    store = tmp_path / "actions.jsonl"
    store.write_text('{"id": "T-000001", "key": "k", "body": {}, "at": "x"}\n{"id": "T-0')

    assert [record["id"] for record in read_store(store)] == ["T-000001"]


def test_stop_wakes_a_hanging_request_and_is_safe_to_call_twice():
    receiver = Receiver().start()
    receiver.behave("hang_before_acting", delay=60)
    with pytest.raises(requests.ReadTimeout):
        post(receiver, timeout=CLIENT_TIMEOUT)

    started = time.monotonic()
    receiver.stop()
    receiver.stop()

    assert time.monotonic() - started < 5
    assert receiver.actions == []


def test_the_receiver_binds_to_the_loopback_interface_only(receiver):
    assert receiver.url.startswith("http://127.0.0.1:")


# Its own process


def test_the_command_line_prints_its_url_first_and_serves_until_terminated(tmp_path):
    store = tmp_path / "actions.jsonl"
    command = [sys.executable, "-m", "durable.testing", "--port", "0", "--store", str(store)]

    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        url = process.stdout.readline().strip()
        response = requests.post(
            f"{url}/actions", json={"a": 1}, headers={"Idempotency-Key": "k"}, timeout=5
        )
        process.terminate()
        assert process.wait(timeout=10) == 0

    assert url.startswith("http://127.0.0.1:")
    assert response.status_code == 201
    assert [record["key"] for record in read_store(store)] == ["k"]


def test_a_receiver_process_can_be_driven_like_an_in_process_receiver(tmp_path):
    with ReceiverProcess(tmp_path / "actions.jsonl", lookup=False) as receiver:
        receiver.behave("rate_limited", times=1, retry_after=3)
        limited = post(receiver, key="k")
        created = post(receiver, key="k")
        assert lookup(receiver, "k").status_code == 404
        assert receiver.requests == 3

    assert limited.headers["Retry-After"] == "3"
    assert created.status_code == 201
    assert [action["key"] for action in receiver.actions] == ["k"]


def test_a_receiver_process_without_idempotency_applies_a_replayed_key_again(tmp_path):
    with ReceiverProcess(tmp_path / "actions.jsonl", idempotent=False) as receiver:
        post(receiver, key="k")
        post(receiver, key="k")

    assert len(receiver.actions) == 2
