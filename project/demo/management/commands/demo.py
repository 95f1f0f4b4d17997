"""``manage.py demo``: the lead pipeline and the support agent running for real, with crashes on purpose.

It migrates, creates an operator login, starts the document source, the CRM, the
payments service and the model server on 127.0.0.1, submits a batch of leads and a
few customer messages for the support agent, starts the site and ``runworkers``,
SIGKILLs one worker in the middle of a step and another while it waits for a model's
reply, lets the others finish, and says where to look. Nothing leaves the machine.
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db.models import Count, Sum
from django.urls import NoReverseMatch, reverse

from durable.core import formats
from durable.core.states import StateKind
from durable.core.workflows import registry
from durable.models import EventKind, Job, JobEvent, Outbox, StepResult
from durable.testing import ReceiverProcess, read_store
from durable.verbs import jobs as services

from ...processes import in_group, pid_of
from ...support_story import SupportStory
from ...workflows import APPROVAL_THRESHOLD

WORKFLOW = "pipeline"
# Each lead's behaviour at the source, by position in the batch (see demo/source.py).
PLAN = ["ok", "flaky", "ok", "slow", "doubtful", "ok", "malformed", "ok", "flaky", "ok", "gone",
        "ok"]
# Kinds of state where a job waits for a person, or has finished: the batch is settled
# when every job is in one of them.
SETTLED = {StateKind.TERMINAL, StateKind.FAILED, StateKind.HUMAN, StateKind.APPROVAL,
           StateKind.UNKNOWN}
MANAGE = Path(settings.BASE_DIR) / "manage.py"


class Command(BaseCommand):
    help = ("Run the demo: leads fetched, extracted by a simulated model, verified and "
            "delivered to a CRM, and a support agent answering customers with tools, with"
            " workers killed on purpose. Loopback only.")

    def add_arguments(self, parser):
        parser.add_argument("--docs", type=int, default=24, help="Leads in the batch. (default: %(default)s)")
        parser.add_argument("--workers", type=int, default=3, help="Worker processes. (default: %(default)s)")
        parser.add_argument("--no-server", action="store_true",
                            help="Terminal only: no web site; ends with `durable status`.")
        parser.add_argument("--port", type=int, default=8000, help="Port of the site. (default: %(default)s)")
        parser.add_argument("--lose-replies", type=float, default=0.2,
                            help="Share of CRM replies lost after the CRM acted (settled by"
                                 " lookup). (default: %(default)s)")
        parser.add_argument("--no-kill", action="store_true", help="Do not kill a worker.")
        parser.add_argument("--lease", type=float, default=12.0,
                            help="Lease seconds for the demo's workers (short, so a killed"
                                 " worker's job is taken over quickly). (default: %(default)s)")
        parser.add_argument("--timeout", type=float, default=300.0,
                            help="Seconds to wait for the batch to settle. (default: %(default)s)")
        parser.add_argument("--speed", type=float, default=1.0,
                            help="Scale of the simulated model's delays (1 = real time). (default: %(default)s)")

    def handle(self, *args, docs, workers, no_server, port, lose_replies, no_kill, lease,
               timeout, speed, **options):
        if not 1 <= docs <= 500:
            raise CommandError("--docs must be between 1 and 500")
        if not 1 <= workers <= 32:
            raise CommandError("--workers must be between 1 and 32")
        if not 0 <= lose_replies <= 1:
            raise CommandError("--lose-replies must be between 0 and 1")
        if lease < 10:
            raise CommandError("--lease must be at least 10 seconds (the steps' timeouts are"
                               " up to 6s, and a lease must outlast a step)")
        if speed <= 0:
            raise CommandError("--speed must be positive")
        if not no_server and not _port_free(port):
            raise CommandError(f"Port {port} on 127.0.0.1 is in use: stop what uses it, or"
                               " pass --port N (or --no-server)")
        self.started = []
        self.folder = Path(tempfile.mkdtemp(prefix="durable-demo-"))
        # SIGTERM or a closed terminal stops the demo like Ctrl-C does: everything it
        # started runs in sessions of its own and would otherwise outlive it.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
        try:
            self._run(docs, workers, no_server, port, lose_replies, no_kill, lease, timeout,
                      speed)
        except KeyboardInterrupt:
            self.say("\nStopping.")
        finally:
            self._stop_all()

    # The story -------------------------------------------------------------------------

    def _run(self, docs, workers, no_server, port, lose_replies, no_kill, lease, timeout, speed):
        self.heading("1. Database and operator login")
        call_command("migrate", interactive=False, verbosity=0)
        password = self._operator()
        self.say(f"   migrated {settings.DATABASES['default']['NAME']}")
        self.say(f"   operator login: operator / {password}")

        self.heading("2. The outside world, on 127.0.0.1")
        source_url = self._start_source()
        crm = ReceiverProcess(self.folder / "crm.jsonl", loss_rate=lose_replies, seed=7).start()
        self.started.append(("crm", crm))
        self.say(f"   document source  {source_url}  (some fetches slow, flaky or gone)")
        self.say(f"   CRM              {crm.url}  (leads and tickets; idempotency keys, lookup;"
                 f" {lose_replies:.0%} of replies lost after acting)")
        story = SupportStory(self, self.folder, lose_replies)
        agent_env = story.start(self.started, crm)

        run = time.strftime("%H%M%S")
        self.heading(f"3. A batch of {docs} leads, and customers writing to support")
        keys = self._submit(source_url, docs, run)
        big = sum(1 for n in range(1, docs + 1) if _budget(n) >= APPROVAL_THRESHOLD)
        self.say(f"   submitted {keys[0]} .. {keys[-1]}; deals of {APPROVAL_THRESHOLD:,} EUR"
                 f" or more need approval (about {big})")
        story.submit(run)

        env = {**os.environ, "DEMO_CRM_URL": crm.url, "DURABLE_LEASE_SECONDS": str(lease),
               "DEMO_SPEED": str(speed), "PYTHONUNBUFFERED": "1", **agent_env}
        self.heading("4. Site and workers")
        if not no_server:
            self._spawn("site", [sys.executable, str(MANAGE), "runserver", f"127.0.0.1:{port}",
                                 "--noreload"], env)
            self.say(f"   site      http://127.0.0.1:{port}/admin/  (log: {self.folder}/site.log)")
        # One thread per process: each kill below interrupts exactly the one step (or
        # model call) the story names, not the other steps a threaded process holds.
        runworkers = self._spawn("workers", [sys.executable, str(MANAGE), "runworkers",
                                             "--processes", str(workers), "--threads", "1"], env)
        self.say(f"   runworkers --processes {workers} --threads 1, pid {runworkers.pid}, lease {lease:g}s"
                 f"  (log: {self.folder}/workers.log)")

        killed = agent_killed = None
        if not no_kill:
            killed = self._kill_one(runworkers, keys)
            agent_killed = story.kill_mid_call(runworkers)
        else:
            story.model.release()
        settled = self._wait({WORKFLOW: keys, story.workflow: story.keys}, timeout, runworkers)
        self._summary(keys, killed, crm, settled)
        story.summary(agent_killed)
        if no_server:
            self.heading("6. Workers drain; the terminal view")
            self._terminate("workers")
            self._status()
            self.say(f"\nThe database keeps the jobs: `python {MANAGE.name} runserver` and log in"
                     " as operator to see them in the console.")
            for approval, path in story.proposals():
                self.say(f"The refund proposal waits in the approval queue: {path}"
                         f" ({approval.summary})")
            return
        self._where_to_look(port, password, keys, story)
        self._follow(keys + story.keys)

    def _operator(self):
        password = secrets.token_urlsafe(9)
        user, _ = get_user_model().objects.get_or_create(username="operator")
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        return password

    def _start_source(self):
        proc = subprocess.Popen([sys.executable, "-m", "project.demo.source", "--port", "0"],
                                cwd=settings.BASE_DIR, stdout=subprocess.PIPE, text=True)
        self.started.append(("source", proc))
        url = _first_line(proc, 10)
        if not url:
            raise CommandError("The document source did not start")
        return url

    def _submit(self, source_url, docs, run):
        keys = []
        for n in range(1, docs + 1):
            kind = PLAN[(n - 1) % len(PLAN)]
            key = f"lead-{n:04d}-{run}"
            services.submit(WORKFLOW, key, {"url": f"{source_url}/docs/{n}?kind={kind}",
                                            "kind": kind}, submitted_by="demo")
            keys.append(key)
        return keys

    def _spawn(self, name, argv, env):
        log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115 - closed in _stop_all
        # A session of its own: the whole group (supervisor and children) stops together.
        proc = subprocess.Popen(argv, cwd=settings.BASE_DIR, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        proc.log = log
        self.started.append((name, proc))
        return proc

    def _kill_one(self, runworkers, keys):
        """SIGKILL a worker of ours while it holds a lease in the middle of extract."""
        self.heading("5. Workers are killed on purpose")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for job in Job.objects.filter(pk__in=keys, state="extracting",
                                          lease_owner__isnull=False):
                pid = pid_of(job.lease_owner)
                if pid and in_group(pid, runworkers.pid):
                    os.kill(pid, signal.SIGKILL)
                    self.say(f"   SIGKILL worker pid {pid} while it was extracting {job.pk}"
                             f" (attempt {job.attempts}); the supervisor starts a replacement,"
                             " and the job waits for its lease to expire")
                    return {"job": job.pk, "pid": pid, "owner": job.lease_owner}
            if runworkers.poll() is not None:
                raise CommandError(f"runworkers exited: see {self.folder}/workers.log")
            time.sleep(0.05)
        self.say("   no worker was caught mid-extract; nothing was killed")
        return None

    def _wait(self, keys_by_workflow, timeout, runworkers):
        """Print progress until every job finished or waits for a person."""
        deadline = time.monotonic() + timeout
        began = time.monotonic()
        last = None
        while True:
            parts, settled = [], True
            for workflow, keys in keys_by_workflow.items():
                table = registry.get(workflow).table
                order = list(table.edges)
                counts = Counter(Job.objects.filter(pk__in=keys).values_list("state", flat=True))
                parts.append("  ".join(f"{s} {counts[s]}" for s in sorted(counts, key=order.index)))
                settled = settled and all(table.kinds[s] in SETTLED for s in counts)
            line = "  |  ".join(parts)
            if line != last:
                self.say(f"   +{time.monotonic() - began:5.1f}s  {line}")
                last = line
            if settled:
                return True
            if time.monotonic() > deadline:
                self.say(f"   still moving after {timeout:g}s; see {self.folder}/workers.log")
                return False
            if runworkers.poll() is not None:
                raise CommandError(f"runworkers exited: see {self.folder}/workers.log")
            time.sleep(0.5)

    def _summary(self, keys, killed, crm, settled):
        self.heading("What happened")
        jobs = Job.objects.filter(pk__in=keys)
        counts = Counter(jobs.values_list("state", flat=True))
        self.say(f"   delivered to the CRM        {counts['delivered']}")
        self.say(f"   waiting for your approval   {counts['awaiting_approval_deliver']}")
        self.say(f"   waiting for a person        {counts['needs_human']}")
        failed = jobs.filter(state__startswith="failed_").order_by("pk")
        self.say(f"   failed (poison)             {failed.count()}")
        for job in failed:
            self.say(f"      {job.pk}  {job.state}: {job.last_error[:100]}")
        retries = JobEvent.objects.filter(job_id__in=keys, kind=EventKind.RETRY).count()
        self.say(f"   transient failures retried  {retries}")
        memos = StepResult.objects.filter(job_id__in=keys)
        cost = memos.aggregate(total=Sum("cost"))["total"] or Decimal(0)
        # The model's price list is in DURABLE["CURRENCY"], as the console writes it; deals
        # and refunds are in the shop's own currency (EUR).
        self.say(f"   model cost                  {formats.money(cost)}"
                 f" over {memos.filter(step='extract').count()} extractions")
        records = [r for r in read_store(crm.store_path) if r["body"].get("type") != "ticket"]
        distinct = len({r["key"] for r in records})
        self.say(f"   CRM leads created           {len(records)}, {distinct} distinct"
                 " idempotency keys (a lost reply is looked up, never sent twice blindly)")
        settled_by_lookup = Outbox.objects.filter(job_id__in=keys, lookups__gt=0).count()
        self.say(f"   lost lead replies settled   {settled_by_lookup} by looking the key up")
        if killed:
            taken = JobEvent.objects.filter(job_id=killed["job"], kind=EventKind.RECLAIMED).first()
            extracts = memos.filter(job_id=killed["job"], step="extract").count()
            fetched = JobEvent.objects.filter(job_id=killed["job"], step="fetch",
                                              kind=EventKind.CLAIMED).count()
            job = Job.objects.get(pk=killed["job"])
            if taken:
                self.say(f"   the killed worker's job     {killed['job']}: taken over by"
                         f" {taken.actor} once the lease expired; fetch ran {fetched} time(s),"
                         f" extract committed {extracts} memo; now {job.state}")
            else:
                self.say(f"   the killed worker's job     {killed['job']}: now {job.state}")
        if not settled:
            self.say("   (the batch had not settled when the demo stopped waiting)")

    def _where_to_look(self, port, password, keys, story):
        base = f"http://127.0.0.1:{port}"
        self.heading(f"Where to look (log in as operator / {password})")
        self.say(f"   {'home':15} {base}/")
        for label, name, fallback in (
            ("dashboard", "admin:durable_dashboard", "/admin/durable/dashboard/"),
            ("approval queue", "admin:durable_approvals", "/admin/durable/approvals/"),
            ("cost report", "admin:durable_costs", "/admin/durable/costs/"),
            ("jobs", "admin:durable_job_changelist", "/admin/durable/job/"),
        ):
            self.say(f"   {label:15} {base}{_url(name, fallback)}")
        self.say(f"   {'metrics':15} {base}/metrics")
        story.where_to_look(base)
        self.say("\nThe site and the workers keep running: approve the large deals and the refund"
                 " and watch them reach the CRM and the payments service here. Press Ctrl-C to"
                 " stop.")

    def _follow(self, keys):
        finished = ["delivered", "done", "cancelled"]
        seen = set(Job.objects.filter(pk__in=keys, state__in=finished).values_list("pk", flat=True))
        while True:
            time.sleep(1)
            for name, proc in self.started:
                if isinstance(proc, subprocess.Popen) and proc.poll() is not None:
                    raise CommandError(f"{name} exited: see {self.folder}/{name}.log")
            for job in Job.objects.filter(pk__in=keys).exclude(pk__in=seen).filter(
                    state__in=finished):
                seen.add(job.pk)
                self.say(f"   {job.pk} {job.state}")

    def _status(self):
        try:
            call_command("durable", "status", stdout=self.stdout)
        except CommandError:
            # Older builds have no `durable status`: the counts are the essence of it.
            for row in (Job.objects.values("workflow", "state").order_by("workflow", "state")
                        .annotate(n=Count("pk"))):
                self.say(f"   {row['workflow']:12} {row['state']:28} {row['n']}")

    # Processes -----------------------------------------------------------------------

    def _terminate(self, name, grace=20):
        for label, proc in self.started:
            if label == name and isinstance(proc, subprocess.Popen) and proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait(5)

    def _stop_all(self):
        for name, proc in reversed(getattr(self, "started", [])):
            if not isinstance(proc, subprocess.Popen):  # a receiver, the model server
                proc.stop()
                continue
            if proc.poll() is None:
                if name in ("workers", "site"):
                    _signal_group(proc, signal.SIGTERM)
                else:
                    proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait(5)
            for stream in (getattr(proc, "log", None), proc.stdout):
                if stream is not None:
                    stream.close()

    # Output --------------------------------------------------------------------------

    def heading(self, text):
        self.stdout.write(self.style.MIGRATE_HEADING(f"\n{text}"))

    def say(self, text):
        self.stdout.write(text)
        self.stdout.flush()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _budget(n):
    from ...source import budget

    return budget(n)


def _first_line(proc, timeout):
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline().strip()),
                              daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else None


def _port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _url(name, fallback):
    try:
        return reverse(name)
    except NoReverseMatch:
        return fallback
