import argparse
import dataclasses
import datetime
import json

from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder

from ...core import formats
from ...core.workflows import registry
from ...exceptions import DurableError
from ...reads import reports
from ...verbs import jobs as services


class Command(BaseCommand):
    help = ("Inspect and operate durable: status [--check] | graph WORKFLOW | "
            "requeue|cancel|retry JOB... | grant JOB --turns N --budget X |"
            " grant --scope SCOPE --budget X | budgets |"
            " question|answer|send-back JOB | purge | rollup |"
            " schedules [pause|resume|run NAME]")

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="verb", required=True)
        graph = sub.add_parser("graph", help="Print a workflow's transition table.")
        graph.add_argument("workflow")
        for verb in ("requeue", "cancel", "retry"):
            p = sub.add_parser(verb, help=f"{verb.capitalize()} jobs by key.")
            p.add_argument("jobs", nargs="+")
            p.add_argument("--reason", default="", help="Recorded in the job's history.")
            p.add_argument("--user", default="cli", help="Who is acting (recorded).")
        grant = sub.add_parser("grant", help="Give a parked agent more turns or budget, or a budget more money.")
        grant.add_argument("job", nargs="?", help="The parked job (its budget, or the shared one that stopped it).")
        grant.add_argument("--scope", default=None, help="A budget's scope instead of a job (tenant:42).")
        grant.add_argument("--period", default=None, help="With --scope: its period (2026-12-07; default the latest).")
        grant.add_argument("--turns", type=int, default=0, help="More turns (added to its limit).")
        grant.add_argument("--budget", default=None, help="More money (added to its budget).")
        grant.add_argument("--reason", required=True, help="Recorded in the job's history.")
        grant.add_argument("--user", default="cli", help="Who is acting (recorded).")
        sub.add_parser("budgets", help="The budgets of the current periods: spent, reserved, limit.")
        add_answer_arguments(sub)
        add_purge_arguments(sub)
        add_status_arguments(sub)
        add_schedules_arguments(sub)
        sub.add_parser("rollup", help="Roll memo costs and state moves up per minute now "
                                      "(runworkers does it about once a minute; run it from "
                                      "cron where no worker runs for long).")

    def handle(self, *args, verb, **options):
        return getattr(self, f"do_{verb.replace('-', '_')}")(**options)

    def do_rollup(self, **options):
        from ...store import rollups

        through = rollups.roll_up()
        self.stdout.write(f"memo costs rolled up through {through['costs']:%Y-%m-%d %H:%M} UTC,"
                          f" state moves through {through['moves']:%Y-%m-%d %H:%M} UTC")

    def do_graph(self, workflow, **options):
        try:
            wf = registry.get(workflow)
        except DurableError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{wf.name} v{wf.version}")
        self.stdout.write(wf.table.render())
        for tool in getattr(wf, "tools", ()):
            what = (f"action {tool.kind}" + (", needs approval" if tool.approval else "")
                    + (", many per job" if tool.many else "")) if tool.is_action else "read-only"
            self.stdout.write(f"tool {tool.name}: {what}")

    def do_grant(self, job, turns, budget, reason, user, scope=None, period=None, **options):
        from ...agents.tools import grant

        if (job is None) == (scope is None):
            raise CommandError("Name a parked job, or a budget with --scope (not both).")
        if scope is not None:
            return self._grant_scope(scope, period, budget, reason, user)
        try:
            done = grant(job, turns=turns, budget=budget, user=user, reason=reason)
        except DurableError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{job}: granted (turn limit {done.turn_limit}, budget"
                          f" {formats.money(done.budget)}); {done.state}")

    def _grant_scope(self, scope, period, amount, reason, user):
        from ...store import budgets

        if amount in (None, ""):
            raise CommandError("Say how much with --budget.")
        found = budgets.find(scope, period)
        if found is None:
            raise CommandError(f"There is no budget {scope}" + (f" for {period}" if period else "")
                               + ": a budget's row is made by its first call (see durable budgets).")
        try:
            row, resumed = budgets.grant(found.pk, amount, user=user, reason=reason)
        except DurableError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{budgets.describe(row)}: granted {formats.money(amount)}, limit now"
                          f" {formats.money(row.limit)}; {len(resumed)} parked runs go on")

    def do_budgets(self, **options):
        from ...reads import budgets
        from ...store import locking

        found = budgets.overview(locking.db_now())  # what the Budgets tab shows, the most used first
        if not found.budgets:
            self.stdout.write("no budget has a row for the current period yet")
        for b in found.budgets:
            self.stdout.write(f"{formats.money(b.spent)} spent, {formats.money(b.reserved)} reserved,"
                              f" of {formats.money(b.limit)}: {b.name}"
                              + (f"; {b.waiting} runs waiting on it" if b.waiting else ""))
        if found.more:
            self.stdout.write(f"... and {found.more} more")

    def _each(self, service, jobs, reason, user, done):
        failed = 0
        for job_id in jobs:
            try:
                job = service(job_id, user=user, reason=reason)
            except DurableError as exc:
                failed += 1
                hint = where_to_go(job_id)
                self.stderr.write(f"{job_id}: {exc}" + (f"\n  {hint}" if hint else ""))
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

    def do_question(self, job, **options):
        from ...models import Job
        from ...verbs import answers

        found = Job.objects.filter(pk=job).first()
        q = answers.question(found) if found is not None else None
        if q is None:
            raise CommandError(f"{job}: no question waits for an answer. {where_to_go(job)}")
        self.stdout.write(f"{job}: step {q.step} asks: {q.question}")
        self.stdout.write("the value it asked about:")
        self.stdout.write(json.dumps(q.value, cls=DjangoJSONEncoder, indent=2, ensure_ascii=False))
        self.stdout.write(f"answer:    manage.py durable answer {job} --set FIELD=VALUE --reason WHY")
        steps = ", ".join(name for name, _ in q.again)
        self.stdout.write(f"run again: manage.py durable send-back {job} [--step STEP] --reason WHY"
                          f" (steps: {steps})")

    def do_answer(self, job, set_fields, value, reason, user, **options):
        from ...models import Job
        from ...verbs import answers

        found = Job.objects.filter(pk=job).first()
        q = answers.question(found) if found is not None else None
        try:
            if q is None:
                raise DurableError(f"no question of job {job} waits for an answer")
            if (value is None) == (not set_fields):
                raise CommandError("give the answer as --set FIELD=VALUE (one or more) or as --json")
            if value is not None:
                try:
                    answer = json.loads(value)
                except ValueError as exc:
                    raise CommandError(f"--json is not JSON ({exc}); nothing was changed") from None
            else:
                pairs = [item.partition("=") for item in set_fields]
                if any(not sep for _, sep, _ in pairs):
                    raise CommandError("--set takes FIELD=VALUE; nothing was changed")
                answer = answers.from_fields(q.value, {k: v for k, _, v in pairs})
            done = answers.answer(job, answer, user=user, reason=reason)
        except DurableError as exc:
            raise CommandError(f"{job}: {exc}; nothing was changed. {where_to_go(job)}") from None
        self.stdout.write(f"{job}: answered; {q.step} holds the answer and the job goes on"
                          f" ({done.state}, due now)")

    def do_send_back(self, job, step, reason, user, **options):
        from ...models import Job
        from ...verbs import answers

        found = Job.objects.filter(pk=job).first()
        q = answers.question(found) if found is not None else None
        try:
            if q is None:
                if step:
                    raise DurableError(f"job {job} has no step's question, so --step cannot apply")
                done = answers.send_back(job, user=user, reason=reason)
            else:
                done = answers.ask_again(job, step=step or None, user=user, reason=reason)
        except DurableError as exc:
            raise CommandError(f"{job}: {exc}; nothing was changed. {where_to_go(job)}") from None
        self.stdout.write(f"{job}: sent back; it runs again from {done.state}")

    def do_purge(self, older_than, batch_size, keep_costs, workflow, dry_run, **options):
        from ...store import rollups

        try:
            age = services.parse_age(older_than)
            if not dry_run:
                # What the purged memos cost is in the per-minute rollups before they go.
                rollups.roll_up()
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

    def do_status(self, workflow, window, check, as_json, **options):
        if workflow and workflow not in registry:
            raise CommandError(f"No workflow is registered as {workflow!r}"
                               f" (registered: {', '.join(registry.names()) or 'none'})")
        if window <= 0:
            raise CommandError("--window must be a positive number of minutes")
        status = reports.status(window=datetime.timedelta(minutes=window), workflow=workflow)
        if as_json:
            self.stdout.write(json.dumps(status_as_data(status), cls=DjangoJSONEncoder, indent=2))
        elif check:
            self.stdout.write("\n".join(alert_lines(status)))
        else:
            self.stdout.write("\n".join(status_lines(status)))
        if check and status["alerts"]:
            n = len(status["alerts"])
            raise CommandError(f"{n} alert{'s' if n != 1 else ''} firing", returncode=1)

    def do_schedules(self, action, name, reason, user, as_json, **options):
        from django.core.exceptions import ImproperlyConfigured

        from ...schedules import firing as schedules

        if action != "list":
            if not name:
                raise CommandError(f"schedules {action} needs the schedule's name")
            verb = {"pause": services.pause_schedule, "resume": services.resume_schedule,
                    "run": services.run_schedule_now}[action]
            try:
                done = verb(name, user=user, reason=reason)
            except (DurableError, ImproperlyConfigured) as exc:
                raise CommandError(str(exc)) from None
            past = {"pause": "paused", "resume": "resumed", "run": "submitted"}[action]
            self.stdout.write(f"{name}: {past}" + (f" {done}" if action == "run" else ""))
            return
        try:
            rows = schedules.overview()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        if as_json:
            rows = [{**r, "last_decision": _decision(r["last_decision"])} for r in rows]
            self.stdout.write(json.dumps(rows, cls=DjangoJSONEncoder, indent=2))
            return
        self.stdout.write("\n".join(schedule_lines(rows)))


def _decision(event):
    if event is None:
        return None
    return {"kind": event.kind, "at": event.at, "tick": event.tick, "job": event.job,
            "actor": event.actor, "message": event.message}


def _when(moment):
    return f"{moment:%Y-%m-%d %H:%M:%S}" if moment else "-"


def schedule_lines(rows):
    """Each schedule as a block: what it runs, when, its last run and its last decision."""
    if not rows:
        return ["No schedules are declared (Workflow.schedule or DURABLE['SCHEDULES'])."]
    out = ["Schedules (times UTC, database clock)"]
    for r in rows:
        state = "PAUSED" if r["paused"] else ("LATE" if r["late"] else "")
        out += ["", f"{r['name']}  -> {r['target']}  {state}".rstrip(),
                f"  {r['words']}   [{r['expression']}; catch-up {r['catch_up'] or '-'},"
                f" overlap {r['overlap'] or '-'}]"]
        out.append(f"  next tick  {_when(r['next_tick'])}")
        run = r["last_run"]
        out.append(f"  last run   {run['job']} ({_run_words(run)})" if run
                   else "  last run   none yet")
        out.append(f"  missed     {r['missed']}" + (f", {r['queued']} queued" if r["queued"] else ""))
        if r["paused"]:
            p = r["paused"]
            out.append(f"  paused     {_when(p['at'])} by {p['by'] or 'someone'}: {p['reason']}")
        if r["last_decision"] is not None:
            e = r["last_decision"]
            out.append(f"  decision   {_when(e.at)} {e.kind}: {e.message}")
    return out


def add_answer_arguments(sub):
    p = sub.add_parser("question", help="Show what a job waiting for a person asks.")
    p.add_argument("job")
    p = sub.add_parser("answer", help="Answer a job's question: the value the step asked about,"
                                      " corrected; the job goes on.")
    p.add_argument("job")
    p.add_argument("--set", dest="set_fields", action="append", default=[], metavar="FIELD=VALUE",
                   help="Correct one field (repeat for more); the others keep their value.")
    p.add_argument("--json", dest="value", default=None, help="The whole answer as JSON.")
    p.add_argument("--reason", required=True, help="Recorded in the job's history.")
    p.add_argument("--user", default="cli", help="Who is acting (recorded).")
    p = sub.add_parser("send-back", help="Run the step that asked (or an earlier one) again.")
    p.add_argument("job")
    p.add_argument("--step", default="", help="The step to run again from (default: the one"
                                              " that asked).")
    p.add_argument("--reason", required=True, help="Recorded in the job's history.")
    p.add_argument("--user", default="cli", help="Who is acting (recorded).")


def where_to_go(job_id):
    """Where a person acts on ``job_id`` next, in one sentence ("" when nothing is needed)."""
    from ...core.states import StateKind
    from ...models import Job
    from ...verbs import answers

    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return "There is no such job: check the key (manage.py durable status lists the stuck ones)."
    kind = registry.kind_of(job.workflow, job.state)
    if kind is None:
        return f"Its workflow {job.workflow} or state {job.state} is not registered in this process."
    if answers.question(job) is not None:
        return (f"It waits for a person's answer: see manage.py durable question {job_id}, then"
                f" durable answer {job_id} --set FIELD=VALUE or durable send-back {job_id}.")
    hints = {
        StateKind.HUMAN: (f"It waits for a person: manage.py durable grant {job_id} (an agent),"
                          f" durable send-back {job_id}, or durable cancel {job_id}."),
        StateKind.FAILED: f"It failed: manage.py durable requeue {job_id} once the cause is fixed.",
        StateKind.APPROVAL: "It waits for a decision on its proposal: the console's Approvals page.",
        StateKind.UNKNOWN: ("Its action's outcome is unknown: decide what happened on the"
                            " console's Reconciliation page."),
        StateKind.IN_FLIGHT: "Its action is being sent: the dispatcher moves it next.",
        StateKind.SIGNAL: "It waits for a signal: durable.signal() or the job's page delivers one.",
        StateKind.JOIN: "It waits for its child jobs to finish.",
        StateKind.TERMINAL: f"It finished ({job.state}): nothing is left to do.",
    }
    return hints.get(kind, f"It is {job.state}: a worker runs it next.")


def _run_words(run):
    """How a schedule's last run stands: "succeeded", "failed in state failed_fetch", ..."""
    outcome, state = run["outcome"], run["state"]
    if outcome == "going":
        return f"still running, in state {state}"
    if state == outcome or not state:
        return outcome
    return f"{outcome}, in state {state}"


def add_schedules_arguments(sub):
    p = sub.add_parser("schedules", help="List schedules, or pause / resume / run one now.")
    p.add_argument("action", nargs="?", default="list", choices=["list", "pause", "resume", "run"])
    p.add_argument("name", nargs="?", default=None)
    p.add_argument("--reason", default="", help="Why (required to pause, resume or run; recorded).")
    p.add_argument("--user", default="cli", help="Who is acting (recorded).")
    p.add_argument("--json", dest="as_json", action="store_true", help="Print JSON instead.")


def add_purge_arguments(sub):
    p = sub.add_parser("purge", help="Delete finished jobs and their rows, in batches.")
    p.add_argument("--older-than", required=True,
                   help="Age since the job last changed: 90d, 12h, 30m, 2w, 45s.")
    p.add_argument("--batch-size", type=int, default=500, help="Jobs per transaction.")
    p.add_argument("--keep-costs", action=argparse.BooleanOptionalAction, default=None,
                   help="Keep the purged memos' costs in the cost report "
                        "(default DURABLE['PURGE_KEEP_COSTS']).")
    p.add_argument("--workflow", default=None, help="Only jobs of this workflow.")
    p.add_argument("--dry-run", action="store_true", help="Count, delete nothing.")


def add_status_arguments(sub):
    p = sub.add_parser("status", help="Print the four operator queries and the alerts.")
    p.add_argument("--workflow", default=None, help="Only this workflow.")
    p.add_argument("--window", type=float, default=15,
                   help="Minutes over which the trend (and a stalled stage) is measured.")
    p.add_argument("--check", action="store_true",
                   help="Print only the alerts; exit 1 if any fires (for cron and monitoring).")
    p.add_argument("--json", dest="as_json", action="store_true", help="Print JSON instead.")


# Rendering the status as text: plain tables, one per query, each with its scope.


def table(headers, rows):
    """Left-aligned columns, numbers right-aligned, two spaces apart."""
    rows = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    numeric = [all(r[i].replace(".", "", 1).isdigit() for r in rows if r[i]) and rows
               for i in range(len(headers))]

    def line(cells):
        return "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)
        ).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def alert_lines(status):
    if not status["alerts"]:
        return [f"OK: no alerts{_scope(status)} at {status['now']:%Y-%m-%d %H:%M:%S} UTC"]
    lines = []
    for alert in status["alerts"]:
        lines += [f"{alert.level.upper()}: {alert.title}. {alert.detail}",
                  f"  What to do: {alert.todo}"]
    return lines


def _scope(status):
    return f" in {status['workflow']}" if status["workflow"] else ""


def status_lines(status):
    now, overview = status["now"], status["overview"]
    window = formats.age(overview.window.total_seconds())
    out = [f"durable status{_scope(status) or ' (all workflows)'} as of "
           f"{now:%Y-%m-%d %H:%M:%S} UTC, database clock", ""]
    out += ["Alerts", *("  " + line for line in alert_lines(status)), ""]
    for pause in status["paused"]:
        out.append(f"PAUSED: {pause.workflow} by {pause.paused_by or 'someone'} at "
                   f"{pause.paused_at:%Y-%m-%d %H:%M} UTC: {pause.reason}")
    if status["paused"]:
        out.append("")
    out.append(f"1. Where is everything? Jobs per workflow and state now; trend over {window}.")
    rows = [[r.workflow, r.state, r.count, formats.age(r.avg_age) if r.count else "",
             formats.age(r.oldest_age) if r.count else "", r.count_before,
             "STALLED" if r.stalled else ""] for r in overview.rows]
    out += table(["workflow", "state", "count", "avg age", "oldest", f"{window} ago", ""], rows)
    stuck = status["stuck"]
    out += ["", f"2. What is stuck? Leases expired before {now:%H:%M:%S} UTC: {len(stuck)}"
                f"{'' if len(stuck) < reports.STUCK_LIMIT else '+'}."]
    if stuck:
        out += table(["job", "workflow", "state", "attempts", "lease owner", "expired", "last error"],
                     [[r["id"], r["workflow"], r["state"], r["attempts"], r["lease_owner"],
                       formats.age(r["expired_for"]) + " ago", (r["last_error"] or "")[:60]] for r in stuck])
    failures = status["failures"]
    out += ["", f"3. What is failing? Jobs in failed states now, by cause: "
                f"{sum(g.count for g in failures)} in {len(failures)} groups."]
    if failures:
        out += table(["count", "first seen", "last seen", "workflow.step", "error", "message"],
                     [[g.count, f"{g.first_seen:%m-%d %H:%M}", f"{g.last_seen:%m-%d %H:%M}",
                       f"{g.workflow}.{g.step}", g.error_class, g.message[:60]] for g in failures])
    costs = status["costs"]
    total = sum((r["total"] for r in costs), 0)
    out += ["", f"4. Which step costs the money? Memos written in the "
                f"{formats.age(status['cost_window'].total_seconds())} to {now:%Y-%m-%d %H:%M} UTC: "
                f"{formats.money(total)} in all."]
    if costs:
        out += table(["workflow", "step", "count", f"total ({formats.currency()})",
                      f"mean ({formats.currency()})"],
                     [[r["workflow"], r["step"], r["count"], formats.amount(r["total"]),
                       formats.amount(r["mean"])] for r in costs])
    return out


def status_as_data(status):
    overview = status["overview"]
    return {
        "now": status["now"], "workflow": status["workflow"],
        "window_seconds": overview.window.total_seconds(),
        "states": [{**dataclasses.asdict(r), "kind": r.kind.value if r.kind else None}
                   for r in overview.rows],
        "stuck": status["stuck"],
        "failures": [{**dataclasses.asdict(g), "states": sorted(g.states)}
                     for g in status["failures"]],
        "costs": status["costs"],
        "cost_window_seconds": status["cost_window"].total_seconds(),
        "alerts": [dataclasses.asdict(a) for a in status["alerts"]],
        "paused": [{"workflow": p.workflow, "paused_by": p.paused_by, "paused_at": p.paused_at,
                    "reason": p.reason} for p in status["paused"]],
    }
