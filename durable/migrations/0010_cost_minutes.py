import datetime

from django.db import migrations, models
from django.db.models import Count, Sum
from django.db.models.functions import Now, TruncMinute


def roll_up_existing_memos(apps, schema_editor):
    """The memos already written, rolled up once here rather than at the first page view."""
    from durable.models import memo_label  # an expression over the columns of 0006


    StepResult = apps.get_model("durable", "StepResult")
    CostMinute = apps.get_model("durable", "CostMinute")
    CostMark = apps.get_model("durable", "CostMark")
    now = StepResult.objects.annotate(now=Now()).values_list("now", flat=True).first()
    if now is None:  # no memo yet: the first roll-up starts from nothing
        return
    upto = (now - datetime.timedelta(minutes=2)).replace(second=0, microsecond=0)
    groups = (
        StepResult.objects.filter(at__lt=upto)
        .annotate(bucket=TruncMinute("at", tzinfo=datetime.UTC), label=memo_label())
        .values("bucket", "workflow", "label")
        .annotate(n=Count("pk"), cost=Sum("cost"), duration=Sum("duration"))
        .order_by()
    )
    CostMinute.objects.bulk_create(
        (CostMinute(minute=g["bucket"], workflow=g["workflow"], step=g["label"], steps=g["n"],
                    cost=g["cost"] or 0, duration=g["duration"] or datetime.timedelta(0))
         for g in groups.iterator()),
        batch_size=1000,
    )
    CostMark.objects.update_or_create(pk=1, defaults={"through": upto})


class Migration(migrations.Migration):

    dependencies = [
        ('durable', '0006_agents'),
    ]

    operations = [
        migrations.CreateModel(
            name='CostMark',
            fields=[
                ('id', models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False)),
                ('through', models.DateTimeField(blank=True, null=True, verbose_name='rolled up through')),
            ],
            options={
                'verbose_name': 'cost roll-up mark',
                'verbose_name_plural': 'cost roll-up mark',
            },
        ),
        migrations.CreateModel(
            name='CostMinute',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('minute', models.DateTimeField(verbose_name='minute')),
                ('workflow', models.CharField(max_length=100, verbose_name='workflow')),
                ('step', models.CharField(max_length=100, verbose_name='step')),
                ('steps', models.BigIntegerField(default=0, verbose_name='steps')),
                ('cost', models.DecimalField(decimal_places=6, default=0, max_digits=18, verbose_name='cost')),
                ('duration', models.DurationField(default=datetime.timedelta(0), verbose_name='duration')),
            ],
            options={
                'verbose_name': 'cost per minute',
                'verbose_name_plural': 'costs per minute',
                'constraints': [models.UniqueConstraint(fields=('minute', 'workflow', 'step'), name='durable_one_cost_minute')],
            },
        ),
        migrations.RunPython(roll_up_existing_memos, migrations.RunPython.noop),
    ]
