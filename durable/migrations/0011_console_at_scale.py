"""The console at scale: state moves rolled up per minute, and indexes its pages read.

(workflow, state, updated) replaces (workflow, state): a state's count, ages and oldest
job come from the index alone. The partial lease index holds leased jobs only.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable', '0005_outbox_step_cost'),
    ]

    operations = [
        migrations.CreateModel(
            name='MoveMinute',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('minute', models.DateTimeField(verbose_name='minute')),
                ('workflow', models.CharField(max_length=100, verbose_name='workflow')),
                ('from_state', models.CharField(blank=True, default='', max_length=100, verbose_name='from')),
                ('to_state', models.CharField(blank=True, default='', max_length=100, verbose_name='to')),
                ('moves', models.BigIntegerField(default=0, verbose_name='moves')),
            ],
            options={
                'verbose_name': 'state moves per minute',
                'verbose_name_plural': 'state moves per minute',
            },
        ),
        migrations.AddField(
            model_name='costmark',
            name='moves_through',
            field=models.DateTimeField(blank=True, null=True, verbose_name='state moves rolled up through'),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(fields=['workflow', 'state', 'updated'], name='durable_job_state_updated'),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('lease_owner__isnull', False)), fields=['lease_until'], name='durable_job_leased'),
        ),
        # After its replacement exists: the console never runs without one.
        migrations.RemoveIndex(
            model_name='job',
            name='durable_job_wf_state',
        ),
        migrations.AddConstraint(
            model_name='moveminute',
            constraint=models.UniqueConstraint(fields=('minute', 'workflow', 'from_state', 'to_state'), name='durable_one_move_minute'),
        ),
    ]
