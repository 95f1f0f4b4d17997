"""A Prometheus ``/metrics`` view, computed from the database at each scrape.

    # urls.py
    from durable.metrics import metrics_view

    urlpatterns = [..., path("metrics", metrics_view, name="durable-metrics")]

Every number comes from the tables, so any web process answers for every worker
on every machine, and no multiprocess collector is needed. Scrapers authenticate
with ``Authorization: Bearer <DURABLE["METRICS_TOKEN"]>``; without a token, only a
logged-in staff user with ``durable.view_job`` may read the page. Needs the
``prometheus-client`` package: ``pip install 'django-durable-workflows[metrics]'``.
"""

import datetime
import hmac

from django.db.models import Count, Min, Q, Sum
from django.http import HttpResponse, HttpResponseNotAllowed
from django.views.decorators.cache import never_cache

from ..conf import durable_settings
from ..core.states import StateKind
from ..core.workflows import registry
from ..store import locking

# Step duration buckets (seconds): from a parse to a slow model call.
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _kind(workflow, state):
    kind = registry.kind_of(workflow, state)
    return kind.value if kind is not None else ""


class DurableCollector:
    """Collects durable's metrics from the database; register it in a CollectorRegistry."""

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        from ..models import Approval, CostRollup, EventKind, Job, JobEvent, Outbox, StepResult

        now = locking.db_now()

        jobs = GaugeMetricFamily("durable_jobs", "Jobs by workflow and state.",
                                 labels=["workflow", "state", "kind"])
        oldest = GaugeMetricFamily(
            "durable_job_oldest_age_seconds",
            "Seconds since the oldest job in each unfinished state last changed.",
            labels=["workflow", "state"])
        rows = (Job.objects.values("workflow", "state")
                .annotate(n=Count("pk"), since=Min("updated")).order_by("workflow", "state"))
        for row in rows:
            kind = _kind(row["workflow"], row["state"])
            jobs.add_metric([row["workflow"], row["state"], kind], row["n"])
            if kind != StateKind.TERMINAL:
                age = max((now - row["since"]).total_seconds(), 0.0)
                oldest.add_metric([row["workflow"], row["state"]], age)
        yield jobs
        yield oldest

        stuck = GaugeMetricFamily(
            "durable_jobs_stuck", "Jobs whose lease expired mid-step (no live worker yet).",
            labels=["workflow"])
        for row in (Job.objects.stuck(now=now)
                    .values("workflow").annotate(n=Count("pk")).order_by("workflow")):
            stuck.add_metric([row["workflow"]], row["n"])
        yield stuck

        # Everything ever spent (per-minute rollups, memos since, and the daily rollups
        # of memos purged before per-minute rollups existed): counters never go down.
        from ..store.ledger import spent

        done = {}
        for row in spent(datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC),
                         now + datetime.timedelta(days=1)):
            entry = done.setdefault((row["workflow"], row["step"]), [0, 0])
            entry[0] += row["count"]
            entry[1] += row["total"]
        for row in (CostRollup.objects.values("workflow", "step")
                    .annotate(n=Sum("steps"), cost=Sum("cost")).order_by()):
            entry = done.setdefault((row["workflow"], row["step"]), [0, 0])
            entry[0] += row["n"] or 0
            entry[1] += row["cost"] or 0
        completed = CounterMetricFamily("durable_steps_completed", "Steps completed (memos written).",
                                        labels=["workflow", "step"])
        cost = CounterMetricFamily("durable_step_cost", "Money spent per step (as recorded).",
                                   labels=["workflow", "step"])
        for (wf, st), (n, money) in sorted(done.items()):
            completed.add_metric([wf, st], n)
            cost.add_metric([wf, st], float(money))
        yield completed
        yield cost

        failures = CounterMetricFamily(
            "durable_step_failures",
            "Step attempts that failed: retried (retry) or parked as failed (failed).",
            labels=["workflow", "step", "outcome"])
        outcome = {EventKind.RETRY: "retry", EventKind.FAILED: "failed"}
        for row in (JobEvent.objects.filter(kind__in=list(outcome))
                    .values("job__workflow", "step", "kind").annotate(n=Count("pk"))
                    .order_by("job__workflow", "step", "kind")):
            failures.add_metric([row["job__workflow"], row["step"], outcome[row["kind"]]],
                                row["n"])
        yield failures

        yield self._durations(HistogramMetricFamily, StepResult)

        actions = GaugeMetricFamily("durable_actions", "Actions (outbox rows) by status.",
                                    labels=["destination", "status"])
        for row in (Outbox.objects.values("destination", "status").annotate(n=Count("pk"))
                    .order_by("destination", "status")):
            actions.add_metric([row["destination"], row["status"]], row["n"])
        yield actions

        approvals = GaugeMetricFamily("durable_approvals_pending",
                                      "Proposals waiting for a human decision.",
                                      labels=["workflow", "step"])
        for row in (Approval.objects.pending().values("job__workflow", "step")
                    .annotate(n=Count("pk")).order_by("job__workflow", "step")):
            approvals.add_metric([row["job__workflow"], row["step"]], row["n"])
        yield approvals

    def _durations(self, family, StepResult):  # noqa: N803 - the model class
        histogram = family("durable_step_duration_seconds", "How long completed steps ran.",
                           labels=["workflow", "step"])
        # One grouped query: a count per bucket, computed by the database.
        buckets = {f"le{i}": Count("pk", filter=Q(duration__lte=datetime.timedelta(seconds=b)))
                   for i, b in enumerate(BUCKETS)}
        rows = (StepResult.objects.values("workflow", "step")
                .annotate(n=Count("pk"), total=Sum("duration"), **buckets)
                .order_by("workflow", "step"))
        for row in rows:
            pairs = [(str(b), row[f"le{i}"]) for i, b in enumerate(BUCKETS)]
            pairs.append(("+Inf", row["n"]))
            total = row["total"]
            seconds = total.total_seconds() if isinstance(total, datetime.timedelta) else 0.0
            histogram.add_metric([row["workflow"], row["step"]], pairs, seconds)
        return histogram


def render():
    """The metrics page as ``(body bytes, content type)``."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    # A registry per scrape: nothing is kept in the process between scrapes.
    registry_ = CollectorRegistry(auto_describe=False)
    registry_.register(DurableCollector())
    return generate_latest(registry_), CONTENT_TYPE_LATEST


def _refused(request):
    """None if the request may read metrics, else the response that says why not."""
    token = durable_settings.METRICS_TOKEN
    if token:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              str(token).encode()):
            return None
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff and user.has_perm("durable.view_job"):
        return None
    if token:
        response = HttpResponse("Send Authorization: Bearer <DURABLE['METRICS_TOKEN']>.\n",
                                status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="durable metrics"'
        return response
    return HttpResponse("Log in as staff with durable.view_job, or set DURABLE['METRICS_TOKEN']"
                        " and send it as a bearer token.\n", status=403,
                        content_type="text/plain")


@never_cache
def metrics_view(request):
    """Serve durable's metrics in the Prometheus text format."""
    if request.method not in ("GET", "HEAD"):
        return HttpResponseNotAllowed(["GET", "HEAD"])
    refused = _refused(request)
    if refused is not None:
        return refused
    try:
        import prometheus_client  # noqa: F401 - an optional extra
    except ImportError:
        return HttpResponse("prometheus-client is not installed: pip install "
                            "'django-durable-workflows[metrics]'\n", status=501, content_type="text/plain")
    body, content_type = render()
    return HttpResponse(body, content_type=content_type)
