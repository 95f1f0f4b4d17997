"""Approvals of an agent's tool calls: the model's message on a rejection, edited arguments,
and the records a proposal was prepared from."""

import django.core.serializers.json
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("durable", "0012_workers"),
    ]

    operations = [
        migrations.AddField(
            model_name="approval",
            name="model_message",
            field=models.TextField(blank=True, default="", verbose_name="message to the model"),
        ),
        migrations.AddField(
            model_name="approval",
            name="arguments",
            field=models.JSONField(blank=True, encoder=django.core.serializers.json.DjangoJSONEncoder,
                                   null=True, verbose_name="arguments"),
        ),
        migrations.AddField(
            model_name="approval",
            name="sources",
            field=models.JSONField(blank=True, default=list,
                                   encoder=django.core.serializers.json.DjangoJSONEncoder,
                                   verbose_name="prepared from"),
        ),
        migrations.AddField(
            model_name="approval",
            name="edited_from",
            field=models.ForeignKey(blank=True, null=True,
                                    on_delete=django.db.models.deletion.SET_NULL,
                                    related_name="+", to="durable.approval",
                                    verbose_name="edited from"),
        ),
    ]
