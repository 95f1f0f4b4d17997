from django.contrib import admin

from .models import Approval, Job, JobEvent, Outbox, Pause, StepResult


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["id", "workflow", "state", "attempts", "next_run_at", "lease_owner",
                    "lease_until", "updated"]
    list_filter = ["workflow", "state"]
    search_fields = ["id"]
    readonly_fields = [f.name for f in Job._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


for model in (StepResult, Outbox, Approval, JobEvent, Pause):
    admin.site.register(model)
