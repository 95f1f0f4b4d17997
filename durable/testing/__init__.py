"""A stand-in remote system for tests, demos and crash drills.

The outbox guarantees (an action is sent with a stable idempotency key; a lost
reply is *unknown*, not a failure; unknown is reconciled before any new write)
can only be checked against a server that really applies actions and can really
lose replies. :class:`Receiver` is that server: a small threaded HTTP API on
127.0.0.1, shaped like a CRM or ticket system, that records every business action
it applies. Tests count those records; that count is the ground truth, whatever
the client believes happened.

API::

    POST /actions                   apply the JSON body; header Idempotency-Key
                                    201 {"id": "T-000001", "status": "created"}
                                    200 {"id": ..., "status": "duplicate"} on a replayed key
    GET  /actions/lookup?key=KEY    200 {"found": true, ...record} or 404 {"found": false}

    POST /_control                  {"mode", "times", "retry_after", "delay"}: see behave()
    GET  /_actions                  {"actions": [...], "requests": N}

Run it as its own process (the demo and the crash drills do, so that killing a
worker never kills the "remote system")::

    python -m durable.testing --port 0 --store actions.jsonl

The first line on stdout is its URL. Standard library only: it must run wherever
the tests run, and must not share a connection pool or a bug with the client. The
server itself is ``durable.testing.receiver``; this module adds the receiver in a process of
its own and the fake model server and scripted models for agents.
"""

import argparse
import json
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from .blackhole import Blackhole
from .fake_openai import FakeModelServer, ProviderLimits, reply, tool_call
from .models import ScriptedModel
from .receiver import MODES, Receiver, read_store

__all__ = ["MODES", "Blackhole", "FakeModelServer", "ProviderLimits", "Receiver", "ReceiverProcess", "ScriptedModel",
           "read_store", "reply", "tool_call"]


class ReceiverProcess:
    """A :class:`Receiver` in its own process, with the same methods for a test to use.

    Crash drills kill workers, not the remote system; a receiver in its own
    process survives them and keeps its store for the test to count.
    """

    def __init__(
        self, store_path, *, idempotent=True, lookup=True, loss_rate=0.0, seed=0, python=None,
        host="127.0.0.1", port=0, prefix=(),
    ):
        self.store_path = Path(store_path)
        # ``prefix`` runs the process under another command (a drill's network namespace).
        self._args = [*prefix, python or sys.executable, "-m", "durable.testing", "--host", host,
                      "--port", str(port)]
        self._args += ["--store", str(self.store_path), "--loss-rate", str(loss_rate)]
        self._args += ["--seed", str(seed)]
        if not idempotent:
            self._args.append("--no-idempotency")
        if not lookup:
            self._args.append("--no-lookup")
        self._process = None
        self.url = None

    def start(self, timeout=10):
        """Start the process and wait until it serves; return self."""
        self._process = subprocess.Popen(self._args, stdout=subprocess.PIPE, text=True)
        # The child prints its URL only once it is listening, so this line is
        # also the readiness signal.
        reader = threading.Thread(target=self._read_url, daemon=True)
        reader.start()
        reader.join(timeout)
        if not self.url:
            self.stop()
            raise RuntimeError(f"receiver process did not start: {self._args}")
        return self

    def _read_url(self):
        self.url = self._process.stdout.readline().strip() or None

    def stop(self, timeout=5):
        """Terminate the process. Safe to call more than once."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()
        self._process = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    @property
    def pid(self):
        return self._process.pid

    @property
    def actions(self):
        """Every action applied, read from the store file (works after stop, too)."""
        return read_store(self.store_path)

    @property
    def requests(self):
        return self._call("GET", "/_actions")["requests"]

    def behave(self, mode, times=None, retry_after=None, delay=None):
        """Change the process's behaviour; see :meth:`Receiver.behave`."""
        body = {"mode": mode, "times": times, "retry_after": retry_after, "delay": delay}
        self._call("POST", "/_control", body)

    def _call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.load(response)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m durable.testing",
        description="Run a stand-in remote system that records each action it applies.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "The first line printed is its URL; Ctrl-C or SIGTERM stops it. Point a destination\n"
            "at it in settings (the port here is --port 8002):\n\n"
            '    DURABLE["DESTINATIONS"]["payments"] = {\n'
            '        "URL": "http://127.0.0.1:8002/actions",\n'
            '        "LOOKUP_URL": "http://127.0.0.1:8002/actions/lookup?key={key}",\n'
            '        "IDEMPOTENT": True,\n'
            '        "TIMEOUT": (3.05, 10),\n'
            "    }\n"
        ),
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--store", help="append each applied action to this JSON-lines file")
    parser.add_argument("--no-idempotency", action="store_true", help="apply replayed keys again")
    parser.add_argument("--no-lookup", action="store_true", help="offer no GET /actions/lookup")
    parser.add_argument("--loss-rate", type=float, default=0.0, help="drop this share of replies")
    parser.add_argument("--seed", type=int, default=0, help="seed of the reply-loss RNG")
    args = parser.parse_args(argv)

    receiver = Receiver(
        idempotent=not args.no_idempotency,
        lookup=not args.no_lookup,
        store_path=args.store,
        loss_rate=args.loss_rate,
        seed=args.seed,
        host=args.host,
        port=args.port,
    )
    stopping = threading.Event()
    # SIGTERM is how drills and ReceiverProcess.stop() end it; exit cleanly so the
    # store file is flushed and closed.
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    with receiver:
        print(receiver.url, flush=True)
        stopping.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
