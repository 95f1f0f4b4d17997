import datetime
from decimal import Decimal, InvalidOperation

from django.db import migrations, models


def copy_from_the_enqueued_events(apps, schema_editor):
    """Rows not yet settled take the cost, duration and attempt their step recorded.

    Until now they were kept only in the step's "enqueued" event and read back from it
    when the action was confirmed.
    """
    Outbox = apps.get_model("durable", "Outbox")
    JobEvent = apps.get_model("durable", "JobEvent")
    unsettled = Outbox.objects.filter(status__in=["pending", "attempted", "unknown"], step_key="")
    for row in unsettled.only("pk", "job_id", "kind").iterator():
        data = (JobEvent.objects.filter(job_id=row.job_id, step=row.kind, kind="action",
                                        data__phase="enqueued")
                .order_by("-id").values_list("data", flat=True).first()) or {}
        try:
            cost = Decimal(str(data.get("cost", "0")))
            ms = float(data.get("ms", 0))
            attempt = int(data.get("attempt", 1))
        except (TypeError, ValueError, InvalidOperation):
            continue
        Outbox.objects.filter(pk=row.pk).update(
            step_cost=cost, step_duration=datetime.timedelta(milliseconds=ms),
            step_attempt=max(attempt, 1))


class Migration(migrations.Migration):

    dependencies = [
        ('durable', '0010_cost_minutes'),
    ]

    operations = [
        migrations.AddField(
            model_name='outbox',
            name='step_attempt',
            field=models.PositiveIntegerField(db_default=1, default=1, verbose_name='step attempt'),
        ),
        migrations.AddField(
            model_name='outbox',
            name='step_cost',
            field=models.DecimalField(db_default=0, decimal_places=6, default=0, max_digits=18, verbose_name='step cost'),
        ),
        migrations.AddField(
            model_name='outbox',
            name='step_duration',
            field=models.DurationField(db_default=datetime.timedelta(0), default=datetime.timedelta(0), verbose_name='step duration'),
        ),
        migrations.RunPython(copy_from_the_enqueued_events, migrations.RunPython.noop),
    ]
