"""The workers page: one row per running process, rewritten on its heartbeat."""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable', '0011_console_at_scale'),
    ]

    operations = [
        migrations.CreateModel(
            name='WorkerProcess',
            fields=[
                ('id', models.CharField(max_length=200, primary_key=True, serialize=False, verbose_name='id')),
                ('role', models.CharField(choices=[('supervisor', 'supervisor'), ('worker', 'worker'), ('dispatcher', 'dispatcher')], max_length=10, verbose_name='role')),
                ('host', models.CharField(max_length=255, verbose_name='host')),
                ('pid', models.PositiveIntegerField(verbose_name='pid')),
                ('parent', models.CharField(blank=True, default='', max_length=200, verbose_name='supervisor')),
                ('name', models.CharField(blank=True, default='', max_length=200, verbose_name='name')),
                ('started_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), verbose_name='started')),
                ('heartbeat_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), verbose_name='heartbeat')),
                ('draining_since', models.DateTimeField(blank=True, null=True, verbose_name='draining since')),
                ('slots', models.JSONField(blank=True, default=list, verbose_name='slots')),
                ('info', models.JSONField(blank=True, default=dict, verbose_name='info')),
            ],
            options={
                'verbose_name': 'worker process',
                'verbose_name_plural': 'worker processes',
                'indexes': [models.Index(fields=['heartbeat_at'], name='durable_process_heartbeat')],
            },
        ),
    ]
