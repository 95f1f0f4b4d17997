"""URLs of the signal webhook: ``path("hooks/durable/", include("durable.hooks.urls"))``."""

from django.urls import path

from . import views

app_name = "durable_hooks"

urlpatterns = [
    path("<str:source>/", views.receive, name="receive"),
]
