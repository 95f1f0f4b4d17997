from django.core.management.base import BaseCommand, CommandError

from durable.supervisor import Supervisor
from durable.workflows import registry


class Command(BaseCommand):
    help = "Run durable worker processes (and the outbox dispatcher) until stopped."

    def add_arguments(self, parser):
        parser.add_argument("--processes", "-p", type=int, default=None,
                            help="Worker processes (default: DURABLE['PROCESSES'] or the CPU count).")
        parser.add_argument("--workflow", action="append", dest="workflows", default=[],
                            help="Only run jobs of this workflow (repeatable).")
        parser.add_argument("--queue", action="append", dest="queues", default=[],
                            help="Only run jobs of this queue (repeatable).")
        parser.add_argument("--burst", action="store_true",
                            help="Drain everything runnable now, then exit.")
        parser.add_argument("--lease", type=float, default=None,
                            help="Lease seconds (default: DURABLE['LEASE_SECONDS']).")

    def handle(self, *args, processes, workflows, queues, burst, lease, **options):
        if processes is not None and processes < 1:
            raise CommandError("--processes must be at least 1")
        for name in workflows:
            if name not in registry:
                raise CommandError(f"Unknown workflow {name!r}; known: {', '.join(registry.names())}")
        supervisor = Supervisor(processes=processes, burst=burst, workflows=workflows,
                                queues=queues, lease_seconds=lease)
        return_code = supervisor.run()
        if return_code:
            raise CommandError(f"runworkers exited with status {return_code}")
