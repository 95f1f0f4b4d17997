from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class DurableConfig(AppConfig):
    name = "durable"
    verbose_name = "Durable"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from . import checks  # noqa: F401 - registers the system checks

        # Like admin.py: import each installed app's workflows module, which registers
        # its Workflow subclasses and validates their transition tables.
        autodiscover_modules("workflows")
        from .tasks.backend import register_if_configured

        register_if_configured()  # the django_task workflow, when TASKS uses DurableBackend
