"""A dispatcher cut off mid-send and then frozen never delivers its request after another sent it.

The hole: a dispatcher sends an action over a kept-alive connection while its host is
cut off from the receiver, so the request sits unacknowledged in the kernel's send
queue; the process is frozen (SIGSTOP, a paused VM) before its read timeout closes the
socket. The kernel keeps retransmitting. Once the send's lease passes, another
dispatcher takes the row over, looks the action up, finds nothing and sends it. When
the network heals, the first request arrives too: two effects at a receiver that
answers lookups but does not deduplicate. The bound (``DISPATCH_UNACKED_SECONDS``, set
as ``TCP_USER_TIMEOUT`` on every send's socket, below the lease) makes the kernel drop
the request before the lease ends, frozen process or not.

The drill, on two hosts of the partition lab (``netlab``), with a receiver without
idempotency (lookups on) in the svc namespace:

1. h1 runs a worker and a dispatcher; a first action warms its kept-alive connection;
2. h1's link to the receiver is cut and a second action submitted; once h1's dispatcher
   has marked it attempted and its request sits unacknowledged in h1's kernel (read
   from the dispatcher's TCP table), the dispatcher is frozen;
3. h2 starts, takes the row over after the send's lease, finds nothing by lookup and
   sends it (one effect);
4. h1 heals; the drill waits until h1's kernel holds nothing more for the receiver
   (delivered, or dropped) or ``HEAL_WAIT`` passed, then resumes the dispatcher;
5. counts the receiver's records per idempotency key, and checks that h1's late
   outcome was refused by the fence (the row stays as h2 recorded it).

Run with the bound (the default) and without it (0): the second run shows the
duplicate, so the drill can fail and the bound is what prevents it. Each case runs
in a child process with a Django of its own on the lab's cluster; alone::

    python -m tests.drills.test_frozen_send [--unacked 0]   # prints the result as JSON

Needs root; without it the tests skip with the reason, except under ``CI=true``,
where a lab that cannot be built is a failure.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import pytest

from durable.conf import DEFAULTS
from tests.conftest import ON_POSTGRES

from . import netlab
from .partition import SERVER_SETTINGS, lab_receiver

pytestmark = [
    pytest.mark.crash,
    pytest.mark.postgres,
    # The lab brings its own cluster; running it once, in the PostgreSQL leg, is enough.
    pytest.mark.skipif(not ON_POSTGRES, reason="runs in the PostgreSQL leg (DURABLE_TEST_DATABASE=postgres)"),
]

LEASE = 8.0
# The destination's (1 s connect, READ_TIMEOUT) plus the default 5 s margin is exactly
# LEASE: the send's lease stays LEASE_SECONDS, and the default bound is 8 - 5 = 3 s.
READ_TIMEOUT = 2.0
# After the heal: the longest the drill waits for h1's kernel to deliver what it holds.
# Retransmissions back off from 0.2 s, doubling (0.2, 0.6, 1.4, 3.0, 6.2, 12.6, 25.4 s
# after the send): the heal comes about 8 s after it, the next one 12.6 s after it.
HEAL_WAIT = 20.0
# It waits at least until the retransmission after the heal was due, so a bounded run
# watches the moment an unbounded one delivers (seconds after the freeze).
RETRANSMISSION_DUE = 14.0
ESTABLISHED = 1  # /proc/net/tcp's state code
DISPATCHER = re.compile(r"started dispatcher0 pid=(\d+)")


def assert_fenced(result):
    """What both cases share: the freeze caught the request, h2 settled the row, h1 was refused."""
    assert result["frozen_with_request_unacked"], f"the freeze missed the request in flight: {result}"
    assert result["taken_over_by_h2"], f"h2 did not look the action up and send it: {result}"
    assert result["warm_effects"] == 1, result
    # h1's late outcome reached the database and the fence refused it: the row stays
    # as h2 recorded it, and h1's dispatcher wrote no event after its freeze.
    assert result["late_outcome_refused"], result
    assert result["row_unchanged"], result
    assert result["late_events"] == 0, result
    assert result["job_done"], result


def test_a_frozen_dispatcher_cut_off_mid_send_never_delivers_its_request_after_another_sent_it(
        lab_available, tmp_path):
    result = run_in_subprocess(tmp_path, unacked=None)
    assert result["unacked_seconds"] == LEASE - DEFAULTS["LEASE_MARGIN_SECONDS"]
    assert_fenced(result)
    # The kernel dropped the request before the lease ended, so before h2 could send.
    assert result["dropped_before_lease_ended"], result
    assert result["effects"] == 1, result


def test_without_the_bound_the_frozen_request_arrives_after_the_heal_and_is_applied_twice(
        lab_available, tmp_path):
    result = run_in_subprocess(tmp_path, unacked=0)
    assert result["unacked_seconds"] == 0
    assert_fenced(result)
    assert result["unacked_at_heal"], f"h1's kernel no longer held the request at the heal: {result}"
    # The retransmission got through after the heal: the duplicate the bound prevents.
    assert result["effects"] == 2, result


# The drill, in a process of its own ---------------------------------------------------


def _address(text):
    """``0100CA0A:1F90`` (a /proc/net/tcp address) as ("10.202.0.1", 8080)."""
    ip, port = text.split(":")
    return socket.inet_ntoa(struct.pack("=I", int(ip, 16))), int(port, 16)


def _connections(pid, peer):
    """TCP connections to ``peer`` in ``pid``'s network namespace: {local port: (state, unacked bytes)}."""
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return {}
    found = {}
    for line in lines:
        fields = line.split()
        if _address(fields[2]) == peer:
            found[_address(fields[1])[1]] = (int(fields[3], 16), int(fields[4].split(":")[0], 16))
    return found


def _holding(pid, peer, port):
    """Whether the connection from local ``port`` still has bytes the peer has not acknowledged."""
    state, unacked = _connections(pid, peer).get(port, (None, 0))
    return state == ESTABLISHED and unacked > 0


def _pid(lab, proc, pattern, timeout=30):
    from .partition import _wait

    if not _wait(lambda: pattern.search(lab.output(proc)), timeout):
        raise RuntimeError(f"no {pattern.pattern!r} in the log:\n{lab.output(proc)[-3000:]}")
    return int(pattern.search(lab.output(proc)).group(1))


def _events_by(job, pid):
    from durable.models import JobEvent

    return JobEvent.objects.filter(job_id=job, actor__contains=f":{pid}:dispatcher").count()


def frozen_send(lab, net):
    """Run the scenario once (the module's docstring); return what it observed."""
    import durable
    from durable.actions import destinations
    from durable.models import JobEvent, Outbox, OutboxStatus
    from durable.testing import read_store

    from .partition import _wait

    began = time.monotonic()
    peer = (net.receiver_address, netlab.RECEIVER_PORT)
    receiver, env = lab_receiver(lab, net, READ_TIMEOUT)
    result = {"unacked_seconds": destinations.unacked_seconds()}
    times = result["seconds"] = {}
    try:
        h1 = lab.runworkers(1, prefix=net.exec_prefix("h1"), env=env)
        lab.wait_for_workers(h1, 2, timeout=60)
        dispatcher = _pid(lab, h1, DISPATCHER)

        # 1. The first action leaves a kept-alive connection in h1's dispatcher.
        lab.submitted.extend(["warm", "frozen"])
        durable.submit("drill_ticket", "warm", {"customer": "warm"})
        if not _wait(lambda: lab.done(["warm"]) == 1, 30):
            raise RuntimeError("the warm-up action did not finish")
        if not any(state == ESTABLISHED for state, _ in _connections(dispatcher, peer).values()):
            raise RuntimeError("h1's dispatcher kept no connection to the receiver")
        times["start_to_warm"] = round(time.monotonic() - began, 1)

        # 2. Cut, send, freeze while the request sits unacknowledged in h1's kernel.
        net.cut("h1", "svc")
        cut_at = time.monotonic()
        durable.submit("drill_ticket", "frozen", {"customer": "frozen"})
        rows = Outbox.objects.filter(job_id="frozen")
        if not _wait(lambda: rows.filter(status=OutboxStatus.ATTEMPTED).exists(), 30, 0.01):
            raise RuntimeError("h1's dispatcher did not mark the action attempted")
        # The mark commits before the send: freezing right at the mark could stop the
        # process before its request reached the kernel, which is another case.
        holding = {}

        def request_in_kernel():
            holding.update((port, unacked) for port, (state, unacked)
                           in _connections(dispatcher, peer).items()
                           if state == ESTABLISHED and unacked > 0)
            return bool(holding)

        if not _wait(request_in_kernel, READ_TIMEOUT / 2, 0.002):
            raise RuntimeError(f"no unacknowledged request to the receiver in h1: "
                               f"{_connections(dispatcher, peer)}")
        lab.pause(dispatcher)
        frozen_at = time.monotonic()
        (port,) = holding
        row = rows.get()
        result["frozen_with_request_unacked"] = (
            _holding(dispatcher, peer, port) and row.status == OutboxStatus.ATTEMPTED
            and f":{dispatcher}:" in (row.lease_owner or ""))
        result["request_bytes"] = holding[port]
        h1_events = _events_by("frozen", dispatcher)
        times["cut_to_frozen"] = round(frozen_at - cut_at, 2)

        # 3. h2 takes the row over once the send's lease passed, and sends it.
        h2 = lab.runworkers(1, prefix=net.exec_prefix("h2"), env=env)
        lab.wait_for_workers(h2, 2, timeout=60)
        other = _pid(lab, h2, DISPATCHER)
        dropped = []

        def settled():
            if not dropped and not _holding(dispatcher, peer, port):
                dropped.append(time.monotonic())
            return rows.filter(status=OutboxStatus.SUCCEEDED).exists()

        if not _wait(settled, LEASE * 4, 0.05):
            raise RuntimeError(f"h2 did not settle the action: {rows.values().get()}")
        settled_at = time.monotonic()
        times["frozen_to_settled_by_h2"] = round(settled_at - frozen_at, 1)
        # The mark came after the cut, so its lease ended after cut_at + LEASE: dropped
        # before that, the request was gone before another dispatcher could take over.
        result["dropped_before_lease_ended"] = bool(dropped) and dropped[0] < cut_at + LEASE
        if dropped:
            times["frozen_to_dropped_by_kernel"] = round(dropped[0] - frozen_at, 1)
        messages = list(JobEvent.objects.filter(job_id="frozen", actor__contains=f":{other}:")
                        .values_list("message", flat=True))
        result["taken_over_by_h2"] = any(m.startswith("lookup: not found") for m in messages)
        fields = ("status", "attempts", "lookups", "remote_id", "version", "lease_token")
        snapshot = rows.values(*fields).get()

        # 4. Heal; whatever h1's kernel still holds is delivered now, or never.
        net.heal("h1", "svc")
        healed_at = time.monotonic()
        result["unacked_at_heal"] = _holding(dispatcher, peer, port)
        _wait(lambda: (not _holding(dispatcher, peer, port)
                       and time.monotonic() - frozen_at > RETRANSMISSION_DUE), HEAL_WAIT, 0.1)
        times["heal_to_resume"] = round(time.monotonic() - healed_at, 1)
        time.sleep(1.0)  # a delivered request is applied before its reply leaves

        # 5. Resume h1's dispatcher: its outcome comes late, and the fence refuses it.
        lab.resume(dispatcher)
        refused = f"action={row.pk} lease lost or settled meanwhile"
        result["late_outcome_refused"] = _wait(lambda: refused in lab.output(h1), 15)
        time.sleep(1.0)
        result["row_unchanged"] = rows.values(*fields).get() == snapshot
        result["late_events"] = _events_by("frozen", dispatcher) - h1_events
        result["job_done"] = _wait(lambda: lab.done(["frozen"]) == 1, 15)

        # 6. The receiver's own records are the ground truth.
        records = read_store(receiver.store_path)
        warm_key = Outbox.objects.get(job_id="warm").idempotency_key
        result["effects"] = sum(r["key"] == row.idempotency_key for r in records)
        result["warm_effects"] = sum(r["key"] == warm_key for r in records)
        times["total"] = round(time.monotonic() - began, 1)
        return result
    finally:
        lab.close()  # resumes h1's dispatcher if still frozen, then kills every process
        receiver.stop()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.drills.test_frozen_send",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--unacked", type=float, default=None,
                        help="DISPATCH_UNACKED_SECONDS (default: the setting's default; 0: off)")
    parser.add_argument("--workdir", help="logs go here (default: a temporary directory)")
    parser.add_argument("--json", help="write the result here as JSON (default: stdout)")
    args = parser.parse_args(argv)
    # SIGTERM (a parent that gives up on us) unwinds through every finally below, so
    # the namespaces, the cluster and the processes are removed, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    reason = netlab.unavailable()
    if reason:
        result = {"skipped": reason}
    else:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="durable-frozen-send-"))
        with netlab.NetLab(workdir / "net", hosts=2, server_settings=SERVER_SETTINGS) as net:
            os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
            os.environ["DURABLE_TEST_DATABASE"] = "postgres"
            os.environ["DURABLE_TEST_POSTGRES_URL"] = net.local_database_url()
            os.environ["DURABLE_TEST_DB_NAME"] = "durable_frozen_send"
            os.environ["DURABLE_LEASE_SECONDS"] = str(LEASE)
            os.environ.pop("DURABLE_DISPATCH_UNACKED_SECONDS", None)
            if args.unacked is not None:
                os.environ["DURABLE_DISPATCH_UNACKED_SECONDS"] = str(args.unacked)
            import django

            django.setup()
            from django.db import connection
            from django.test.utils import setup_databases, teardown_databases

            from .lab import Lab

            old = setup_databases(verbosity=0, interactive=False)
            try:
                result = frozen_send(Lab(workdir / "lab", lease=LEASE), net)
            finally:
                connection.close()
                with contextlib.suppress(Exception):
                    teardown_databases(old, verbosity=0)
    text = json.dumps(result)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0


def run_in_subprocess(workdir, unacked=None, timeout=240):
    """Run one case in a child process (it needs a Django of its own); return its result.

    Skips the calling test when the child found the lab unavailable.
    """
    result = netlab.run_drill_child("tests.drills.test_frozen_send", workdir, "frozen_send",
                                    ["--unacked", str(unacked)] if unacked is not None else [], timeout)
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return result


if __name__ == "__main__":
    sys.exit(main())
