"""The supervisor behind ``manage.py runworkers``: N worker processes, kept alive.

Children are forked (so they share the parent's loaded code) after the parent closed
its database connections: a connection must never be shared across a fork. A child
that dies is replaced; a child that exits after a step timeout (or, threaded, that
drained itself because too many of its threads were abandoned past their step
timeouts) is replaced at once.
A child never outlives its supervisor, even a SIGKILLed one: it drains as on SIGTERM
(see ``_die_with_parent``), so no orphan keeps claiming work with old code.
"""

import collections
import contextlib
import ctypes
import functools
import logging
import multiprocessing
import operator
import os
import signal
import socket
import sys
import tempfile
import threading
import time

from django.db import connections
from django.db.utils import DatabaseError

from ..conf import durable_settings

logger = logging.getLogger("durable.supervisor")
# What runworkers tells the person who started it (see the README's "Running the workers").
output = logging.getLogger("durable.runworkers")


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

# How often a child checks that its supervisor is alive where the kernel cannot say.
PARENT_CHECK_SECONDS = 1.0

# The signals that stop runworkers (Ctrl-C reaches the whole process group).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})

# After the second signal, how long children have to stop before they are killed.
FORCE_SECONDS = 5.0
# What a --burst child sends its supervisor when one of its loops runs out of work.
IDLE_SIGNAL = signal.SIGUSR1


def _die_with_parent(parent_pid):
    """SIGTERM this process (a drain) when the supervisor ``parent_pid`` is gone.

    Linux sends the parent-death signal; elsewhere a thread checks the parent pid.
    """
    if sys.platform.startswith("linux"):
        try:
            # The running program's own symbols include libc's: no find_library, which
            # runs ldconfig in a subprocess in every child.
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
        if armed:
            # The supervisor may have died before prctl: then no signal will come.
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
            return
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="durable-parent-check").start()


def _watch_parent(parent_pid, interval=PARENT_CHECK_SECONDS):
    """Poll until the parent is gone (the child was re-parented), then SIGTERM this process."""
    while os.getppid() == parent_pid:
        time.sleep(interval)
    logger.warning("supervisor pid=%d is gone: draining", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


def _run_role(role, index, options, parent_pid=None):
    """Entry point of a child process."""
    # Children start with default signal dispositions; the parent's handlers would
    # otherwise run here and forward signals to nobody. Until the worker installs its
    # own, a SIGTERM (the supervisor died) ends this process before it claims anything.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked across the fork
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    import django

    if not django.apps.apps.ready:  # spawn start method
        django.setup()
    from ..conf import bound_database_connections
    from .process import worker_id

    # Before the first connection: a database that vanishes is noticed in bounded time.
    bound_database_connections()
    worker = ROLES[role](name=worker_id(role, index), **options)
    worker.share_connections()
    worker.install_signal_handlers()
    if options.get("until_stopped") and parent_pid is not None:
        worker.on_idle = functools.partial(_tell_idle, parent_pid)
    # Ctrl-C reaches the whole process group, and the supervisor forwards it as SIGTERM:
    # a child that also handled the SIGINT would take that for a second signal and quit
    # mid-step. The supervisor alone answers SIGINT (twice: it kills the children).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from .presence import of_loop

    # The workers page: this process's row, rewritten on a heartbeat, deleted on a clean exit.
    presence = of_loop(role, worker, parent_pid)
    presence.start()
    try:
        worker.run()
    finally:
        presence.stop()


def _tell_idle(parent_pid):
    """A burst's loop ran out of work: its supervisor asks the database now, not later."""
    if os.getppid() == parent_pid:  # never a signal to whoever adopted an orphan
        os.kill(parent_pid, IDLE_SIGNAL)


# Imported in the child, not here: the supervisor itself runs no steps and sends nothing.
def _worker(**options):
    from .worker import Worker

    return Worker(**options)


def _dispatcher(**options):
    from .dispatch.loop import Dispatcher

    return Dispatcher(**options)


# role -> factory(name=..., **options) of an object with run()/stop()/install_signal_handlers().
ROLES = {"worker": _worker, "dispatcher": _dispatcher}


class _EarlySignals:
    """SIGTERM and SIGINT received before the supervisor's handlers were installed."""

    def __init__(self):
        self.received = []

    def remember(self, signum, frame):
        self.received.append(signum)
        if len(self.received) > 1:
            # Twice before the supervisor ran (a start-up stuck on the database, say):
            # die of it, as without this handler.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def take(self):
        received, self.received = self.received, []
        return received


_early_signals = _EarlySignals()


def catch_early_signals():
    """Hold a SIGTERM or Ctrl-C that comes before ``Supervisor.run()``: it then drains.

    Called by runworkers as the first thing it does: a service manager that stops the
    process during its start-up (imports, system checks) gets a drain of nothing and
    exit status 0, not a death by the signal.
    """
    signal.signal(signal.SIGTERM, _early_signals.remember)
    signal.signal(signal.SIGINT, _early_signals.remember)


class Supervisor:
    """Starts and watches child processes; drains them on SIGTERM/SIGINT."""

    def __init__(self, *, processes=None, burst=False, workflows=None, queues=None,
                 lease_seconds=None, roles=None, grace=None, dispatchers=1, workers=True,
                 threads=None, db_connections=None):
        self.processes = processes or durable_settings.PROCESSES or os.cpu_count() or 1
        self.threads = threads or durable_settings.THREADS
        self.connections = db_connections or durable_settings.CONNECTIONS
        self.burst = burst
        self.grace = durable_settings.SHUTDOWN_GRACE if grace is None else grace
        # Idle workers take turns listening for new jobs (see process.Waiter): one
        # wake-up per job instead of every idle process racing for it.
        self.listen_turns = None
        from ..store import database  # here: _watch_parent runs without Django, the store loads models

        if (workers and not burst and self.processes > 1 and durable_settings.LISTEN
                and database.of(connections["default"]).notifies):
            fd, self.listen_turns = tempfile.mkstemp(prefix="durable-listen-", suffix=".lock")
            os.close(fd)
        # A burst's children wait for work until the supervisor ends the burst (see Burst):
        # a worker that left at its first empty claim would miss the job an action sent
        # by the dispatcher makes due again.
        worker_options = {"workflows": workflows, "queues": queues, "burst": burst,
                          "lease_seconds": lease_seconds, "until_stopped": burst}
        # [(role, count, options)]; the outbox dispatcher runs beside the workers.
        if roles is None:
            roles = [("worker", self.processes, {**worker_options, "listen_turns": self.listen_turns,
                                                 "threads": self.threads,
                                                 "connections": self.connections})
                     ] if workers else []
            self._check_connection_budget(self.processes if workers else 0, dispatchers)
            if dispatchers:
                roles.append(("dispatcher", dispatchers, worker_options))
        self.roles = roles
        self.queues, self.workflows = queues or [], workflows or []
        self.run_burst = Burst(workflows, queues, jobs=any(r[0] == "worker" for r in roles),
                               actions=any(r[0] == "dispatcher" for r in roles)) if burst else None
        self.children = {}  # slot -> Process
        self._stopping = False
        self._signals = 0
        self._kill_at = None
        self._ctx = _mp_context()
        self._restarts = {}
        self.presence = None  # this process's row on the workers page, while it runs

    def _check_connection_budget(self, processes, dispatchers):
        """Warn when this deployment could hold more PostgreSQL connections than the server allows."""
        from .connections import connection_budget

        try:
            problem = connection_budget(processes, self.threads, self.connections, dispatchers)
        except Exception:  # noqa: BLE001 - a warning only; the workers report a real outage
            return
        finally:
            connections.close_all()
        if problem is not None:
            logger.warning("%s %s", problem.msg, problem.hint)

    def stop(self):
        """Ask every child to drain; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._signal_all(signal.SIGTERM)

    def _on_signal(self, signum, frame):
        self._signals += 1
        if self._signals == 1:
            output.info("Received %s: draining %d process%s (the steps in flight finish;"
                        " CONTROL-C again stops now)", signal.strsignal(signum),
                        len(self.children), "" if len(self.children) == 1 else "es")
            self.stop()
        elif self._signals == 2:
            # Each child gets its second signal: it exits now. With --threads 1 a task
            # running then is recorded failed (SystemExit), as Django's task worker does;
            # a threaded process and a workflow step leave their jobs to the lease.
            output.warning("Received %s again: stopping now (what still runs is killed in %ss)",
                           signal.strsignal(signum), FORCE_SECONDS)
            self._signal_all(signal.SIGTERM)
            self._kill_at = time.monotonic() + FORCE_SECONDS
        else:
            logger.warning("supervisor received %s a third time: killing children",
                           signal.strsignal(signum))
            self._kill_all()

    def _kill_all(self):
        self._signal_all(signal.SIGKILL)

    def _announce(self):
        """Say what starts, against which database, and how to stop it (as runserver does)."""
        if not self.children:
            output.info("Stopped before starting any process.")
            return
        counts = collections.Counter()
        for role, count, _ in self.roles:
            counts[role] += count
        parts = []
        if counts["worker"]:
            parts.append(f"{_plural(counts['worker'], 'worker process')} × "
                         f"{_plural(self.threads, 'thread')}")
        parts.append(_plural(counts["dispatcher"], "outbox dispatcher") if counts["dispatcher"]
                     else "no outbox dispatcher")
        db = connections["default"]
        name = db.settings_dict.get("NAME") or ""
        host = db.settings_dict.get("HOST")
        where = f"{db.vendor} {name}" + (f" on {host}" if host else "")
        scope = ", ".join(
            f"{label}: {', '.join(values) if values else 'all'}"
            for label, values in (("queues", self.queues), ("workflows", self.workflows)))
        output.info("Starting durable workers: %s; database %s; %s%s.", ", ".join(parts), where,
                    scope, "; burst" if self.burst else "")
        if self.burst:
            output.info("Runs until nothing is runnable, then exits with a summary. "
                        "Stop sooner with CONTROL-C.")
        else:
            output.info("Quit with CONTROL-C.")

    def _signal_all(self, signum):
        for proc in list(self.children.values()):
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def _spawn(self, slot):
        role, index, options = slot
        connections.close_all()
        proc = self._ctx.Process(target=_run_role, args=(role, index, options, os.getpid()),
                                 name=f"durable-{role}{index}")
        # Blocked across the fork: until _run_role resets them, a child's handlers are the
        # supervisor's, and a SIGTERM they took (a burst that ends at once stops a child
        # just forked) would be lost. Blocked, it waits for the reset, then ends the child.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        self.children[slot] = proc
        if self.run_burst is not None:
            self.run_burst.own(proc.pid)
        logger.info("started %s%d pid=%d", role, index, proc.pid)

    def activity(self):
        """Its children now, for the workers page (read from memory)."""
        return [{"slot": f"{role}{index}", "pid": proc.pid}
                for (role, index, _), proc in list(self.children.items())]

    def run(self):
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # A signal that came before these handlers (see catch_early_signals) counts now.
        for signum in _early_signals.take():
            self._on_signal(signum, None)
        if self.run_burst is not None:
            # Before any child exists: the signal's default action would end this process.
            signal.signal(IDLE_SIGNAL, lambda signum, frame: self.run_burst.poke())
            self.run_burst.begin()
        from .presence import Presence
        from .process import worker_id

        # Written from this loop, never from a thread: the kernel sends the children their
        # parent-death signal once per thread of this process that ends, so a SIGKILL here
        # would tell each child twice (its second signal: exit now, mid-step).
        self.presence = Presence("supervisor", name=worker_id("supervisor"), reconnect=True,
                                 info={"processes": self.processes, "threads": self.threads,
                                       "burst": self.burst},
                                 activity=self.activity, draining=lambda: self._stopping)
        self.presence.tick()
        for role, count, options in self.roles:
            for index in range(count):
                if not self._stopping:
                    self._spawn((role, index, _freeze(options)))
        self._announce()
        self._watch_children()
        self.presence.stop()
        logger.info("supervisor exiting")
        if self.run_burst is not None and self.run_burst.began is not None:
            try:
                self.run_burst.report()
            except DatabaseError as exc:
                output.warning("Burst over; its summary could not be read: %s", exc)
            finally:
                connections.close_all()
        output.info("Stopped.")
        if self.listen_turns:
            with contextlib.suppress(OSError):
                os.unlink(self.listen_turns)
        return 0

    def _watch_children(self):
        """Until no child is left: beat, end a finished burst, kill past the deadlines, replace the dead."""
        deadline = None
        while self.children:
            time.sleep(0.1)
            self.presence.tick()
            if self.run_burst is not None and not self._stopping and self.run_burst.over():
                self.stop()
            if self._stopping and deadline is None:
                deadline = time.monotonic() + self.grace
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("grace period over: killing remaining children")
                self._kill_all()
                deadline = float("inf")
            if self._kill_at is not None and time.monotonic() > self._kill_at:
                logger.warning("children still running %ss after the second signal: killing them", FORCE_SECONDS)
                self._kill_all()
                self._kill_at = float("inf")
            for slot, proc in list(self.children.items()):
                if proc.is_alive():
                    continue
                proc.join()
                del self.children[slot]
                code = proc.exitcode
                if self._stopping or (self.burst and code == 0):
                    continue
                self._restart(slot, code)

    def _restart(self, slot, code):
        from .heartbeat import EXIT_LEASE_UNRENEWABLE, EXIT_STEP_TIMEOUT, EXIT_THREADS_ABANDONED

        role, index, _ = slot
        why = {EXIT_STEP_TIMEOUT: "after a step timeout",
               EXIT_LEASE_UNRENEWABLE: "after its lease could not be renewed",
               EXIT_THREADS_ABANDONED: "recycled: too many threads abandoned past their step"
                                       " timeouts"}.get(code, f"exit code {code}")
        # Back off a child that keeps crashing so a broken deploy does not spin.
        last, count = self._restarts.get(slot, (0.0, 0))
        count = count + 1 if time.monotonic() - last < 10 else 0
        self._restarts[slot] = (time.monotonic(), count)
        if count > 2:
            time.sleep(min(5.0, 0.5 * count))
        logger.warning("%s%d died (%s); starting a replacement", role, index, why)
        self._spawn(slot)


class Burst:
    """When a ``--burst`` run is over, and what it did, read from the database.

    It is over when nothing in its scope is runnable now or within WAIT_SECONDS (a
    retry's backoff, a short timer) and nothing is in its own processes' hands: no job
    they lease, no action due or being sent. An action sent makes its job due again, so
    the burst goes on until that job has run too. What waits longer, for a person or a
    signal does not keep it running: the summary says what is left waiting, and why.
    """

    # It is asked when a child's loop runs out of work (IDLE_SIGNAL), at most once every
    # CHECK_SECONDS, and otherwise every CHECK_MAX_SECONDS: each question is a statement,
    # and a long drain need not pay five a second for them.
    CHECK_SECONDS = 0.2
    CHECK_MAX_SECONDS = 2.0
    # What falls due this soon is waited for: a retry's backoff, a short timer.
    WAIT_SECONDS = 10

    def __init__(self, workflows, queues, *, jobs, actions):
        self.workflows, self.queues = list(workflows or []), list(queues or [])
        self.jobs, self.actions = jobs, actions
        self.owners = []  # "host:pid:", the start of every lease owner name of this burst
        self.began = self.since = None
        self.first_event = 0
        self._checked = 0.0
        self._pokes = 0  # the first question comes when a child first finds nothing to do
        self._answered = 0  # the pokes the last question answered

    def begin(self):
        from django.db.models import Max

        from ..models import JobEvent
        from ..store.locking import db_now

        self.began = time.monotonic()
        self.since = db_now()
        self.first_event = JobEvent.objects.aggregate(last=Max("id"))["last"] or 0

    def poke(self):
        """A child ran out of work: ask soon (CHECK_SECONDS after the last question).

        A signal handler: it only counts, so a poke during a question is not lost.
        """
        self._pokes += 1

    def own(self, pid):
        self.owners.append(f"{socket.gethostname()}:{pid}:")

    def _scoped(self, q):
        from django.db.models import Q

        if self.workflows:
            q &= Q(workflow__in=self.workflows)
        if self.queues:
            q &= Q(queue__in=self.queues)
        return q

    def over(self):
        """Whether the burst is done (see CHECK_SECONDS; a database error: not yet)."""
        poked = self._pokes != self._answered
        interval = self.CHECK_SECONDS if poked else self.CHECK_MAX_SECONDS
        if time.monotonic() - self._checked < interval or not self.owners:
            return False
        self._checked = time.monotonic()
        self._answered = self._pokes  # before the question: a poke during it asks again
        from django.db.models import Q
        from django.db.models.functions import Now

        from ..models import Job, Outbox, Pause
        from ..store.locking import now_plus

        ours = functools.reduce(operator.or_, (Q(lease_owner__startswith=o) for o in self.owners))
        # Each part is served by the claim's own index; a lease sets the due time to its end.
        in_hand = ours & Q(lease_until__gte=Now())
        try:
            soon = now_plus(self.WAIT_SECONDS)  # the database's clock, in the same statement
            parts = []
            if self.jobs:
                # Due now, or released and due soon (a retry's backoff, a short timer).
                due = Q(next_run_at__lte=soon) & (Q(lease_owner__isnull=True)
                                                  | Q(next_run_at__lte=Now()))
                parts += [Job.objects.filter(self._scoped(due))
                          .exclude(workflow__in=Pause.objects.values("workflow")).values_list("pk"),
                          Job.objects.filter(in_hand, next_run_at__gte=Now()).values_list("pk")]
            if self.actions:
                due = Q(next_attempt_at__lte=soon) & (Q(lease_owner__isnull=True)
                                                      | Q(next_attempt_at__lte=Now()))
                parts += [Outbox.objects.filter(due).values_list("job_id"),
                          Outbox.objects.filter(in_hand, next_attempt_at__gte=Now())
                          .values_list("job_id")]
            parts = [part.order_by() for part in parts]
            # One statement, so one snapshot: a job cannot slip between two looks (a claim
            # and its release both happening between them).
            done = not list(parts[0].union(*parts[1:], all=True)[:1])
            return done
        except DatabaseError as exc:
            logger.warning("could not tell whether the burst is over (will ask again): %s", exc)
            return False
        finally:
            connections.close_all()  # none may stay open across the fork of a replacement

    def report(self):
        """Log what the burst did and what it left waiting."""
        from django.db.models import Count, Min, Q

        from ..core.states import StateKind
        from ..core.workflows import registry
        from ..models import Job, JobEvent, Outbox
        from ..store.locking import db_now

        seconds = time.monotonic() - self.began
        now = db_now()
        ours = functools.reduce(operator.or_, (Q(actor__startswith=o) for o in self.owners),
                                Q(pk__in=[]))
        touched = JobEvent.objects.filter(ours, id__gt=self.first_event).values("job_id")
        done = collections.Counter()
        for workflow, state, count in (Job.objects.filter(pk__in=touched).order_by()
                                       .values("workflow", "state").annotate(n=Count("pk"))
                                       .values_list("workflow", "state", "n")):
            done[_OUTCOMES.get(registry.kind_of(workflow, state), "waiting")] += count
        sent = Outbox.objects.filter(sent_at__gte=self.since).count() if self.actions else 0
        output.info("Burst done in %.1fs: %s finished, %d failed, %d parked for a person, %d"
                    " waiting; %s sent.", seconds, _plural(done["finished"], "job"),
                    done["failed"], done["parked"], done["waiting"], _plural(sent, "action"))
        left = collections.defaultdict(lambda: [0, None])
        for workflow, state, count, due in (Job.objects.filter(self._scoped(Q())).order_by()
                                            .values("workflow", "state")
                                            .annotate(n=Count("pk"), due=Min("next_run_at"))
                                            .values_list("workflow", "state", "n", "due")):
            kind = registry.kind_of(workflow, state)
            if kind == StateKind.TERMINAL:
                continue
            why = _WAITING.get(kind, "due later (a timer, a retry, a lease held elsewhere)")
            if kind not in _WAITING and due is not None and due <= now:
                why = ("runnable, for job workers (none ran in this burst)" if not self.jobs
                       else "runnable but in a paused workflow")
            if kind == StateKind.IN_FLIGHT and not self.actions:
                why = "with an action for a dispatcher to send (none ran in this burst)"
            if kind is None:
                why = "of a workflow or state this code does not know"
            entry = left[why]
            entry[0] += count
            if due is not None and (entry[1] is None or due < entry[1]):
                entry[1] = due
        if not left:
            output.info("Nothing left waiting.")
        for why, (count, due) in sorted(left.items()):
            output.info("Left waiting: %s %s%s.", _plural(count, "job"), why,
                        f" (the next due at {due:%Y-%m-%d %H:%M:%S %Z})" if due else "")


# What a job touched by a burst is now, by the kind of its state.
_OUTCOMES = {"terminal": "finished", "failed": "failed", "approval": "parked", "human": "parked",
             "unknown": "parked"}
# Why a job is left when a burst ends, by the kind of its state.
_WAITING = {
    "approval": "awaiting approval (the console's approvals page)",
    "human": "needing a person (send it back from the console)",
    "unknown": "with an action result to reconcile (the console's reconciliation page)",
    "failed": "failed (requeue to run again)",
    "signal": "waiting for a signal",
    "join": "waiting for their children",
    "in_flight": "with an action not sent yet (a retry later)",
}


def _plural(count, noun):
    return f"{count} {noun}{'' if count == 1 else ('es' if noun.endswith('s') else 's')}"


class _Frozen(dict):
    def __hash__(self):
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))


def _freeze(options):
    return _Frozen(options)
