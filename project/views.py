"""The example site's own pages (the console lives in the admin, under durable)."""

from django.conf import settings
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse

# (label, URL name in the admin, what an operator does there)
CONSOLE = [
    ("Dashboard", "admin:durable_dashboard", "what is running, stuck, failing or waiting"),
    ("Approval queue", "admin:durable_approvals", "proposed actions waiting for a decision"),
    ("Jobs", "admin:durable_job_changelist", "every job, its timeline, requeue and cancel"),
    ("Cost report", "admin:durable_costs", "what each workflow and step spent"),
]


def _links(entries):
    links = []
    for label, name, about in entries:
        try:
            links.append({"label": label, "url": reverse(name), "about": about})
        except NoReverseMatch:
            continue  # a console page this version does not have
    return links


def home(request):
    """Where to go on the example site: the console and the demo's services."""
    crm = settings.DEMO_CRM_URL.rstrip("/")
    services = [
        {"label": "Metrics", "url": reverse("durable-metrics"),
         "about": "Prometheus metrics of jobs, leases and the outbox"},
        {"label": "CRM: actions applied", "url": f"{crm}/_actions",
         "about": "what the demo's CRM has applied, as JSON (manage.py demo starts it on"
                  " 127.0.0.1; it deduplicates idempotency keys and answers lookups)"},
        {"label": "Payments: refunds applied", "url": f"{settings.DEMO_REFUNDS_URL.rstrip('/')}/_actions",
         "about": "the refunds the support agent has sent, as JSON (a large one waits in the"
                  " approval queue first)"},
    ]
    return render(request, "home.html", {
        "console": _links(CONSOLE),
        "admin_url": reverse("admin:index"),
        "services": services,
    })
