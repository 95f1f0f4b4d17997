"""Concurrency keys with real processes: one writer per conversation across a fleet, under kills.

Eight conversations of five messages each, every message an agent run (a model call, a
tool call, a model call) under the key ``conversation:<n>``, which allows one run at
once. Four ``runworkers`` processes take them, SIGKILLed during the drill. The fake
model server is the witness: from its own log, each run is active from its first
request's arrival to its last reply, and no two runs of one conversation overlap; they
come in the order their messages were submitted.
"""

import collections
import os
import random
import re
import signal
import time

import pytest

import durable
from durable.models import ConcurrencyKey, Job
from durable.testing import FakeModelServer, reply, tool_call

from .conftest import wait_for

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]

LOOKUP_THEN_ANSWER = [
    reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-1"}, id="c1")], usage=(50, 5)),
    reply("Delivered.", usage=(60, 4)),
]
CONVERSATIONS, MESSAGES = 8, 5


def active_spans(calls):
    """{job: (first request's arrival, last reply)} from the model server's own log."""
    spans = {}
    for call in calls:
        job = re.search(r"message (\S+)$", call.body["messages"][1]["content"]).group(1)
        end = call.answered or call.at
        first, last = spans.get(job, (call.at, end))
        spans[job] = (min(first, call.at), max(last, end))
    return spans


@pytest.mark.parametrize("kills", [0, 2], ids=["steady", "sigkill"])
def test_one_writer_per_conversation_holds_across_processes_and_kills(workers, tmp_path, kills):
    rng = random.Random(5)
    # Each run takes about a second (two model calls of 0.4 s), a conversation five of them
    # one after the other: long enough for the kills to land mid-conversation.
    with FakeModelServer(LOOKUP_THEN_ANSWER, latency=0.4) as server:
        # Messages arrive interleaved across conversations, as from many people at once.
        for m in range(MESSAGES):
            for c in range(CONVERSATIONS):
                durable.submit("test_agent", f"c{c}-m{m}", {"model_url": server.url,
                                                            "message": f"conversation {c}, message c{c}-m{m}"},
                               concurrency_key=f"conversation:{c}")
        proc = workers.start("--no-dispatcher", processes=4, DURABLE_TEST_THREADS=8, DURABLE_LEASE_SECONDS=5)
        from tests.drills.lab import children

        killed = 0
        while killed < kills and Job.objects.exclude(state="done").count() > CONVERSATIONS:
            time.sleep(1.5)
            pids = children(proc.pid)
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
                killed += 1
        total = CONVERSATIONS * MESSAGES
        wait_for(lambda: Job.objects.filter(state="done").count() == total, timeout=180,
                 message="every message to be answered")
        assert workers.terminate(proc) == 0, workers.output(proc)[-3000:]
        calls = list(server.calls)
    assert killed == kills
    spans = active_spans(calls)
    assert len(spans) == total
    by_conversation = collections.defaultdict(list)
    for job, (first, last) in spans.items():
        by_conversation[job.split("-")[0]].append((first, last, job))
    overlaps = []
    for runs in by_conversation.values():
        runs.sort()
        # In the order submitted, each run's first request after the previous run's last reply.
        assert [job for _, _, job in runs] == sorted(job for _, _, job in runs), runs
        overlaps += [(a[2], b[2]) for a, b in zip(runs, runs[1:], strict=False) if b[0] < a[1]]
    assert not overlaps, overlaps
    # Conversations did run side by side: one writer each, not one for the whole fleet.
    starts = sorted((first, last) for runs in by_conversation.values() for first, last, _ in runs)
    assert any(b[0] < a[1] for a, b in zip(starts, starts[1:], strict=False))
    # Every key's places are free at the end: its holders have all finished.
    for row in ConcurrencyKey.objects.all():
        assert not Job.objects.filter(pk__in=list(row.holders)).exclude(state="done").exists(), row.holders
