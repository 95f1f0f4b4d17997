"""A busy operator console for the SQLite contention drill: reads and writes, nonstop.

It does what the admin and the dashboard do, as fast as it can: the dashboard's
state counts, stuck and failure queries, the cost report, a job list page, retry-now
and pause/resume (operator writes), and submits. Every "database is locked" it meets
is counted. After every operation it writes how many it has done to PROGRESS (when
given), so the drill can start the workers once the console is working and keep them
busy until it has done its share beside them. On SIGTERM it writes a JSON report and exits.

    python -m tests.drills.console REPORT.json EXECUTIONS_LOG [PROGRESS]
"""

import json
import os
import random
import signal
import sys
import time


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    report_path, exec_log = argv[0], argv[1]
    progress = open(argv[2], "w") if len(argv) > 2 else None  # noqa: SIM115 - open until exit
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.db import OperationalError, transaction
    from django.db.models import Avg, Count, Sum

    import durable
    from durable.exceptions import DurableError
    from durable.models import Job, JobEvent, StepResult
    from durable.verbs import jobs as services

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    rng = random.Random(7)
    stats = {"ops": 0, "locked": 0, "errors": 0, "submitted": [], "messages": []}

    def dashboard():
        list(Job.objects.values("state").annotate(n=Count("id")))
        Job.objects.stuck().count()
        list(JobEvent.objects.filter(kind="failed").values("message").annotate(n=Count("id"))[:10])
        list(StepResult.objects.values("workflow", "step").annotate(c=Sum("cost"), a=Avg("duration")))

    def job_page():
        ids = list(Job.objects.order_by("-updated").values_list("id", flat=True)[:50])
        if ids:
            job = Job.objects.get(pk=rng.choice(ids))
            list(job.events.all())
            list(job.steps.all())

    def retry_some():
        ids = list(Job.objects.exclude(next_run_at=None).values_list("id", flat=True)[:20])
        if ids:
            services.retry_now(rng.choice(ids), user="console", reason="drill")

    def pause_resume():
        services.pause("wait_until", user="console", reason="drill")
        services.resume("wait_until", user="console")

    def submit():
        key = f"console-{os.getpid()}-{len(stats['submitted']):05d}"
        with transaction.atomic():
            durable.submit("drill", key, {"log": exec_log})
        stats["submitted"].append(key)

    operations = [dashboard, dashboard, job_page, job_page, retry_some, pause_resume, submit]
    deadline = time.monotonic() + 600
    while not stopping and time.monotonic() < deadline:
        op = rng.choice(operations)
        try:
            op()
        except OperationalError as exc:
            if "locked" in str(exc):
                stats["locked"] += 1
            else:
                stats["errors"] += 1
            if len(stats["messages"]) < 5:
                stats["messages"].append(f"{op.__name__}: {exc}")
        except DurableError:
            pass  # a refused operator verb (live lease, wrong state) is the console working
        stats["ops"] += 1
        if progress is not None:
            progress.seek(0)
            progress.write(f"{stats['ops']:12d}\n")
            progress.flush()
    with open(report_path, "w") as fh:
        json.dump(stats, fh)


if __name__ == "__main__":
    main()
