"""Prometheus metrics: configuration, exposition, latency recorders and the store of Python models' custom families.

The scrape-time collector (`geserve.metrics.collector`) reads the repository and sits in the service layer; it is
not re-exported here, so backends can import the custom-metric store without pulling the repository in.
"""

from geserve.metrics.config import MetricsConfig
from geserve.metrics.custom import CustomMetricError, CustomMetricStore
from geserve.metrics.exposition import CONTENT_TYPE, render

__all__ = ["CONTENT_TYPE", "CustomMetricError", "CustomMetricStore", "MetricsConfig", "render"]
