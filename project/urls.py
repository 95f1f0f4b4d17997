from django.contrib import admin
from django.urls import path

from durable.metrics import metrics_view

from . import views

urlpatterns = [
    path("", views.home, name="home"),
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="durable-metrics"),
]
