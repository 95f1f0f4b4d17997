"""The cost report: memo costs per UTC day, per step or per workflow, over a chosen range; then what
was paid and what the model-call cache saved, per workflow, model, tool or tenant."""

import datetime

from django import forms
from django.template.response import TemplateResponse

from ..core.workflows import registry
from ..reads import reports, spend
from ..store import locking
from .base import context, require_view
from .charts import OTHER, columns_chart


class CostForm(forms.Form):
    """The report's range (UTC days, inclusive), grouping and workflow; at most a year."""

    start = forms.DateField(label="From", widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(label="To (inclusive)", widget=forms.DateInput(attrs={"type": "date"}))
    by = forms.ChoiceField(label="Per", choices=[("step", "step"), ("workflow", "workflow")])
    workflow = forms.ChoiceField(label="Workflow", required=False)
    split = forms.ChoiceField(label="Paid and saved per", required=False,
                              choices=[(name, name) for name in spend.GROUPS])

    MAX_DAYS = 366

    def __init__(self, *args, workflows=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["workflow"].choices = [("", "all workflows")] + [(w, w) for w in workflows]

    def clean(self):
        data = super().clean()
        start, end = data.get("start"), data.get("end")
        if start and end:
            if end < start:
                raise forms.ValidationError("The range ends before it starts.")
            if (end - start).days >= self.MAX_DAYS:
                raise forms.ValidationError(f"Choose a range of at most {self.MAX_DAYS} days.")
        return data


def cost_report(request, admin_site):
    """Memo costs per day over the chosen range, as a stacked chart and a table."""
    require_view(request, "durable.view_stepresult", "durable.view_job")
    today = locking.db_now().astimezone(datetime.UTC).date()
    defaults = {"start": today - datetime.timedelta(days=13), "end": today, "by": "step",
                "workflow": "", "split": "workflow"}
    # The registered workflows, and one asked for by name (no DISTINCT over every memo).
    workflows = sorted(set(registry.names()) | ({request.GET["workflow"]}
                                                if request.GET.get("workflow") else set()))
    form = CostForm(request.GET or None, workflows=workflows, initial=defaults)
    params = dict(defaults)
    problems = []
    if request.GET and form.is_valid():
        params.update({k: v for k, v in form.cleaned_data.items() if k != "split" or v})
    elif request.GET:
        problems = [*form.non_field_errors(),
                    *(f"{form[name].label}: {e}" for name, errs in form.errors.items()
                      if name != "__all__" for e in errs)]
        # The form shows what the page shows: the default range, not what was typed.
        form = CostForm(workflows=workflows, initial=defaults)
    start = datetime.datetime.combine(params["start"], datetime.time(), tzinfo=datetime.UTC)
    end = datetime.datetime.combine(params["end"] + datetime.timedelta(days=1), datetime.time(),
                                    tzinfo=datetime.UTC)
    data = reports.cost_by_day(start, end, by=params["by"], workflow=params["workflow"] or None)
    series = data["series"]
    # Steps that cost nothing stay in the table but take no colour in the chart.
    chart = columns_chart(data["days"], [s for s in series if s["total"]])
    colors = {s["name"]: s["color"] for s in chart["series"]}
    for s in series:
        s["color"] = colors.get(s["name"], OTHER)
    legend = [{"name": s["name"], "color": s["color"]} for s in chart["series"]]
    per_day = [{"day": day, "values": [s["per_day"][i] for s in chart["series"]],
                "total": data["totals"][i]} for i, day in enumerate(data["days"])]
    split = spend.paid_and_saved(start, end, by=params["split"], workflow=params["workflow"] or None)
    ctx = context(
        request, admin_site, "Cost report", "costs", split=split,
        form=form, problems=problems, params=params, data=data, series=series, chart=chart,
        legend=legend,
        per_day=per_day, column_names=[s["name"] for s in chart["series"]],
    )
    return TemplateResponse(request, "admin/durable/costs.html", ctx)
