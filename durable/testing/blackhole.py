"""A destination that accepts connections and never answers, for tests and the benchmark.

It is what a remote system looks like when it hangs: the TCP handshake completes, the
request is sent, and no byte of a reply ever comes, so the client waits out its read
timeout. Tests point a destination at ``Blackhole().url`` to show that one such
destination holds only its share of the dispatcher's slots (see ``durable.engine.dispatch.slots``).
"""

import socket
import threading


class Blackhole:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers."""

    def __init__(self, host="127.0.0.1"):
        self._sock = socket.create_server((host, 0), backlog=512)
        host, port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._held = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name=f"blackhole-{port}", daemon=True)
        self._thread.start()

    @property
    def accepted(self):
        """Connections accepted and held open so far."""
        with self._lock:
            return len(self._held)

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._held.append(conn)  # read nothing, answer nothing: the client times out

    def close(self):
        """Stop accepting and cut every held connection (the clients see the reply lost)."""
        self._sock.close()
        with self._lock:
            held, self._held = self._held, []
        for conn in held:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
