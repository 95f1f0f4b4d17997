from django.core.management.base import BaseCommand, CommandError

from durable import services
from durable.exceptions import DurableError
from durable.workflows import registry


class Command(BaseCommand):
    help = "Inspect and operate durable: graph WORKFLOW | requeue|cancel|retry JOB... "

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="verb", required=True)
        graph = sub.add_parser("graph", help="Print a workflow's transition table.")
        graph.add_argument("workflow")
        for verb in ("requeue", "cancel", "retry"):
            p = sub.add_parser(verb, help=f"{verb.capitalize()} jobs by key.")
            p.add_argument("jobs", nargs="+")
            p.add_argument("--reason", default="", help="Recorded in the job's history.")
            p.add_argument("--user", default="cli", help="Who is acting (recorded).")

    def handle(self, *args, verb, **options):
        return getattr(self, f"do_{verb}")(**options)

    def do_graph(self, workflow, **options):
        try:
            wf = registry.get(workflow)
        except DurableError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{wf.name} v{wf.version}")
        self.stdout.write(wf.table.render())

    def _each(self, service, jobs, reason, user, done):
        failed = 0
        for job_id in jobs:
            try:
                job = service(job_id, user=user, reason=reason)
            except DurableError as exc:
                failed += 1
                self.stderr.write(f"{job_id}: {exc}")
            else:
                self.stdout.write(f"{job_id}: {done} ({job.state})")
        if failed:
            raise CommandError(f"{failed} of {len(jobs)} jobs were not changed")

    def do_requeue(self, jobs, reason, user, **options):
        self._each(services.requeue, jobs, reason, user, "requeued")

    def do_cancel(self, jobs, reason, user, **options):
        self._each(services.cancel, jobs, reason, user, "cancelled")

    def do_retry(self, jobs, reason, user, **options):
        self._each(services.retry_now, jobs, reason, user, "due now")
