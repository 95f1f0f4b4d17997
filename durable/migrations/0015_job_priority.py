"""Job priorities: the priority (-100..100, higher first), the head start it gives a job in
the claim's order (priority x DURABLE["PRIORITY_AGING"], fixed at submit), and the index
the claim reads that order from."""

import datetime

from django.db import migrations, models

import durable.models.priorities


class Migration(migrations.Migration):

    dependencies = [
        ('durable', '0014_limits'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='head_start',
            field=models.DurationField(db_default=datetime.timedelta(0), default=datetime.timedelta(0), verbose_name='head start'),
        ),
        migrations.AddField(
            model_name='job',
            name='priority',
            field=models.SmallIntegerField(db_default=0, default=0, verbose_name='priority'),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(durable.models.priorities.ClaimOrder(), models.F('next_run_at'), condition=models.Q(('next_run_at__isnull', False)), name='durable_job_claim_order'),
        ),
        migrations.AddConstraint(
            model_name='job',
            constraint=models.CheckConstraint(condition=models.Q(('priority__gte', -100), ('priority__lte', 100)), name='durable_job_priority_range'),
        ),
    ]
