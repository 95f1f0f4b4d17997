import logging
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from ...core.workflows import registry
from ...engine.supervisor import Supervisor, catch_early_signals


class _Verbosity(logging.Filter):
    """-v 0: warnings only; -v 1: runworkers' own lines too; -v 2: every process's, each job."""

    def __init__(self, verbosity):
        super().__init__()
        self.verbosity = verbosity

    def filter(self, record):
        if record.levelno >= logging.WARNING or self.verbosity >= 3:
            return True
        if record.levelno < logging.INFO:
            return False
        return self.verbosity >= 2 or (self.verbosity == 1 and record.name == "durable.runworkers")


class _Format(logging.Formatter):
    """The time and the message; a warning or an error says which it is."""

    def format(self, record):
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            time_, _, message = text.partition(" ")
            return f"{time_} {record.levelname}: {message}"
        return text


def configure_output(verbosity):
    """Print durable's log to stderr, unless LOGGING configures a durable logger itself."""
    configured = getattr(settings, "LOGGING", {}).get("loggers", {})
    if any(name == "durable" or name.startswith("durable.") for name in configured):
        return  # the site's LOGGING decides what is shown, and where
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Format("%(asctime)s %(message)s", "%H:%M:%S"))
    handler.addFilter(_Verbosity(verbosity))
    logger = logging.getLogger("durable")
    for previous in [h for h in logger.handlers if any(isinstance(f, _Verbosity) for f in h.filters)]:
        logger.removeHandler(previous)  # runworkers called again in one process
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbosity >= 3 else logging.INFO)


class Command(BaseCommand):
    help = "Run durable worker processes (and the outbox dispatcher) until stopped."

    def run_from_argv(self, argv):
        # The first thing: a SIGTERM during start-up (imports, system checks) must drain,
        # not kill the process by the signal (see catch_early_signals).
        catch_early_signals()
        super().run_from_argv(argv)

    def add_arguments(self, parser):
        parser.add_argument("--processes", "-p", type=int, default=None,
                            help="Worker processes (default: DURABLE['PROCESSES'] or the CPU count).")
        parser.add_argument("--threads", "-t", type=int, default=None,
                            help="Runs in flight per worker process, one thread each"
                                 " (default: DURABLE['THREADS'], 8).")
        parser.add_argument("--connections", "-c", type=int, default=None,
                            help="Database connections per worker process at most; more threads"
                                 " share them (default: DURABLE['CONNECTIONS'], 10).")
        parser.add_argument("--workflow", action="append", dest="workflows", default=[],
                            help="Only run jobs of this workflow (repeatable).")
        parser.add_argument("--queue", action="append", dest="queues", default=[],
                            help="Only run jobs of this queue (repeatable).")
        parser.add_argument("--burst", action="store_true",
                            help="Drain everything runnable now, then exit.")
        parser.add_argument("--lease", type=float, default=None,
                            help="Lease seconds (default: DURABLE['LEASE_SECONDS']).")
        parser.add_argument("--dispatchers", type=int, default=1,
                            help="Outbox dispatcher processes that send actions (default 1).")
        parser.add_argument("--no-dispatcher", action="store_true",
                            help="Run no outbox dispatcher (another machine runs it).")
        parser.add_argument("--dispatcher-only", action="store_true",
                            help="Run only the outbox dispatcher, no job workers.")

    def handle(self, *args, processes, threads, workflows, queues, burst, lease, dispatchers,
               no_dispatcher, dispatcher_only, connections=None, verbosity=1, **options):
        if processes is not None and processes < 1:
            raise CommandError("--processes must be at least 1")
        if threads is not None and threads < 1:
            raise CommandError("--threads must be at least 1")
        if connections is not None and connections < 3:
            raise CommandError("--connections must be at least 3"
                               " (the lease renewal's, the group commit's and the runs')")
        if dispatchers < 1:
            raise CommandError("--dispatchers must be at least 1 (use --no-dispatcher for none)")
        if no_dispatcher and dispatcher_only:
            raise CommandError("--no-dispatcher and --dispatcher-only leave nothing to run")
        if dispatcher_only and (processes is not None or threads is not None):
            raise CommandError("--dispatcher-only runs no workers; drop --processes and --threads")
        for name in workflows:
            if name not in registry:
                raise CommandError(f"Unknown workflow {name!r}; known: {', '.join(registry.names())}")
        configure_output(verbosity)
        supervisor = Supervisor(processes=processes, burst=burst, workflows=workflows,
                                queues=queues, lease_seconds=lease, threads=threads,
                                db_connections=connections,
                                dispatchers=0 if no_dispatcher else dispatchers,
                                workers=not dispatcher_only)
        return_code = supervisor.run()
        if return_code:
            raise CommandError(f"runworkers exited with status {return_code}")
