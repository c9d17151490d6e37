"""The servicer registration Ray's gRPC proxy imports (`grpc_servicer_functions`), with Triton's messages made
picklable: the proxy pickles each request to hand it to a replica.

tritonclient's generated messages name their modules `grpc_service_pb2` / `model_config_pb2` (the .proto files'
names), which no import finds, so pickle cannot find the classes again; aliasing those names to tritonclient's
modules in every process that pickles or unpickles them (the proxy through this module, a replica through
ray_grpc) fixes that without changing the messages. Kept small: the proxy process imports it.
"""

from __future__ import annotations

import sys
from typing import Any

from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

sys.modules.setdefault("grpc_service_pb2", service_pb2)
sys.modules.setdefault("model_config_pb2", model_config_pb2)

SERVICER_FUNCTION = f"{__name__}.add_inference_service"


def add_inference_service(servicer: Any, server: Any) -> None:
    """tritonclient's add_GRPCInferenceServiceServicer_to_server, imported through this module."""
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
