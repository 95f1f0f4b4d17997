"""Drill: several hosts, one PostgreSQL, and network partitions instead of kills.

Three hosts (network namespaces, see ``netlab``) run ``runworkers``; the lab's own
PostgreSQL listens on one bridge, a receiver without idempotency (but with lookup by
key) on another. Each round cuts:

1. a worker host, both links, while its steps run, for longer than the lease: the
   other hosts finish its jobs; its heartbeat abandons the long step it can no longer
   renew; when the link comes back, its late commits are refused by the fence;
2. a dispatcher host's database link, after the receiver applied its action and
   before the dispatcher could record the reply: another dispatcher settles the action
   by lookup, never by a second send;
3. one host's link to the receiver only, while actions flow: its sends fail to
   connect (nothing delivered) and other hosts deliver them.

Every cut heals, the runs finish, and the counts are those of every drill, plus the
time from each cut to the cut host's jobs finishing elsewhere. Run it alone with::

    python -m tests.drills.partition --size small   # prints the row as JSON

``python -m tests.drills.run --only partition --database postgres`` runs it in a child
process like this and prints its row in the table.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import netlab

ROOT = Path(__file__).resolve().parent.parent.parent

LEASE = 3.0
# DB_DEAD_AFTER and DB_CONNECT_TIMEOUT keep their defaults (20 s, 10 s): longer than the
# worker cut, so a commit caught in flight by that cut is retransmitted when the link
# comes back, the late write the fence must refuse. Bounding the time a step runs on a
# lease nobody renewed is the heartbeat's deadline, whatever the TCP timeouts.
# The dispatcher's read timeout and the receiver's slowness for the cut send: the reply
# comes back while the dispatcher's database link is already down.
READ_TIMEOUT = 3.0
# Seconds each step of the short jobs works: the cut finds them mid-step or mid-commit.
WORK = 0.2
SLOW_REPLY = 1.5
# Lease margin the dispatcher adds to the destination's timeouts for a send (the default).
SEND_MARGIN = 5.0
# The lab's server drops sessions of a host that vanished mid-transaction, so their row
# locks do not hold others back (what the README recommends for the workers' role).
SERVER_SETTINGS = {"idle_in_transaction_session_timeout": "2s"}

STARTED = re.compile(r"started (?:worker|dispatcher)\d+ pid=(\d+)")
OWNER_PID = re.compile(r":(\d+):(?:worker|dispatcher)\d+(?:\.\d+)?$")
WORKER_PID = re.compile(r":(\d+):worker\d+(?:\.\d+)?$")


@dataclass(frozen=True)
class Size:
    name: str
    rounds: int  # each round cuts a worker host, a dispatcher host, a receiver link
    jobs: int  # four-step jobs per round
    hold_jobs: int  # jobs with a step longer than the lease, per round
    tickets: int  # action jobs during the dispatcher cut
    receiver_jobs: int  # action jobs during the receiver cut
    processes: int  # runworkers --processes on each host
    settle_timeout: float


SIZES = {
    "small": Size("small", rounds=1, jobs=12, hold_jobs=1, tickets=6, receiver_jobs=12,
                  processes=2, settle_timeout=90),
    "release": Size("release", rounds=3, jobs=16, hold_jobs=1, tickets=20, receiver_jobs=60,
                    processes=2, settle_timeout=300),
}


def _wait(predicate, timeout, interval=0.05):
    from .drills import _wait as wait  # after django.setup(): drills imports the models

    return wait(predicate, timeout, interval)


class Hosts:
    """The runworkers of each host, and which host a worker or dispatcher pid belongs to."""

    def __init__(self, lab, net, env, processes):
        self.lab, self.net, self.env = lab, net, env
        self.procs = {host: lab.runworkers(processes, prefix=net.exec_prefix(host), env=env)
                      for host in net.hosts}
        for proc in self.procs.values():
            lab.wait_for_workers(proc, processes + 1, timeout=60)

    def pids(self, host):
        """Every worker and dispatcher pid the host's supervisor ever started."""
        return {int(p) for p in STARTED.findall(self.lab.output(self.procs[host]))}

    def host_of(self, owner):
        m = OWNER_PID.search(owner or "")
        if not m:
            return None
        pid = int(m.group(1))
        return next((h for h in self.procs if pid in self.pids(h)), None)

    def stop(self):
        for proc in self.procs.values():
            self.lab.stop(proc)


def _held_by(hosts, host):
    """Job ids whose lease (job or outbox row) a process of ``host`` holds now."""
    from django.db.models.functions import Now

    from durable.models import Job, Outbox

    pids = hosts.pids(host)
    held = set()
    for model in (Job, Outbox):
        rows = model.objects.filter(lease_until__gte=Now()).values_list(
            "job_id" if model is Outbox else "id", "lease_owner")
        for job, owner in rows:
            m = OWNER_PID.search(owner or "")
            if m and int(m.group(1)) in pids:
                held.add(job)
    return held


def _finished_at(keys):
    """Database time each of ``keys`` reached its terminal state (job id -> datetime)."""
    from durable.core.workflows import registry
    from durable.models import Job, JobEvent

    terminal = {}
    for job in Job.objects.filter(pk__in=keys).values("id", "workflow", "state"):
        states = registry.get(job["workflow"]).table.terminal_states()
        if job["state"] in states:
            terminal[job["id"]] = states
    out = {}
    for ev in JobEvent.objects.filter(job_id__in=terminal).values("job_id", "to_state", "at"):
        if ev["to_state"] in terminal[ev["job_id"]]:
            out[ev["job_id"]] = max(out.get(ev["job_id"], ev["at"]), ev["at"])
    return out


def _behave(net, receiver, mode, times, delay):
    """Change the receiver's behaviour from inside the namespace that reaches it."""
    body = json.dumps({"mode": mode, "times": times, "delay": delay})
    code = ("import sys, urllib.request\n"
            "r = urllib.request.Request(sys.argv[1] + '/_control', data=sys.argv[2].encode(),"
            " method='POST', headers={'Content-Type': 'application/json'})\n"
            "urllib.request.urlopen(r, timeout=5).read()")
    subprocess.run([*net.exec_prefix("svc"), sys.executable, "-c", code, receiver.url, body],
                   check=True, capture_output=True)


class Cut:
    """One partition: when, which host and links, and the jobs it held at that moment."""

    def __init__(self, kind, host, held, at_wall, db_marker):
        self.kind, self.host, self.held = kind, host, held
        self.at_wall = at_wall
        self.db_marker = db_marker  # the last event id before the cut
        self.after_lease_marker = None  # the last event id once the host's leases passed
        self.pids = set()


def _last_event_id():
    from django.db.models import Max

    from durable.models import JobEvent

    return JobEvent.objects.aggregate(m=Max("id"))["m"] or 0


def _cut(net, hosts, kind, host, links):
    from durable.store import locking

    marker = _last_event_id()
    pids = hosts.pids(host)
    net.cut(host, links)
    at = locking.db_now()
    cut = Cut(kind, host, _held_by(hosts, host), at, marker)
    cut.pids = pids
    return cut


def _worker_cut(lab, net, hosts, size, round_):
    """Cut a host whose worker is inside a step longer than the lease; heal after the lease."""
    keys = lab.submit(size.hold_jobs, prefix=f"r{round_}-hold", workflow="drill_hold",
                      hold={"step": "b", "seconds": LEASE * 3, "attempt": 1})
    preferred = net.hosts[round_ % len(net.hosts)]

    def holders_in_step_b():
        inside = {}
        for parts in _exec_lines(lab.exec_log):
            if parts[0] == "exec" and parts[1].startswith(f"r{round_}-hold") and parts[2] == "b":
                for host in net.hosts:
                    if int(parts[4]) in hosts.pids(host):
                        inside[host] = inside.get(host, 0) + 1
        return inside

    if not _wait(holders_in_step_b, 60):
        raise RuntimeError("no host reached the long step b")
    inside = holders_in_step_b()
    # Best: a host with one worker in the long step and the other in short ones (the
    # short jobs come now, so that worker is free for them), so the cut catches both a
    # step the heartbeat abandons and a commit in flight.
    host = min(inside, key=lambda h: (inside[h] != 1, h != preferred, h))
    keys += lab.submit(size.jobs, prefix=f"r{round_}-work", work=WORK)
    # Not longer than a lease: the long step (three leases) must still be running at the cut,
    # whether or not a short one reached this host by then (on a loaded machine it may not).
    _wait(lambda: any(p[1].startswith(f"r{round_}-work") and int(p[4]) in hosts.pids(host)
                      for p in _exec_lines(lab.exec_log)), LEASE, 0.02)
    time.sleep(WORK / 2)
    cut = _cut(net, hosts, "worker host", host, None)
    time.sleep(LEASE + 0.5)
    cut.after_lease_marker = _last_event_id()
    time.sleep(1.5)  # cut for the lease plus two seconds, shorter than DB_DEAD_AFTER
    net.heal(host)
    return cut, keys


def _dispatcher_cut(lab, net, hosts, receiver, size, round_):
    """Cut a dispatcher host's database link after the receiver applied its send."""
    from durable.models import Outbox

    before = len(receiver.actions)
    _behave(net, receiver, "slow_after_acting", 1, SLOW_REPLY)
    keys = [f"r{round_}-ticket-{i:04d}" for i in range(size.tickets)]
    import durable

    for key in keys:
        durable.submit("drill_ticket", key, {"customer": key})
    lab.submitted.extend(keys)
    if not _wait(lambda: len(receiver.actions) > before, 60, 0.01):
        raise RuntimeError("the receiver applied no action")
    applied = receiver.actions[before:]
    row = Outbox.objects.filter(idempotency_key=applied[0]["key"]).values(
        "job_id", "lease_owner").first()
    host = hosts.host_of(row["lease_owner"]) if row else None
    if host is None:
        raise RuntimeError(f"no host holds the action just applied: {row}")
    cut = _cut(net, hosts, "dispatcher host (database link)", host, "db")
    cut.held.add(row["job_id"])
    cut.action_job = row["job_id"]
    # Another dispatcher may act once the send's lease (timeouts plus margin) has passed.
    send_lease = max(LEASE, 1.0 + READ_TIMEOUT + SEND_MARGIN)
    time.sleep(send_lease + 0.5)
    cut.after_lease_marker = _last_event_id()
    time.sleep(2.5)
    net.heal(host, "db")
    return cut, keys


def _receiver_cut(lab, net, hosts, size, round_, exclude):
    """Cut one host off from the receiver only while actions flow; the others deliver."""
    import durable

    host = next(h for h in net.hosts[::-1] if h not in exclude) if len(net.hosts) > 1 else net.hosts[0]
    cut = _cut(net, hosts, "receiver from one host", host, "svc")
    keys = [f"r{round_}-recv-{i:04d}" for i in range(size.receiver_jobs)]
    for key in keys:
        durable.submit("drill_ticket", key, {"customer": key})
    lab.submitted.extend(keys)
    cut.held = set(keys)  # the jobs sent while the link was down
    time.sleep(LEASE * 2)
    net.heal(host, "svc")
    return cut, keys


def _exec_lines(path):
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [line.split() for line in text.splitlines() if len(line.split()) == 5]


def _late_commits(cut):
    """Events the cut host's workers committed for its jobs under the leases the cut broke.

    After the heal a process of the host may claim one of those jobs again: what it
    writes after that new claim is its own. Anything it writes for the job before
    such a claim, once the leases had passed, rode on the old lease.
    """
    from durable.models import JobEvent

    from .counts import CLAIM_KINDS

    late = []
    if cut.after_lease_marker is None:
        return late  # the host kept its database link: its commits are its own
    claimed_again = set()
    for ev in JobEvent.objects.filter(id__gt=cut.after_lease_marker, job_id__in=cut.held).order_by(
            "id").values("id", "job_id", "kind", "actor"):
        m = WORKER_PID.search(ev["actor"] or "")
        if not m or int(m.group(1)) not in cut.pids:
            continue  # a dispatcher's writes are fenced by the outbox row's own lease
        if ev["kind"] in CLAIM_KINDS:
            claimed_again.add((ev["job_id"], ev["actor"]))
        elif (ev["job_id"], ev["actor"]) not in claimed_again:
            late.append(ev)
    return late


def lab_receiver(lab, net, read_timeout=READ_TIMEOUT):
    """A receiver without idempotency (lookups on) in the svc namespace, and the workers' env for it."""
    from durable.testing import ReceiverProcess

    receiver = ReceiverProcess(lab.workdir / "receiver.jsonl", idempotent=False, lookup=True,
                               host=net.receiver_address, port=netlab.RECEIVER_PORT,
                               prefix=net.exec_prefix("svc")).start()
    return receiver, {
        "DURABLE_TEST_POSTGRES_URL": net.database_url(),
        "DURABLE_TEST_RECEIVER_URL": receiver.url, "DURABLE_TEST_RECEIVER_IDEMPOTENT": "0",
        "DURABLE_TEST_RECEIVER_LOOKUP": "1", "DURABLE_TEST_RECEIVER_READ_TIMEOUT": read_timeout,
    }


def partition_drill(lab, net, size):
    """Run every round of cuts, heal, settle and count: one row."""

    from .counts import count
    from .drills import _effects

    began = time.monotonic()
    receiver, env = lab_receiver(lab, net)
    hosts = None
    cuts = []
    try:
        hosts = Hosts(lab, net, env, size.processes)
        for round_ in range(size.rounds):
            cut, _ = _worker_cut(lab, net, hosts, size, round_)
            cuts.append(cut)
            cut, _ = _dispatcher_cut(lab, net, hosts, receiver, size, round_)
            cuts.append(cut)
            cut, _ = _receiver_cut(lab, net, hosts, size, round_, exclude={cut.host})
            cuts.append(cut)
            # Each round starts from quiet hosts, so its times measure that round's cuts.
            _wait(lambda: lab.unsettled() == 0, size.settle_timeout, 0.2)
        settled = _wait(lambda: lab.unsettled() == 0, size.settle_timeout, 0.2)
        hosts.stop()
        hosts = None
        effects = _effects(receiver, set(lab.submitted))
        row = count(lab, f"partition x{len(net.hosts)} hosts", began=began, effects=effects)
        logs = lab.logs()
        late = [ev for cut in cuts for ev in _late_commits(cut)]
        times = {}
        for cut in cuts:
            finished = _finished_at(cut.held)
            times[cut.kind] = [(at - cut.at_wall).total_seconds() for at in finished.values()]
        every = sorted(t for values in times.values() for t in values)
        worker_times = sorted(times.get("worker host", []))
        row.extra.update(
            hosts=len(net.hosts), cuts=len(cuts),
            cut_jobs=sum(len(c.held) for c in cuts),
            worker_cut_to_finished_p50=round(statistics.median(worker_times), 1) if worker_times else None,
            worker_cut_to_finished_max=round(max(worker_times), 1) if worker_times else None,
            dispatcher_cut_to_finished_max=round(max(times.get("dispatcher host (database link)",
                                                               [0])), 1),
            receiver_cut_to_finished_max=round(max(times.get("receiver from one host", [0])), 1),
            cut_to_finished_p50=round(statistics.median(every), 1) if every else None,
            cut_to_finished_max=round(max(every), 1) if every else None,
            late_commits_after_lease=len(late),
            late_writes_refused=logs.count("lease lost or job moved")
            + logs.count("outcome not recorded here"),
            steps_abandoned=logs.count("abandoning the step uncommitted"),
            sends_not_delivered=_not_sent(lab.submitted),
            lookups=_lookups(lab.submitted),
            settled=bool(settled),
        )
        for cut in cuts:
            missing = set(cut.held) - set(_finished_at(cut.held))
            if missing:
                row.notes.append(f"{cut.kind} {cut.host}: {len(missing)} jobs it held not finished")
        if late:
            row.stale += len(late)
            for ev in late[:5]:
                row.notes.append(f"committed after its lease passed: event {ev['id']} {ev['job_id']} "
                                 f"{ev['kind']} by {ev['actor']}")
        if not settled:
            row.notes.append("the runs did not finish after every cut healed")
        return row
    finally:
        if hosts is not None:
            for proc in hosts.procs.values():
                lab.kill_group(proc)
        receiver.stop()


def _not_sent(keys):
    from durable.models import JobEvent

    return JobEvent.objects.filter(job_id__in=keys, message__startswith="not sent").count()


def _lookups(keys):
    from django.db.models import Sum

    from durable.models import Outbox

    return Outbox.objects.filter(job_id__in=keys).aggregate(n=Sum("lookups"))["n"] or 0


def problems(row):
    """What a partition row must show beyond the common targets."""
    out = []
    extra = row.extra
    if not extra.get("settled"):
        out.append("the runs did not finish after the cuts healed")
    if extra.get("late_commits_after_lease"):
        out.append(f"{extra['late_commits_after_lease']} commits after the cut host's leases passed")
    if not extra.get("late_writes_refused"):
        out.append("no late write of a cut host reached the database: the fence was not exercised")
    if not extra.get("steps_abandoned"):
        out.append("no step was abandoned: the heartbeat deadline was not exercised")
    if extra.get("worker_cut_to_finished_max") is None:
        out.append("the cut worker host held no job: the drill proved nothing")
    return out


# Running in a process of its own ------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.drills.partition",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--workdir", help="logs go here (default: a temporary directory)")
    parser.add_argument("--json", help="write the row here as JSON (default: stdout)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads per worker process (default: the setting's default)")
    parser.add_argument("--connections", type=int, default=None,
                        help="database connections per worker process (default: the setting's)")
    args = parser.parse_args(argv)
    # SIGTERM (a parent that gives up on us) unwinds through every finally below, so
    # the namespaces, the cluster and the workers are removed, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    reason = netlab.unavailable()
    if reason:
        text = json.dumps({"skipped": reason})
        if args.json:
            Path(args.json).write_text(text)
        print(text)
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="durable-partition-"))
    with netlab.NetLab(workdir / "net", server_settings=SERVER_SETTINGS) as net:
        os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
        os.environ["DURABLE_TEST_DATABASE"] = "postgres"
        os.environ["DURABLE_TEST_POSTGRES_URL"] = net.local_database_url()
        os.environ["DURABLE_TEST_DB_NAME"] = "durable_partition"
        os.environ["DURABLE_LEASE_SECONDS"] = str(LEASE)
        import django

        django.setup()
        from django.db import connection
        from django.test.utils import setup_databases, teardown_databases

        from .lab import Lab

        old = setup_databases(verbosity=0, interactive=False)
        try:
            lab = Lab(workdir / "lab", lease=LEASE, seed=args.seed, threads=args.threads,
                      connections=args.connections)
            try:
                row = partition_drill(lab, net, SIZES[args.size])
            finally:
                lab.close()
        finally:
            connection.close()
            with contextlib.suppress(Exception):
                teardown_databases(old, verbosity=0)
    text = json.dumps({"row": asdict(row)}, default=str)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0


def run_in_subprocess(size, workdir, timeout=900, threads=None, connections=None):
    """Run the drill in a child process (it needs a Django of its own); return (rows, skip reason)."""
    from .counts import Counts

    if isinstance(threads, tuple | list):
        threads, connections = threads
    options = [*(["--threads", str(threads)] if threads else []),
               *(["--connections", str(connections)] if connections else [])]
    data = netlab.run_drill_child("tests.drills.partition", workdir, "partition",
                                  ["--size", size, *options], timeout)
    if "skipped" in data:
        return [], data["skipped"]
    return [Counts(**data["row"])], None


if __name__ == "__main__":
    sys.exit(main())
