"""The gRPC converters and the shared memory registry, in process: no server, no network."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from geserve.errors import (
    AlreadyExistsError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from geserve.frontends.grpc import converters as convert
from geserve.service.runtime_settings import LogSettings
from geserve.service.shared_memory import SharedMemoryRegistry
from geserve.service.tracing.settings import TraceSettings
from geserve.types import InferenceResponse, OutputTensor


@pytest.fixture
def registry(tmp_path: Path) -> SharedMemoryRegistry:
    (tmp_path / "key").write_bytes(bytes(range(128)))
    return SharedMemoryRegistry(enabled=True, root=tmp_path)


def test_registry_reads_writes_and_refuses_like_triton(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    registry.register("r", "/key", 16, 64)
    assert bytes(registry.read("r", 4, 4)) == bytes([20, 21, 22, 23])
    registry.write("r", 0, 8, "OUT", b"\xff" * 8)
    assert (tmp_path / "key").read_bytes()[16:24] == b"\xff" * 8
    with pytest.raises(InternalError, match=r"\(4 bytes\) should be at least 8 bytes"):
        registry.write("r", 0, 4, "OUT", b"\x00" * 8)
    with pytest.raises(InvalidArgumentError, match="Invalid offset \\+ byte size"):
        registry.read("r", 60, 8)
    with pytest.raises(AlreadyExistsError):
        registry.register("r", "/key", 0, 8)
    with pytest.raises(InternalError, match="Invalid shared memory region"):
        registry.register("big", "/key", 0, 4096)  # past the object's end: would SIGBUS when touched
    with pytest.raises(InternalError, match="Unable to open"):
        registry.register("x", "/missing", 0, 8)
    assert [s.name for s in registry.status()] == ["r"]
    view = registry.read("r", 0, 8)
    registry.unregister("r")  # a view still held (a request in flight) does not stop the unregister
    assert bytes(view) == b"\xff" * 8
    with pytest.raises(NotFoundError):
        registry.status("r")


def test_registry_off_by_default_refuses_registration(tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(bytes(8))
    registry = SharedMemoryRegistry(enabled=False, root=tmp_path)
    with pytest.raises(UnsupportedError, match="--allow-system-shared-memory"):
        registry.register("r", "/key", 0, 8)
    assert registry.status() == []
    registry.unregister()


def test_raw_inputs_are_views_and_outputs_raw(registry: SharedMemoryRegistry) -> None:
    a = np.arange(6, dtype=np.float32)
    message = pb.ModelInferRequest(model_name="m", id="x", raw_input_contents=[a.tobytes()])
    message.inputs.add(name="IN", datatype="FP32", shape=[2, 3])
    message.outputs.add(name="OUT").parameters["classification"].int64_param = 2
    decoded = convert.from_model_infer_request(message, registry)
    tensor = decoded.request.inputs[0]
    assert decoded.request.late_fault is None and tensor.shape == (2, 3) and not tensor.data.flags.owndata
    np.testing.assert_array_equal(tensor.data, a.reshape(2, 3))
    assert decoded.request.outputs[0].classification == 2
    words = np.array([b"a", b"bc"], dtype=object)
    response = InferenceResponse("m", "1", [OutputTensor("OUT", "BYTES", (2,), words), OutputTensor(
        "F", "FP32", (2, 3), a.reshape(2, 3))])
    encoded = convert.to_model_infer_response(response, decoded.request)
    assert encoded.id == "x" and list(encoded.outputs[1].shape) == [2, 3]
    assert encoded.raw_output_contents[0] == b"\x01\x00\x00\x00a\x02\x00\x00\x00bc"
    assert encoded.raw_output_contents[1] == a.tobytes()


def test_typed_contents_and_deferred_faults(registry: SharedMemoryRegistry) -> None:
    message = pb.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="IN", datatype="INT8", shape=[1, 3])
    tensor.contents.int_contents.extend([1, -2, 3])
    decoded = convert.from_model_infer_request(message, registry)
    assert decoded.request.inputs[0].data.dtype == np.int8
    tensor.contents.int_contents.append(4)
    fault = convert.from_model_infer_request(message, registry).request.late_fault
    assert fault is not None and "Expected 3, got 4" in fault.message
    strings = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\x05\x00\x00\x00ab"])
    strings.inputs.add(name="S", datatype="BYTES", shape=[1])
    fault = convert.from_model_infer_request(strings, registry).request.late_fault
    assert fault is not None and "expecting string of length 5 but only 2 bytes available" in fault.message


def test_log_and_trace_settings_validate_then_apply() -> None:
    log = LogSettings()
    with pytest.raises(InvalidArgumentError, match="expect int32 for 'log_verbose_level'"):
        log.update({"log_verbose_level": True, "log_info": False})
    assert log.get()["log_info"] is True  # nothing applied when one change is refused
    assert log.update({"log_verbose_level": 2})["log_verbose_level"] == 2
    log.update({"log_verbose_level": 0})
    trace = TraceSettings()
    assert trace.update({"trace_rate": ["5"]}, "m")["trace_rate"] == ["5"]
    assert trace.get()["trace_rate"] == ["1000"]
    assert trace.update({"trace_rate": []}, "m")["trace_rate"] == ["1000"]
    with pytest.raises(InvalidArgumentError, match="trace file name is not given"):  # no --trace-config file
        trace.update({"trace_level": ["TIMESTAMPS"]})
    with pytest.raises(UnsupportedError, match="trace file location can not be updated"):
        trace.update({"trace_file": ["/tmp/x.json"]})


def test_registry_real_dev_shm_round_trip() -> None:
    path = Path("/dev/shm") / f"geserve-unit-{os.getpid()}"
    path.write_bytes(bytes(32))
    try:
        registry = SharedMemoryRegistry(enabled=True)
        registry.register("r", "/" + path.name, 0, 32)
        registry.write("r", 8, 8, "OUT", b"12345678")
        assert path.read_bytes()[8:16] == b"12345678"
        registry.close()
    finally:
        path.unlink()


# ---- issue 12: malformed messages, Triton's newer texts, faults the fuzzer found ---------------------------


def test_bytes_that_do_not_parse_become_unparsable_not_an_exception() -> None:
    """grpc.aio answers a deserializer's exception UNKNOWN before the servicer runs; the tolerant parser hands the
    servicer an `Unparsable` instead, which it answers INVALID_ARGUMENT."""
    parse = convert.tolerant_parser(pb.ModelInferRequest)
    assert parse(pb.ModelInferRequest(model_name="m").SerializeToString()).model_name == "m"
    for garbage in (b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xc3\x28", b"\x08" + b"\x80" * 10):
        parsed = parse(garbage)
        assert type(parsed) is convert.Unparsable, garbage
        error = parsed.error()
        assert isinstance(error, InvalidArgumentError)
        assert error.message.startswith("Unable to parse request: Error parsing message with type "
                                        "'inference.ModelInferRequest'")


def test_every_rpc_is_registered_with_a_tolerant_parser() -> None:
    from geserve.frontends.grpc.server import GrpcInferenceServicer, inference_handler

    servicer = GrpcInferenceServicer(None)  # type: ignore[arg-type]  # registration reads no service
    handler = inference_handler(servicer)
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        details = type("Details", (), {"method": f"/inference.GRPCInferenceService/{method.name}"})()
        rpc = handler.service(details)
        assert rpc is not None, method.name
        assert type(rpc.request_deserializer(b"\xff\xff")) is convert.Unparsable, method.name
        assert rpc.request_streaming == method.client_streaming, method.name


def test_a_shape_past_int64_elements_is_refused_at_decoding(registry: SharedMemoryRegistry) -> None:
    message = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 4])
    message.inputs.add(name="IN", datatype="INT32", shape=[2**62, 2**62])
    with pytest.raises(InvalidArgumentError) as caught:
        convert.from_model_infer_request(message, registry)
    assert caught.value.message == (
        f"input 'IN' with shape [{2**62},{2**62}] causes total element count to exceed maximum size of {2**63 - 1}"
    )


def test_a_shape_past_int64_bytes_is_refused_at_decoding_as_http_refuses_it(registry: SharedMemoryRegistry) -> None:
    message = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 4])
    message.inputs.add(name="IN", datatype="INT32", shape=[4, 2**60 + 2])
    with pytest.raises(InvalidArgumentError) as caught:
        convert.from_model_infer_request(message, registry)
    assert caught.value.message == "byte size overflow for input 'IN'"


def test_outputs_named_twice_reach_the_service_as_sent(registry: SharedMemoryRegistry) -> None:
    """The refusal is the service's rule (validation.prepare), the same for every protocol: the converter keeps
    both."""
    message = pb.ModelInferRequest(model_name="m")
    message.outputs.add(name="OUT")
    message.outputs.add(name="OUT")
    request = convert.from_model_infer_request(message, registry).request
    assert [o.name for o in request.outputs or ()] == ["OUT", "OUT"]


def test_a_key_with_a_nul_is_a_key_that_does_not_open(registry: SharedMemoryRegistry) -> None:
    """Found by tests/test_fuzz.py: os.open raised ValueError (not OSError) for it, answered as an internal error."""
    with pytest.raises(InternalError, match="Unable to open shared memory region"):
        registry.register("r", "/k\x00ey", 0, 8)
