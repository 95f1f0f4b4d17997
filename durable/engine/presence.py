"""Each runworkers process says it is alive, and what its slots do, on the workers page.

A ``Presence`` is one per process: a thread in a worker or dispatcher, the main loop's
``tick()`` in the supervisor. Every ``DURABLE["WORKER_HEARTBEAT_SECONDS"]`` it rewrites
the process's one ``WorkerProcess`` row: one UPDATE carrying the heartbeat (the
database clock) and what each slot does now, read from memory (``activity()``), so the
hot path never writes for it. A drain is written as soon as it begins, and a clean exit
deletes the row. A process that died without a word leaves its row behind: the page
shows it stale after three missed heartbeats, and any live process deletes it after
``WORKER_FORGET_SECONDS``.
"""

import contextlib
import logging
import os
import secrets
import socket
import threading
import time

from django.db import connection
from django.db.models.functions import Now

from ..conf import durable_settings
from ..models import WorkerProcess
from ..store import locking

logger = logging.getLogger("durable.worker")

# Heartbeats between two deletions of forgotten rows.
FORGET_EVERY = 12


class Presence(threading.Thread):
    """Publishes this process's row on a heartbeat, until ``stop()`` deletes it.

    ``start()`` runs the heartbeat on a thread of its own; a process that must not start
    threads (the supervisor: see ``durable.engine.supervisor``) calls ``tick()`` from its loop.
    """

    def __init__(self, role, *, name="", parent="", info=None, activity=None, draining=None,
                 reconnect=False):
        super().__init__(name="durable-presence", daemon=True)
        self.host = socket.gethostname()
        # The pid alone is reused by an operating system (and by every container's restart).
        self.id = f"{self.host}:{os.getpid()}:{role}:{secrets.token_hex(4)}"
        self.role = role
        self.process_name = name
        self.parent = parent
        self.beat = float(durable_settings.WORKER_HEARTBEAT_SECONDS)
        self.forget = float(durable_settings.WORKER_FORGET_SECONDS)
        self.info = {**(info or {}), "beat": self.beat}
        self.activity = activity or list
        self.draining = draining or (lambda: False)
        # A supervisor forks: it holds no connection between heartbeats.
        self.reconnect = reconnect
        self._stop_event = threading.Event()
        self._due = 0.0
        self._drain_written = False
        self._beats = 0
        self._failing = False

    def stop(self, timeout=5.0):
        """Stop publishing and delete the row (a clean exit). Idempotent."""
        self._stop_event.set()
        if self.ident is not None:
            self.join(timeout)
        else:
            self._forget()

    def run(self):
        try:
            while not self._stop_event.is_set():
                self.tick()
                self._stop_event.wait(min(0.2, self.beat))
            self._forget()
        finally:
            connection.close()

    def tick(self):
        """Write the row if a heartbeat is due or a drain began (cheap when neither)."""
        draining = bool(self.draining())
        if time.monotonic() >= self._due or (draining and not self._drain_written):
            self._publish(draining)
            self._due = time.monotonic() + self.beat

    def _forget(self):
        with contextlib.suppress(Exception):
            WorkerProcess.objects.filter(pk=self.id).delete()
        if self.reconnect:
            connection.close()

    def _publish(self, draining):
        try:
            self._write(draining)
            if self._beats % FORGET_EVERY == 0:
                WorkerProcess.objects.filter(
                    heartbeat_at__lt=locking.now_plus(-self.forget)).delete()
            self._beats += 1
            self._drain_written = self._drain_written or draining
            if self._failing:
                logger.info("%s: workers page heartbeat written again", self.process_name)
            self._failing = False
        except Exception as exc:  # noqa: BLE001 - the page is told nothing; work goes on
            if not self._failing:
                logger.warning("%s: workers page heartbeat not written: %s",
                               self.process_name, exc)
            self._failing = True
            connection.close()
        finally:
            if self.reconnect:
                connection.close()

    def _write(self, draining):
        fields = {"heartbeat_at": Now(), "slots": self.activity()}
        rows = WorkerProcess.objects.filter(pk=self.id)
        if draining and not self._drain_written:
            fields["draining_since"] = Now()
        if not rows.update(**fields):
            # The first heartbeat, or the row was deleted as forgotten while this process
            # could not reach the database: it is written again.
            WorkerProcess.objects.create(
                id=self.id, role=self.role, host=self.host, pid=os.getpid(), parent=self.parent,
                name=self.process_name[:200], info=self.info, **fields)


def supervisor_of(pid):
    """What a child's row names its supervisor by: ``host:pid``."""
    return f"{socket.gethostname()}:{pid}"


def of_loop(role, loop, parent_pid=None):
    """The presence of a worker's or dispatcher's loop (``activity()``, ``stopping``, ``name``)."""
    info = {key: getattr(loop, key, None) for key in ("threads", "workflows", "queues", "burst")}
    # A loop whose threads share few connections: this thread holds none between beats.
    return Presence(role, name=loop.name, parent=supervisor_of(parent_pid) if parent_pid else "",
                    info=info, activity=loop.activity, draining=lambda: loop.stopping,
                    reconnect=loop.sharing)


__all__ = ["Presence", "of_loop", "supervisor_of"]
