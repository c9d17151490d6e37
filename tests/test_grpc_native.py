"""The native gRPC server (frontends/grpc/h2_server.py) against a real geserve process: it answers as grpc.aio does
(`--grpc-server grpcio`, run side by side), with the real tritonclient (sync, asyncio, streaming) and grpcio's own
stubs, and holds up to what only a raw HTTP/2 client can send (garbage, ping floods, too many streams)."""

from __future__ import annotations

import asyncio
import queue
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from geserve.frontends.grpc.h2_connection import HeaderDecoder, grpc_message
from geserve.frontends.grpc.h2_context import CallError, H2Call
from geserve.frontends.grpc.h2_server import NativeGrpcServer
from geserve.frontends.grpc.health import SERVING, HealthCheckRequest, HealthCheckResponse
from geserve.frontends.grpc.server import GrpcOptions
from tests.support import models
from tests.support.server import RunningServer, geserve
from tests.test_grpc_client import A, B, simple_inputs

MAX_STREAMS = 8
LIVE = "/inference.GRPCInferenceService/ServerLive"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("grpc_native") / "models"
    models.simple(repo)
    models.identity(repo, "fp16")
    return repo


@pytest.fixture(scope="module")
def native(repo: Path) -> Iterator[RunningServer]:
    # Keepalive pings every 0.5 s, answered within 1 s, on idle connections too: the raw-client tests see them.
    flags = ["--grpc-max-concurrent-streams", str(MAX_STREAMS), "--grpc-keepalive-time", "500",
             "--grpc-keepalive-timeout", "1000", "--grpc-keepalive-permit-without-calls"]
    with geserve([repo], repo.parent / "native.log", flags) as running:
        yield running


@pytest.fixture(scope="module")
def grpcio(repo: Path) -> Iterator[RunningServer]:
    with geserve([repo], repo.parent / "grpcio.log", ["--grpc-server", "grpcio"]) as running:
        yield running


def outcomes(url: str) -> list[Any]:
    """What a handful of RPCs answer, successes and failures, in a form two servers can be compared by."""
    seen: list[Any] = []
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        seen.append(stub.ServerLive(pb.ServerLiveRequest()).live)
        seen.append(stub.ModelReady(pb.ModelReadyRequest(name="simple")).ready)
        metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name="simple"))
        seen.append(metadata.SerializeToString(deterministic=True))
        for call in (
            lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="nope")),
            lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="n\u00f6pe \u2603 100%")),  # grpc-message encoding
            lambda: stub.ModelInfer(pb.ModelInferRequest(model_name="nope")),
            lambda: stub.ModelInfer(pb.ModelInferRequest(model_name="simple")),  # no inputs
            lambda: channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(b"\xff\xff\xff"),
            lambda: channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")(b""),
            lambda: channel.unary_unary("/no.Such/Service")(b""),
        ):
            with pytest.raises(grpc.RpcError) as failed:
                call()
            seen.append((failed.value.code(), failed.value.details()))
    with grpcclient.InferenceServerClient(url) as client:
        result = client.infer("simple", simple_inputs(), request_id="7")
        outputs = [result.as_numpy(name).tolist() for name in ("OUTPUT0", "OUTPUT1")]
        seen.append((result.get_response().id, outputs))
    return seen


def test_both_servers_answer_alike(native: RunningServer, grpcio: RunningServer) -> None:
    assert "native HTTP/2" in native.log() and "native HTTP/2" not in grpcio.log()
    theirs, ours = outcomes(grpcio.grpc_url), outcomes(native.grpc_url)
    assert ours == theirs
    assert ours[3][0] == ours[4][0] == grpc.StatusCode.NOT_FOUND
    assert "n\u00f6pe \u2603 100%" in ours[4][1]
    assert ours[7][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert ours[8:10] == [(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")] * 2


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request(native: RunningServer, algorithm: str) -> None:
    with grpcclient.InferenceServerClient(native.grpc_url) as client:
        result = client.infer("simple", simple_inputs(), compression_algorithm=algorithm)
    assert (result.as_numpy("OUTPUT0") == A + B).all()


def test_messages_larger_than_the_flow_control_windows(native: RunningServer) -> None:
    """6 MB each way: more than the client's initial window (64 KiB) and than ours (4 MiB) for the request."""
    data = np.random.default_rng(0).standard_normal((1, 3_000_000)).astype(np.float16)
    tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP16")
    tensor.set_data_from_numpy(data)
    with grpcclient.InferenceServerClient(native.grpc_url) as client:
        for _ in range(2):
            result = client.infer("identity_fp16", [tensor])
            assert np.array_equal(result.as_numpy("OUTPUT0"), data)


def test_a_stream_of_many_requests(native: RunningServer) -> None:
    count = 300

    async def run() -> list[str]:
        async with aioclient.InferenceServerClient(native.grpc_url) as client:
            async def requests() -> Any:
                for index in range(count):
                    inputs = []
                    for name, value in (("INPUT0", A + index), ("INPUT1", B)):
                        tensor = aioclient.InferInput(name, list(value.shape), "INT32")
                        tensor.set_data_from_numpy(value)
                        inputs.append(tensor)
                    yield {"model_name": "simple", "inputs": inputs, "request_id": str(index)}

            ids = []
            async for result, error in client.stream_infer(requests()):
                assert error is None
                index = int(result.get_response().id)
                assert (result.as_numpy("OUTPUT0") == A + index + B).all()
                ids.append(result.get_response().id)
                if len(ids) == count:
                    break
            return ids

    assert sorted(asyncio.run(run()), key=int) == [str(i) for i in range(count)]


def _stream_cases() -> list[pb.ModelInferRequest]:
    """Requests a stream answers at once (the model runs on the loop) alongside ones it refuses, each in its way."""

    def request(rid: str, model: str = "simple", shape: tuple[int, ...] = (1, 16), datatype: str = "INT32",
                names: tuple[str, ...] = ("INPUT0", "INPUT1"), version: str = "") -> pb.ModelInferRequest:
        message = pb.ModelInferRequest(model_name=model, model_version=version, id=rid)
        for name in names:
            message.inputs.add(name=name, datatype=datatype, shape=list(shape))
            message.raw_input_contents.append(np.full(shape, int(rid[-1]), np.int32).tobytes())
        return message

    return [request("ok1"), request("shape2", shape=(1, 8)), request("ok3", version="1"),
            request("missing4", names=("INPUT0",)), request("type5", datatype="FP32"), request("model6", model="nope"),
            request("ok7")]


def _unary_answers(url: str, cases: list[pb.ModelInferRequest]) -> list[Any]:
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(cases[0])  # a first run: the model's typical run time is known, it runs on the loop from here
        answers: list[Any] = []
        for message in cases:
            try:
                answers.append(list(stub.ModelInfer(message).raw_output_contents))
            except grpc.RpcError as exc:
                answers.append((exc.code(), exc.details()))
        return answers


def test_unary_calls_answered_in_the_callback_answer_as_grpcio_does(
    native: RunningServer, grpcio: RunningServer
) -> None:
    """The native server answers a warm model's ModelInfer in its read callback (the servicer's infer_now); grpc.aio
    runs the servicer's ModelInfer: successes and each kind of refusal come out the same."""
    cases = _stream_cases()
    assert _unary_answers(native.grpc_url, cases) == _unary_answers(grpcio.grpc_url, cases)


def test_a_stream_answers_each_request_as_a_unary_call_does(native: RunningServer) -> None:
    """Streamed requests, most answered as they are read, get what the same requests get as unary calls: the same
    outputs, and each refusal's message in-band; the model counts each success once."""
    cases = _stream_cases()
    with grpc.insecure_channel(native.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        unary: dict[str, Any] = {}
        for message in cases:
            try:
                response = stub.ModelInfer(message)
                unary[message.id] = list(response.raw_output_contents)
            except grpc.RpcError as exc:
                unary[message.id] = exc.details()
        before = stub.ModelStatistics(pb.ModelStatisticsRequest(name="simple")).model_stats[0].inference_count
        streamed: dict[str, Any] = {}
        for answer in stub.ModelStreamInfer(iter(cases)):
            streamed[answer.infer_response.id or answer.error_message] = (
                answer.error_message or list(answer.infer_response.raw_output_contents))
        after = stub.ModelStatistics(pb.ModelStatisticsRequest(name="simple")).model_stats[0].inference_count
    assert sorted(v for v in streamed.values() if isinstance(v, str)) == sorted(
        v for v in unary.values() if isinstance(v, str))
    assert [streamed[rid] for rid in ("ok1", "ok3", "ok7")] == [unary[rid] for rid in ("ok1", "ok3", "ok7")]
    assert after - before == 3


def health(channel: grpc.Channel) -> tuple[Any, Any]:
    coding = {"request_serializer": HealthCheckRequest.SerializeToString,
              "response_deserializer": HealthCheckResponse.FromString}
    check = channel.unary_unary("/grpc.health.v1.Health/Check", **coding)
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch", **coding)
    return check, watch


def test_health_check_and_watch(native: RunningServer) -> None:
    with grpc.insecure_channel(native.grpc_url) as channel:
        check, watch = health(channel)
        assert check(HealthCheckRequest(service="")).status == SERVING
        with pytest.raises(grpc.RpcError) as failed:
            check(HealthCheckRequest(service="other"))
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        updates = watch(HealthCheckRequest(service="inference.GRPCInferenceService"))
        assert next(updates).status == SERVING
        updates.cancel()


def test_cancelled_calls_and_deadlines_leave_other_calls_alone(native: RunningServer) -> None:
    """Watch never ends by itself: cancelling it, or its deadline passing, ends it mid-call (RST_STREAM)."""
    with grpc.insecure_channel(native.grpc_url) as channel:
        _, watch = health(channel)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        watches = [watch(HealthCheckRequest(service="")) for _ in range(3)]
        assert all(next(updates).status == SERVING for updates in watches)
        watches[0].cancel()
        expiring = watch(HealthCheckRequest(service=""), timeout=0.3)
        assert next(expiring).status == SERVING
        with pytest.raises(grpc.RpcError) as failed:
            next(expiring)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stub.ServerLive(pb.ServerLiveRequest()).live
        for updates in watches[1:]:
            updates.cancel()
    errors: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(native.grpc_url) as client:
        client.start_stream(callback=lambda result, error: errors.put(error), stream_timeout=0.5)
        client.async_stream_infer("simple", simple_inputs())
        assert errors.get(timeout=5) is None  # answered; then the stream stays open past its deadline
        late = errors.get(timeout=5)
        client.stop_stream()
        assert isinstance(late, InferenceServerException) and "Deadline" in str(late)
        assert (client.infer("simple", simple_inputs()).as_numpy("OUTPUT1") == A - B).all()


# ---- a raw HTTP/2 client: what no well-behaved client sends ---------------------------------------------------


class RawClient:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.send()

    def send(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def start_call(self, path: str = LIVE, extra: tuple[tuple[str, str], ...] = ()) -> int:
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                        (":authority", "localhost"), ("content-type", "application/grpc"),
                                        ("te", "trailers"), *extra])
        return stream

    def unary(self, path: str, message: bytes, extra: tuple[tuple[str, str], ...] = ()) -> dict[bytes, bytes]:
        """One unary call: its response headers and trailers together."""
        stream = self.start_call(path, extra)
        self.conn.send_data(stream, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
        self.send()
        events = self.events(until=h2.events.StreamEnded | h2.events.StreamReset)
        answer = {bytes(key): bytes(value) for event in events
                  if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived)
                  for key, value in event.headers}
        if any(isinstance(event, h2.events.StreamReset) for event in events):
            answer[b":reset"] = b"1"
        return answer

    def events(self, until: Any, answer: bool = True, timeout: float = 5.0) -> list[Any]:
        """Events received until one of type `until` (or the connection closes, or `timeout`)."""
        seen: list[Any] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not data:
                seen.append("closed")
                break
            seen.extend(self.conn.receive_data(data))
            if answer:
                try:
                    self.send()
                except OSError:  # the server closed its side
                    answer = False
            if any(isinstance(event, until) for event in seen):
                break
        return seen

    def close(self) -> None:
        self.sock.close()


def assert_serving(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.is_server_live()


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n", b"\x00" * 100])
def test_garbage_and_truncated_prefaces_do_not_hurt_the_server(native: RunningServer, garbage: bytes) -> None:
    with socket.create_connection(("127.0.0.1", native.grpc_port), timeout=5) as sock:
        sock.sendall(garbage)
    assert_serving(native)


def test_a_wrong_content_type_is_415_and_a_call_cut_off_is_forgotten(native: RunningServer) -> None:
    client = RawClient(native.grpc_port)
    stream = client.conn.get_next_available_stream_id()
    client.conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", LIVE),
                                      (":authority", "x"), ("content-type", "application/json")], end_stream=True)
    client.start_call()  # a call whose request never comes: the connection closes under it
    client.send()
    events = client.events(until=h2.events.ResponseReceived)
    response = next(event for event in events if isinstance(event, h2.events.ResponseReceived))
    assert (b":status", b"415") in response.headers
    client.close()
    assert_serving(native)


def test_streams_past_the_limit_are_refused_not_the_connection(native: RunningServer) -> None:
    client = RawClient(native.grpc_port)  # sends before reading the server's SETTINGS, as a careless client would
    streams = [client.start_call() for _ in range(MAX_STREAMS + 2)]
    client.send()
    events = client.events(until=h2.events.StreamReset)
    refused = [event.stream_id for event in events if isinstance(event, h2.events.StreamReset)]
    assert refused and set(refused) <= set(streams[MAX_STREAMS:])
    assert all(event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
               for event in events if isinstance(event, h2.events.StreamReset))
    client.conn.send_data(streams[0], b"\x00\x00\x00\x00\x00", end_stream=True)  # an empty ServerLiveRequest
    client.send()
    events = client.events(until=h2.events.TrailersReceived)
    trailers = next(event for event in events if isinstance(event, h2.events.TrailersReceived))
    assert (b"grpc-status", b"0") in trailers.headers
    client.close()


def test_a_ping_flood_ends_with_too_many_pings(native: RunningServer) -> None:
    """No call under way: a client may ping once per two hours; the default 2 strikes are allowed, the third not."""
    client = RawClient(native.grpc_port)
    for index in range(4):
        client.conn.ping(b"flood%03d" % index)
    client.send()
    events = client.events(until=h2.events.ConnectionTerminated)
    goaway = next(event for event in events if isinstance(event, h2.events.ConnectionTerminated))
    assert goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert goaway.additional_data == b"too_many_pings"
    client.close()


def test_keepalive_pings_and_closes_a_silent_peer(native: RunningServer) -> None:
    client = RawClient(native.grpc_port)
    events = client.events(until=h2.events.PingReceived, answer=False, timeout=3)
    assert any(isinstance(event, h2.events.PingReceived) for event in events)
    events = client.events(until=h2.events.ConnectionTerminated, answer=False, timeout=3)
    assert "closed" in events  # the ping went unanswered for the keepalive timeout (1 s)
    client.close()
    assert_serving(native)


# ---- pieces, without a server ----------------------------------------------------------------------------------


def test_the_fast_header_decoder_decodes_as_hpack_does() -> None:
    """Blocks a client repeating calls sends (all indexed: the fast path) and first ones (literals: hpack's path)."""
    encoder, ours, theirs = hpack.Encoder(), HeaderDecoder(), hpack.Decoder()
    calls = [[(b":method", b"POST"), (b":path", b"/a.B/C"), (b"x-key", b"v%d" % (index % 3)), (b"te", b"trailers")]
             for index in range(12)]
    fast = 0
    for headers in calls:
        block = encoder.encode(headers)
        fast += not block.translate(None, bytes(range(0x81, 0xFF)))
        assert ours.decode(block, raw=True) == theirs.decode(block, raw=True) == headers
    assert fast >= 8
    with pytest.raises(hpack.HPACKDecodingError):
        ours.decode(b"\xfe", raw=True)  # an index past both tables


def test_grpc_message_is_percent_encoded_as_the_spec_says() -> None:
    assert grpc_message("plain words") == b"plain words"
    assert grpc_message("100% \u00e9") == b"100%25 %C3%A9"


def _call(max_receive: int) -> H2Call:
    return H2Call(SimpleNamespace(max_receive=max_receive), 1, None, [], None, None)  # type: ignore[arg-type]


def _framed(message: bytes) -> bytes:
    return struct.pack("!BI", 0, len(message)) + message


def test_messages_are_taken_whole_however_the_frames_cut_them() -> None:
    """Messages cut inside their 5-byte prefix, spread over many frames, or two in one frame come out whole and in
    order; nothing is left held after the last."""
    big, small = bytes(range(256)) * 4096, b"tiny"  # 1 MiB and 4 bytes
    stream = _framed(big) + _framed(small) + _framed(b"")
    for cut in (3, 1000, 16384, len(stream)):
        call, taken = _call(len(big)), []
        for start in range(0, len(stream), cut):
            taken += call.take_messages(stream[start:start + cut])
        assert taken == [big, small, b""] and not call.buffer


def test_a_message_over_the_limit_is_refused_as_soon_as_its_length_is_known() -> None:
    call = _call(1024)
    assert call.take_messages(_framed(b"x" * 2048)[:3]) == []
    with pytest.raises(CallError, match=r"larger than max \(2048 vs. 1024\)"):
        call.take_messages(b"\x08\x00x")  # the rest of its prefix: 2048 bytes


class _ReadyService:
    """A stand-in for the inference service: only the transport's adoption is under test, and health asks only this."""

    def ready(self, context: Any) -> bool:
        return True


def test_a_connection_accepted_elsewhere_is_served_and_its_close_reported() -> None:
    """--workers: the supervisor accepts and hands a worker the socket (`adopt`); here the test accepts it."""
    async def run() -> tuple[int, int]:
        server = NativeGrpcServer(_ReadyService(), GrpcOptions(port=0), adopting=True)  # type: ignore[arg-type]
        await server.start()
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        closed: list[int] = []
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{listener.getsockname()[1]}") as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                        request_serializer=HealthCheckRequest.SerializeToString,
                                        response_deserializer=HealthCheckResponse.FromString)
            answer = asyncio.ensure_future(check(HealthCheckRequest(service="")))
            sock, _ = await loop.sock_accept(listener)
            server.adopt(sock, lambda: closed.append(1))
            status = (await answer).status
        for _ in range(100):
            if closed:
                break
            await asyncio.sleep(0.02)
        listener.close()
        await server.stop(0)
        return status, len(closed)

    assert asyncio.run(run()) == (SERVING, 1)
