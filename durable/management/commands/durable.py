import argparse

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
        add_purge_arguments(sub)

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

    def do_purge(self, older_than, batch_size, keep_costs, workflow, dry_run, **options):
        try:
            age = services.parse_age(older_than)
            done = services.purge(
                age, batch_size=batch_size, keep_costs=keep_costs, workflow=workflow,
                dry_run=dry_run,
                progress=lambda r: self.stdout.write(f"batch {r.batches}: {r.jobs} jobs so far"),
            )
        except (ValueError, DurableError) as exc:
            raise CommandError(str(exc)) from None
        if dry_run:
            self.stdout.write(f"{done.jobs} finished jobs unchanged for {older_than} would be purged")
            return
        rows = ", ".join(f"{n} {label.split('.')[-1]}" for label, n in sorted(done.rows.items()))
        self.stdout.write(f"purged {done.jobs} finished jobs unchanged for {older_than}"
                          f" ({rows or 'nothing'})")
        if done.costs_kept:
            self.stdout.write(f"kept their cost, {done.costs_kept}, in the cost rollup")


def add_purge_arguments(sub):
    p = sub.add_parser("purge", help="Delete finished jobs and their rows, in batches.")
    p.add_argument("--older-than", required=True,
                   help="Age since the job last changed: 90d, 12h, 30m, 2w, 45s.")
    p.add_argument("--batch-size", type=int, default=500, help="Jobs per transaction.")
    p.add_argument("--keep-costs", action=argparse.BooleanOptionalAction, default=None,
                   help="Roll memo costs up per day and step first "
                        "(default DURABLE['PURGE_KEEP_COSTS']).")
    p.add_argument("--workflow", default=None, help="Only jobs of this workflow.")
    p.add_argument("--dry-run", action="store_true", help="Count, delete nothing.")
