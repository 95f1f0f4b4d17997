from django.contrib import admin
from django.urls import include, path

from durable.reads.metrics import metrics_view

from . import views

urlpatterns = [
    path("", views.home, name="home"),
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="durable-metrics"),
    # Signals from other systems (sources in DURABLE["WEBHOOKS"]).
    path("hooks/durable/", include("durable.hooks.urls")),
]
