"""A PgBouncer in transaction pooling, started by a test in front of its PostgreSQL server.

``PgBouncer`` is a context manager: it writes an ini of its own into a temporary
directory (listening on a free port of 127.0.0.1, its socket, pidfile and log beside
the ini), starts Debian's ``pgbouncer`` in the foreground, and stops it on exit. The
package's own service, if one runs, is never touched. PgBouncer refuses to run as
root, so a root test run starts it as ``postgres`` (or ``nobody``), which owns the
directory. Clients log in without a password (``auth_type = trust``); PgBouncer itself
logs in to the server as the same user, with the server's password if one is given.

``installed_binary()`` skips the calling test when the binary is missing, saying how to
install it (``scripts/system.sh``), and fails it with ``CI=true``. ``in_front_of_test_database()``
starts one in front of the test database, and ``through()`` is a worker's environment
that goes through it.
"""

import contextlib
import functools
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time

BINARY = "/usr/sbin/pgbouncer"

# PgBouncer keeps protocol-level prepared statements in transaction pooling from this
# version on (max_prepared_statements); before it, a client's statement may reach a
# server connection that never saw it prepared.
PREPARED_SINCE = (1, 21)


@functools.cache
def version(binary=BINARY):
    """The installed PgBouncer's version as a tuple, e.g. (1, 18, 0)."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                          check=True)
    return tuple(int(part) for part in re.search(r"PgBouncer (\d+)\.(\d+)\.(\d+)", done.stdout).groups())


def keeps_prepared_statements(binary=BINARY):
    return version(binary) >= PREPARED_SINCE


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_as():
    """The account PgBouncer runs under when started by root (it refuses to run as root)."""
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("PgBouncer refuses to run as root and there is no postgres or nobody account")


class PgBouncer:
    """PgBouncer in transaction pooling in front of ``server_host:server_port``.

    ``databases`` maps the names clients ask for to the server's database names. Use it
    as ``with PgBouncer(...) as bouncer:``, then ``bouncer.url(name)``.
    """

    def __init__(self, server_host, server_port, databases, user="postgres", password="", *,
                 binary=BINARY, pool_size=20, max_client_conn=500):
        self.server_host = server_host or "127.0.0.1"
        self.server_port = int(server_port or 5432)
        self.databases = dict(databases)
        self.user = user
        self.password = password
        self.binary = binary
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.port = None
        self.directory = None
        self.process = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def url(self, name):
        """A client's URL of database ``name`` through this PgBouncer."""
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{name}"

    def ini(self):
        databases = "\n".join(
            f"{name} = host={self.server_host} port={self.server_port} dbname={target}"
            for name, target in self.databases.items())
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": self.directory,
            "auth_type": "trust",
            "auth_file": os.path.join(self.directory, "userlist.txt"),
            # The admin console (SHOW STATS, SHOW CONFIG) tells a test what went through.
            "admin_users": self.user,
            "pool_mode": "transaction",
            "max_client_conn": self.max_client_conn,
            "default_pool_size": self.pool_size,
            "pidfile": os.path.join(self.directory, "pgbouncer.pid"),
            # Workers that hand their connections back log in often: keep the log to what matters.
            "log_connections": 0,
            "log_disconnections": 0,
        }
        if keeps_prepared_statements(self.binary):
            settings["max_prepared_statements"] = 100
        lines = "\n".join(f"{key} = {value}" for key, value in settings.items())
        return f"[databases]\n{databases}\n\n[pgbouncer]\n{lines}\n"

    @property
    def log_path(self):
        return os.path.join(self.directory, "pgbouncer.log")

    def log(self, last=40):
        """The last lines PgBouncer logged (it logs to stderr in the foreground)."""
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(log.readlines()[-last:])
        except FileNotFoundError:
            return ""

    def start(self, timeout=10):
        self.directory = tempfile.mkdtemp(prefix="durable-pgbouncer-")
        self.port = _free_port()
        ini = os.path.join(self.directory, "pgbouncer.ini")
        with open(ini, "w") as out:
            out.write(self.ini())
        with open(os.path.join(self.directory, "userlist.txt"), "w") as out:
            # Clients are trusted; the password is the one PgBouncer logs in to the server with.
            out.write(f'"{self.user}" "{self.password}"\n')
        command = [self.binary, ini]
        if os.geteuid() == 0:
            account = _run_as()
            for path in (self.directory, ini, os.path.join(self.directory, "userlist.txt")):
                os.chown(path, account.pw_uid, account.pw_gid)
            command[1:1] = ["-u", account.pw_name]
        # In the foreground it logs to stderr: the log is that file, opened before any drop
        # of privileges.
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                log = self.log()
                self.stop()
                raise RuntimeError(f"pgbouncer exited with status {self.process.returncode}:\n{log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not listen within {timeout} s") from None
                time.sleep(0.05)

    def stop(self):
        """Stop PgBouncer (SIGTERM: it closes every connection at once) and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def show(self, what):
        """Rows of the admin console's ``SHOW <what>`` (STATS, CONFIG, POOLS, ...) as dicts."""
        import psycopg
        from psycopg.rows import dict_row

        # The admin console speaks only the simple query protocol: no parameters.
        with psycopg.connect(self.url("pgbouncer"), autocommit=True, row_factory=dict_row) as admin:
            return admin.execute(f"SHOW {what}").fetchall()

    def setting(self, key):
        """The value PgBouncer runs with for ``key`` (its admin console's SHOW CONFIG)."""
        [value] = [row["value"] for row in self.show("CONFIG") if row["key"] == key]
        return value

    def transactions(self, name):
        """Transactions PgBouncer has passed to the server for database ``name`` so far."""
        return sum(row["total_xact_count"] for row in self.show("STATS") if row["database"] == name)


def installed_binary():
    """The pgbouncer binary, or a skip of the calling test saying how to install it (a failure with CI=true)."""
    from tests.conftest import missing_tool

    if not os.access(BINARY, os.X_OK):
        missing_tool(f"PgBouncer ({BINARY})", "pgbouncer")
    return BINARY


@contextlib.contextmanager
def in_front_of_test_database():
    """A PgBouncer in transaction pooling in front of the test database, under the same name.

    Without the pgbouncer binary the calling test is skipped saying how to install it
    (failed with CI=true). On exit it waits for PgBouncer's server sessions to end: the
    test database is dropped at the end of the session, which no connection may still use.
    """
    from django.db import connection

    from tests.conftest import wait_for

    binary = installed_binary()
    settings = connection.settings_dict
    name = settings["NAME"]
    with PgBouncer(settings["HOST"], settings["PORT"], {name: name}, settings["USER"] or "postgres",
                   settings["PASSWORD"] or "", binary=binary) as running:
        running.name = name
        assert running.setting("pool_mode") == "transaction"
        yield running
    wait_for(lambda: not sessions_from_others(), timeout=15, message="PgBouncer's sessions to end")


def sessions_from_others():
    """Server sessions on the test database other than this test's own."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                       " AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def direct_url():
    """The test database on the server itself, bypassing PgBouncer: where LISTEN goes."""
    from django.db import connection

    settings = connection.settings_dict
    password = f":{settings['PASSWORD']}" if settings["PASSWORD"] else ""
    return (f"postgres://{settings['USER'] or 'postgres'}{password}@{settings['HOST'] or '127.0.0.1'}"
            f":{settings['PORT'] or 5432}/{settings['NAME']}")


def through(pgbouncer, *, listen="direct", prepared=None, **env):
    """A worker's environment: DATABASES at PgBouncer; LISTEN on a direct connection or off.

    Prepared statements stay on when this PgBouncer keeps them (1.21 or newer), unless
    ``prepared`` says otherwise.
    """
    env["DURABLE_TEST_POSTGRES_URL"] = pgbouncer.url(pgbouncer.name)
    if listen == "direct":
        env["DURABLE_TEST_LISTEN_URL"] = direct_url()
    else:
        env["DURABLE_TEST_LISTEN"] = "0"
    if prepared is None:
        prepared = keeps_prepared_statements(pgbouncer.binary)
    env["DURABLE_TEST_PREPARED_STATEMENTS"] = "1" if prepared else "0"
    return env
