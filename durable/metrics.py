"""The Prometheus view: ``path("metrics", durable.metrics.metrics_view)``.

The collector is in ``durable.reads.metrics``.
"""

from .reads.metrics import metrics_view

__all__ = ["metrics_view"]
