"""Several hosts on one machine: network namespaces around a PostgreSQL cluster of their own.

Every name carries a tag unique to the run, so parallel runs never collide, and every
address lives inside the lab's namespaces only (nothing is routed off the machine)::

    db  namespace: bridge 10.201.0.1/24, the lab's PostgreSQL listens there
    svc namespace: bridge 10.202.0.1/24, the receiver listens there
    h1, h2, h3:    one veth to each bridge (10.201.0.1N and 10.202.0.1N)

A cut sets the bridge end of a host's veth down: the host's packets vanish, its TCP
connections stay half-open on both sides and nothing resets them, as on a real network
partition (a SIGKILL, by contrast, closes sockets at once). ``cut(host, "db")`` cuts
one link, ``cut(host)`` both; ``heal(host)`` brings them back.

The test process itself stays in the machine's own namespace and reaches the cluster
through its Unix socket, a file in the lab's directory. Needs root, ``ip`` (iproute2)
and the PostgreSQL server binaries (found with ``pg_config --bindir``).
"""

import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

DB_NET = "10.201.0"
SVC_NET = "10.202.0"
PG_PORT = 5432
RECEIVER_PORT = 8080


def postgres_bindir():
    """Directory of the PostgreSQL server binaries, or None."""
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        path = Path(out.stdout.strip())
        if (path / "initdb").exists() and (path / "postgres").exists():
            return path
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(candidate, "initdb").exists():
            return Path(candidate)
    for name in ("initdb", "postgres"):
        if not shutil.which(name):
            return None
    return Path(shutil.which("initdb")).parent


def unavailable():
    """Why the lab cannot run here (a sentence), or None."""
    if os.geteuid() != 0:
        return "the multi-host lab needs root (network namespaces)"
    if not shutil.which("ip"):
        return "the multi-host lab needs ip (iproute2)"
    if postgres_bindir() is None:
        return "the multi-host lab needs the PostgreSQL server binaries (initdb, postgres)"
    probe = f"durable-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args, check=True):
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


class NetLab:
    """The namespaces, links and PostgreSQL cluster of one multi-host drill."""

    def __init__(self, workdir=None, hosts=3, server_settings=None):
        self.tag = secrets.token_hex(3)  # six hex digits: interface names stay short
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="durable-netlab-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts = [f"h{i + 1}" for i in range(hosts)]
        self.server_settings = dict(server_settings or {})
        self.namespaces = []
        self.pg_root = self.pgdata = self.socket_dir = None
        self._postgres = None
        self.cuts = []  # (monotonic time, host, links) of every cut, for the report

    # Names and addresses --------------------------------------------------------------

    def ns(self, name):
        return f"durable-{self.tag}-{name}"

    def _veth(self, host, link, side):
        # 15 characters at most: "d" + tag + host number + link letter + side.
        return f"d{self.tag}{host[1:]}{link[0]}{side}"

    def address(self, host, link="db"):
        net = DB_NET if link == "db" else SVC_NET
        return f"{net}.{10 + int(host[1:])}"

    @property
    def db_address(self):
        return f"{DB_NET}.1"

    @property
    def receiver_address(self):
        return f"{SVC_NET}.1"

    def exec_prefix(self, name):
        """Command prefix that runs a program inside namespace ``name`` (a host, db, svc)."""
        return ["ip", "netns", "exec", self.ns(name)]

    def database_url(self, dbname="postgres"):
        """How processes inside the hosts reach the cluster (TCP over the db bridge)."""
        return f"postgres://postgres@{self.db_address}:{PG_PORT}/{dbname}"

    def local_database_url(self, dbname="postgres"):
        """How the test process reaches the cluster (its Unix socket)."""
        return f"postgres://postgres@:{PG_PORT}/{dbname}?host={self.socket_dir}"

    # Building and tearing down ---------------------------------------------------------

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info):
        self.close()

    def start(self):
        self._network()
        self._start_postgres()
        return self

    def _namespace(self, name):
        _ip("netns", "add", self.ns(name))
        self.namespaces.append(self.ns(name))
        _ip("-n", self.ns(name), "link", "set", "lo", "up")

    def _network(self):
        for name in ("db", "svc", *self.hosts):
            self._namespace(name)
        for number, (hub, net) in enumerate((("db", DB_NET), ("svc", SVC_NET)), start=1):
            bridge = f"br{hub}"
            bridge_mac = f"02:00:00:{number:02x}:00:01"
            _ip("-n", self.ns(hub), "link", "add", bridge, "address", bridge_mac, "type", "bridge")
            _ip("-n", self.ns(hub), "addr", "add", f"{net}.1/24", "dev", bridge)
            _ip("-n", self.ns(hub), "link", "set", bridge, "up")
            for host in self.hosts:
                inner, outer = self._veth(host, hub, "h"), self._veth(host, hub, "b")
                host_mac = f"02:00:00:{number:02x}:{int(host[1:]):02x}:02"
                _ip("link", "add", inner, "netns", self.ns(host), "address", host_mac, "type",
                    "veth", "peer", "name", outer, "netns", self.ns(hub))
                _ip("-n", self.ns(host), "addr", "add", f"{self.address(host, hub)}/24", "dev", inner)
                _ip("-n", self.ns(host), "link", "set", inner, "up")
                _ip("-n", self.ns(hub), "link", "set", outer, "master", bridge)
                _ip("-n", self.ns(hub), "link", "set", outer, "up")
                # Fixed neighbours on both sides: during a cut no ARP fails and reports
                # "no route to host" at once; packets just vanish, and the ones TCP
                # retransmits arrive after the heal, as across a real partition.
                _ip("-n", self.ns(host), "neigh", "replace", f"{net}.1", "lladdr", bridge_mac,
                    "dev", inner, "nud", "permanent")
                _ip("-n", self.ns(hub), "neigh", "replace", self.address(host, hub), "lladdr",
                    host_mac, "dev", bridge, "nud", "permanent")

    def _start_postgres(self):
        bindir = postgres_bindir()
        # A directory of its own in the system's temporary directory: the postgres user
        # must be able to reach it, whatever the permissions of the lab's work directory.
        self.pg_root = Path(tempfile.mkdtemp(prefix=f"durable-pg-{self.tag}-"))
        os.chmod(self.pg_root, 0o755)
        self.pgdata = self.pg_root / "data"
        self.socket_dir = self.pg_root / "socket"
        for path in (self.pgdata, self.socket_dir):
            path.mkdir(mode=0o700)
            shutil.chown(path, "postgres", "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
        made = subprocess.run([*as_postgres, str(bindir / "initdb"), "-D", str(self.pgdata), "-U",
                               "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"],
                              capture_output=True, text=True)
        if made.returncode:
            raise RuntimeError(f"initdb failed: {made.stderr.strip() or made.stdout.strip()}")
        # The hosts connect over the bridge; nothing outside the lab's namespaces can.
        with open(self.pgdata / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {DB_NET}.0/24 trust\n")
        settings = {
            "listen_addresses": self.db_address, "port": str(PG_PORT),
            "unix_socket_directories": str(self.socket_dir), "max_connections": "300",
            "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
            "shared_buffers": "64MB",
        }
        settings.update({k: str(v) for k, v in self.server_settings.items()})
        args = [item for key, value in settings.items() for item in ("-c", f"{key}={value}")]
        log = open(self.workdir / "postgres.log", "wb")  # noqa: SIM115 - closed with the process
        self._postgres = subprocess.Popen(
            [*self.exec_prefix("db"), *as_postgres, str(bindir / "postgres"), "-D",
             str(self.pgdata), *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._postgres_log = log
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready = subprocess.run([str(bindir / "pg_isready"), "-q", "-h", str(self.socket_dir),
                                    "-p", str(PG_PORT)])
            if ready.returncode == 0:
                return
            if self._postgres.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError("the lab's PostgreSQL did not start:\n"
                           + (self.workdir / "postgres.log").read_text(errors="replace")[-2000:])

    def close(self):
        """Stop the cluster and delete every namespace (their links go with them)."""
        if self._postgres is not None:
            if self._postgres.poll() is None:
                # SIGINT: PostgreSQL's fast shutdown (roll back, disconnect, stop).
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._postgres.pid, signal.SIGINT)
                try:
                    self._postgres.wait(30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._postgres.pid, signal.SIGKILL)
                    self._postgres.wait(10)
            self._postgres_log.close()
            self._postgres = None
        for name in reversed(self.namespaces):
            self._kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
        self.namespaces = []
        if self.pg_root is not None:
            shutil.rmtree(self.pg_root, ignore_errors=True)
            self.pg_root = self.pgdata = None

    def _kill_namespace_processes(self, name):
        # Whatever still runs inside (a process a failed test left behind) is this lab's.
        pids = _ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    # Partitions ---------------------------------------------------------------------------

    def _links(self, links):
        return ("db", "svc") if links is None else (links,)

    def cut(self, host, links=None):
        """Silently drop every packet of ``host`` on ``links`` ("db", "svc"; None: both)."""
        for link in self._links(links):
            _ip("-n", self.ns(link), "link", "set", self._veth(host, link, "b"), "down")
        self.cuts.append((time.monotonic(), host, self._links(links)))

    def heal(self, host, links=None):
        for link in self._links(links):
            _ip("-n", self.ns(link), "link", "set", self._veth(host, link, "b"), "up")

    def reachable(self, host, address, port):
        """Whether a TCP connection from ``host`` to ``address:port`` opens within a second."""
        probe = ("import socket,sys\n"
                 "s=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)\n"
                 "s.close()")
        result = subprocess.run([*self.exec_prefix(host), "python3", "-c", probe, address, str(port)],
                                capture_output=True)
        return result.returncode == 0


def run_drill_child(module, workdir, name, args=(), timeout=900):
    """Run ``python -m module`` (a drill that needs a Django of its own) and return its JSON result.

    The child writes ``<name>.json`` and logs to ``<name>.log`` in ``workdir``; a child
    that writes no result raises with the tail of its log. A timeout, Ctrl-C or the test
    runner's own timeout lets the child clean up its namespaces first.
    """
    import json
    import sys

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{name}.json"
    with open(workdir / f"{name}.log", "wb") as log:
        child = subprocess.Popen([sys.executable, "-m", module, "--workdir", str(workdir), "--json", str(out),
                                  *args], cwd=Path(__file__).resolve().parent.parent.parent,
                                 stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = child.wait(timeout)
        except BaseException:
            child.terminate()
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise
    text = out.read_text() if out.exists() else ""
    if not text:
        tail = (workdir / f"{name}.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the {name} drill exited with {returncode}:\n{tail}")
    return json.loads(text)
