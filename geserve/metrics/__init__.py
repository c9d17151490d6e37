"""Prometheus metrics: Triton's nv_* families and geserve's ge_* ones, read from the server at scrape time."""

from geserve.metrics.collector import InferenceCollector, build_registry
from geserve.metrics.config import MetricsConfig
from geserve.metrics.custom import CustomMetricError, CustomMetricStore
from geserve.metrics.exposition import CONTENT_TYPE, render

__all__ = [
    "CONTENT_TYPE", "CustomMetricError", "CustomMetricStore", "InferenceCollector", "MetricsConfig", "build_registry",
    "render",
]
