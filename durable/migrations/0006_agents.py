# Agent workflows: memo rows per model and tool call (key, kind, tokens, cost), bounds on jobs.

import django.core.serializers.json
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable', '0008_signals_and_children'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='job',
            options={'permissions': [('view_payload', 'Can see job payloads and outputs unredacted'), ('requeue_job', 'Can requeue a failed job'), ('retry_job', 'Can retry a job now'), ('cancel_job', 'Can cancel a job'), ('send_back_job', 'Can send back a job that needs a human'), ('replay_step', 'Can replay a step and replace its memo'), ('pause_workflow', 'Can pause and resume workflows'), ('send_signal', 'Can deliver a signal to a job by hand'), ('grant_job', 'Can grant an agent more turns or budget')], 'verbose_name': 'job', 'verbose_name_plural': 'jobs'},
        ),
        migrations.AddField(
            model_name='approval',
            name='turn',
            field=models.PositiveIntegerField(blank=True, null=True, verbose_name='turn'),
        ),
        migrations.AddField(
            model_name='job',
            name='budget',
            field=models.DecimalField(blank=True, decimal_places=6, max_digits=18, null=True, verbose_name='budget'),
        ),
        migrations.AddField(
            model_name='job',
            name='progress',
            field=models.JSONField(blank=True, encoder=django.core.serializers.json.DjangoJSONEncoder, null=True, verbose_name='progress'),
        ),
        migrations.AddField(
            model_name='job',
            name='turn_limit',
            field=models.PositiveIntegerField(blank=True, null=True, verbose_name='turn limit'),
        ),
        migrations.AddField(
            model_name='outbox',
            name='step_key',
            field=models.CharField(blank=True, db_default='', default='', max_length=200, verbose_name='key'),
        ),
        migrations.AddField(
            model_name='stepresult',
            name='fingerprint',
            field=models.CharField(blank=True, db_default='', default='', max_length=64, verbose_name='input fingerprint'),
        ),
        migrations.AddField(
            model_name='stepresult',
            name='input_tokens',
            field=models.PositiveIntegerField(db_default=0, default=0, verbose_name='tokens in'),
        ),
        migrations.AddField(
            model_name='stepresult',
            name='kind',
            field=models.CharField(choices=[('step', 'step'), ('model', 'model call'), ('tool', 'tool call'), ('action', 'action'), ('call', 'call'), ('patch', 'patch marker')], db_default='step', default='step', max_length=10, verbose_name='kind'),
        ),
        migrations.AddField(
            model_name='stepresult',
            name='model',
            field=models.CharField(blank=True, db_default='', default='', max_length=100, verbose_name='model'),
        ),
        migrations.AddField(
            model_name='stepresult',
            name='name',
            field=models.CharField(blank=True, db_default='', default='', max_length=100, verbose_name='name'),
        ),
        migrations.AddField(
            model_name='stepresult',
            name='output_tokens',
            field=models.PositiveIntegerField(db_default=0, default=0, verbose_name='tokens out'),
        ),
        migrations.AddField(
            model_name='stepresult',
            name='seq',
            field=models.PositiveIntegerField(db_default=0, default=0, verbose_name='order'),
        ),
        migrations.AddField(
            model_name='stepresult',
            name='turn',
            field=models.PositiveIntegerField(db_default=0, default=0, verbose_name='turn'),
        ),
        migrations.AlterField(
            model_name='approval',
            name='step',
            field=models.CharField(max_length=200, verbose_name='step'),
        ),
        migrations.AlterField(
            model_name='jobevent',
            name='step',
            field=models.CharField(blank=True, default='', max_length=200, verbose_name='step or key'),
        ),
        migrations.AlterField(
            model_name='stepresult',
            name='step',
            field=models.CharField(max_length=200, verbose_name='key'),
        ),
    ]
