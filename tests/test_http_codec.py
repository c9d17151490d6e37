"""The HTTP wire codec on its own: JSON and binary tensors, BYTES framing, raw bodies, response encoding."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from geserve.errors import InvalidArgumentError
from geserve.frontends.http.codec import (
    RequestParseError,
    decode_infer_request,
    encode_infer_response,
    json_depth,
    parse_json,
    tensor_bytes,
)
from geserve.types import InferenceResponse, OutputTensor


def _body(header: dict, *binaries: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + b"".join(binaries), len(head)


def test_binary_inputs_are_views_of_the_body_not_copies() -> None:
    a = np.arange(8, dtype=np.float32)
    body, length = _body(
        {"inputs": [{"name": "a", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": 32}},
                    {"name": "b", "shape": [1], "datatype": "INT64", "data": [7]}]},
        a.tobytes(),
    )
    request = decode_infer_request(body, length, "m", "")
    tensor = request.inputs[0]
    assert tensor.shape == (2, 4) and np.shares_memory(tensor.data, np.frombuffer(body, np.uint8))
    np.testing.assert_array_equal(tensor.data.reshape(-1), a)
    assert request.inputs[1].data.tolist() == [7]


def test_bytes_tensors_use_length_prefixes() -> None:
    items = [b"hi", b"", b"\x00\xff"]
    raw = b"".join(struct.pack("<I", len(v)) + v for v in items)
    body, length = _body(
        {"inputs": [{"name": "s", "shape": [3], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}]},
        raw,
    )
    tensor = decode_infer_request(body, length, "m", "").inputs[0]
    assert tensor.data.tolist() == items
    assert tensor_bytes(OutputTensor("s", "BYTES", (3,), tensor.data)) == raw


@pytest.mark.parametrize(
    ("header", "binary"),
    [
        ({"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 4}}]},
         b"\0" * 4),
        ({"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]},
         b"\0" * 12),
        ({"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "data": [1, 2, 3]}]}, b""),
        ({"inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "data": ["x", "y"]}]}, b""),
        ({"inputs": [{"name": "a", "shape": [2], "datatype": "FLOAT", "data": [1, 2]}]}, b""),
        ({"inputs": [{"name": "a", "shape": [-2], "datatype": "FP32", "data": []}]}, b""),
        ({"inputs": [{"name": "s", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 5}}]},
         struct.pack("<I", 1) + b"x"),
        ({"inputs": [{"name": "a", "shape": [1], "datatype": "UINT8", "data": [300]}]}, b""),
        ({"inputs": []}, b"extra"),
        ({"no_inputs": []}, b""),
    ],
    ids=["short-binary", "unclaimed-bytes", "data-count", "data-type", "bad-datatype", "negative-dim",
         "bytes-overrun", "out-of-range", "trailing-binary", "no-inputs"],
)
def test_malformed_requests_are_invalid_argument(header: dict, binary: bytes) -> None:
    body, length = _body(header, binary)
    with pytest.raises(InvalidArgumentError):
        decode_infer_request(body, length, "m", "")


@pytest.mark.parametrize(("count", "raw", "message"), [
    (2, struct.pack("<I", 1) + b"x", "unexpected end of BYTES data for input 's' at element 1"),
    (1, b"\x01\x00", "unexpected end of BYTES data for input 's' at element 0"),
    (1, struct.pack("<I", 10) + b"abc", "BYTES element 0 of input 's' runs past its binary data"),
    (1, (struct.pack("<I", 1) + b"x") * 2, "input 's' has 5 bytes of BYTES data beyond the 1 elements its shape holds"),
], ids=["missing-element", "cut-length", "cut-element", "extra-element"])
def test_bytes_framing_errors_name_the_element(count: int, raw: bytes, message: str) -> None:
    header = {"inputs": [{"name": "s", "shape": [count], "datatype": "BYTES",
                          "parameters": {"binary_data_size": len(raw)}}]}
    body, length = _body(header, raw)
    with pytest.raises(InvalidArgumentError) as caught:
        decode_infer_request(body, length, "m", "")
    assert caught.value.message == message


def test_malformed_json_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="failed to parse"):
        decode_infer_request(b'{"inputs": [', None, "m", "")


def test_response_binary_and_json_outputs() -> None:
    request = decode_infer_request(
        json.dumps({"id": "7", "inputs": [], "outputs": [{"name": "x", "parameters": {"binary_data": True}},
                                                          {"name": "y"}]}).encode(),
        None, "m", "",
    )
    x = np.arange(3, dtype=np.int32)
    y = np.array([0.5, 1.5], dtype=np.float16)
    outputs = [OutputTensor("x", "INT32", (3,), x), OutputTensor("y", "FP16", (2,), y)]
    response = InferenceResponse("m", "1", outputs, "7")
    parts, length = encode_infer_response(response, request)
    body = b"".join(bytes(p) for p in parts)
    header = json.loads(body[:length])
    assert header["id"] == "7" and header["model_version"] == "1"
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert header["outputs"][1]["data"] == [0.5, 1.5]
    assert body[length:] == x.tobytes()


def test_binary_data_output_parameter_makes_every_output_binary() -> None:
    request = decode_infer_request(
        json.dumps({"inputs": [], "parameters": {"binary_data_output": True}}).encode(), None, "m", ""
    )
    response = InferenceResponse("m", "1", [OutputTensor("x", "BOOL", (2,), np.array([True, False]))])
    parts, length = encode_infer_response(response, request)
    assert length is not None and bytes(parts[1]) == b"\x01\x00"


# ---- issue 12: Triton's newer texts, and faults the fuzzer found ------------------------------------------

_INT64_MAX = 2**63 - 1


def _simple_json(**extra: object) -> bytes:
    tensor = {"name": "a", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}
    return json.dumps({"inputs": [{**tensor, **extra}]}).encode()


@pytest.mark.parametrize("shape", [[2**62, 2**62], [16, 2**60 + 2], [2**63], [3, 2**62, 0]],
                         ids=["square", "tritons-own-case", "one-dim", "past-int64-before-a-zero"])
def test_a_shape_past_int64_elements_is_refused_in_tritons_words(shape: list[int]) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        decode_infer_request(_simple_json(shape=shape), None, "m", "")
    assert caught.value.message == (
        f"input 'a' with shape [{','.join(map(str, shape))}] causes total element count to exceed maximum size of "
        f"{_INT64_MAX}"
    )


@pytest.mark.parametrize(("datatype", "shape"), [
    ("INT32", [4, 2**60 + 2]),  # Triton's qa test_buffer_size_overflow: 2**62 + 8 elements, 2**64 + 32 bytes
    ("FP64", [2**60]),  # 2**60 elements, 2**63 bytes: one past int64
])
def test_a_shape_whose_byte_size_passes_int64_is_refused_in_tritons_words(datatype: str, shape: list[int]) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        decode_infer_request(_simple_json(shape=shape, datatype=datatype), None, "m", "")
    assert caught.value.message == "byte size overflow for input 'a'"


def test_the_byte_size_is_judged_after_the_element_count_and_never_for_bytes() -> None:
    """The count's overflow is found first, as in Triton; a BYTES input has no element size to overflow (its data
    is sized as it is read), and a byte size just under int64's limit passes the check (to fail on its data)."""
    with pytest.raises(InvalidArgumentError, match="causes total element count"):
        decode_infer_request(_simple_json(shape=[16, 2**60 + 2]), None, "m", "")
    with pytest.raises(InvalidArgumentError) as caught:
        decode_infer_request(_simple_json(shape=[4, 2**60 + 2], datatype="BYTES", data=["x"]), None, "m", "")
    assert "overflow" not in caught.value.message
    with pytest.raises(InvalidArgumentError) as caught:
        decode_infer_request(_simple_json(shape=[2**61 - 1], datatype="INT32"), None, "m", "")  # 2**63 - 4 bytes
    assert "overflow" not in caught.value.message


def test_json_nested_deeper_than_100_levels_is_refused_in_tritons_words() -> None:
    too_deep = "JSON nesting depth exceeds maximum allowed limit (100)"
    for depth, body in [
        (101, b"[" * 101 + b"]" * 101),  # orjson parses it: geserve's own check
        (2000, b"[" * 2000 + b"]" * 2000),  # past orjson's limit: its error, reworded
        (150, json.dumps({"inputs": []}).encode()[:-1] + b', "parameters": {"x": ' + b"[" * 150 + b"]" * 150 + b"}}"),
    ]:
        with pytest.raises(InvalidArgumentError) as caught:
            parse_json(body)
        assert caught.value.message == too_deep, depth
    # 100 levels pass, and brackets inside strings are no nesting
    assert parse_json(b"[" * 100 + b"]" * 100) is not None
    assert parse_json(json.dumps({"s": "[" * 500, "t": "\\\"[{" * 50}).encode())["s"] == "[" * 500
    assert json_depth(b'{"a": [1, {"b": "]]]"}], "c": "[[["}') == 3


def test_outputs_named_twice_reach_the_service_as_sent() -> None:
    """The refusal is the service's rule (validation.prepare), the same for every protocol: the codec keeps both."""
    body = json.dumps({"inputs": [], "outputs": [{"name": "y"}, {"name": "y"}]}).encode()
    request = decode_infer_request(body, None, "m", "")
    assert [o.name for o in request.outputs or ()] == ["y", "y"]


@pytest.mark.parametrize(("tensor", "message"), [
    ({"shape": [True, 2]}, "Unable to parse 'shape' of input 'a': expected non-negative integers"),
    ({"parameters": [{"k": 1}]}, "Unable to parse 'parameters': expected an object"),
    ({"name": ["a"]}, "Unable to parse 'name': attempt to access JSON non-string as string"),
    ({"datatype": ["INT32"]}, "Unable to parse 'datatype': attempt to access JSON non-string as string"),
], ids=["boolean-dimension", "parameters-array", "name-array", "datatype-array"])
def test_json_of_the_wrong_type_is_a_parse_error_not_a_crash(tensor: dict, message: str) -> None:
    """Found by tests/test_fuzz.py: each of these was a TypeError or AttributeError, answered 500."""
    with pytest.raises(RequestParseError) as caught:
        decode_infer_request(_simple_json(**tensor), None, "m", "")
    assert caught.value.message == message


def test_output_parameters_of_the_wrong_type_are_a_parse_error() -> None:
    body = json.dumps({"inputs": [], "outputs": [{"name": "y", "parameters": ["binary_data"]}]}).encode()
    with pytest.raises(RequestParseError, match="Unable to parse 'parameters': expected an object"):
        decode_infer_request(body, None, "m", "")


def test_a_boolean_binary_data_size_is_refused() -> None:
    header = {"inputs": [{"name": "a", "shape": [1], "datatype": "UINT8", "parameters": {"binary_data_size": True}}]}
    body, length = _body(header, b"\x07")
    with pytest.raises(RequestParseError, match="unexpected binary_data_size True"):
        decode_infer_request(body, length, "m", "")


_REPEATED = {
    "inputs": [{"name": "a", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
               {"name": "b", "shape": [2], "datatype": "INT64", "parameters": {"binary_data_size": 16, "x": 1}}],
    "outputs": [{"name": "y", "parameters": {"binary_data": True, "classification": 2}}],
}


def _fields(request: object) -> tuple:
    inputs = [(t.name, t.datatype, t.shape, t.data.dtype, t.data.tolist(), t.parameters) for t in request.inputs]
    outputs = [(o.name, o.parameters, o.shm) for o in request.outputs or ()]
    return inputs, outputs, request.id, request.parameters, request.model_name, request.model_version


def test_a_repeated_header_decodes_each_body_as_a_fresh_decode_would() -> None:
    """Requests after the first with the same JSON header come from the known header: each the request a fresh parse
    gives, its data views of its own body, and dicts of its own (a change to one request's parameters, as the
    service may make, is not seen by the next), a client's timeout and priority included."""
    from geserve.frontends.http import codec

    codec._known_headers.clear()
    for seed in range(3):
        a, b = np.full(4, seed, np.float32), np.array([seed, -seed], np.int64)
        header = {"id": "", "parameters": {"timeout": 5000, "priority": 1}, **_REPEATED}  # perf_analyzer's empty id
        body, length = _body(header, a.tobytes(), b.tobytes())
        assert len(codec._known_headers) == min(seed, 1)
        request = decode_infer_request(body, length, "m", "2")
        known = dict(codec._known_headers)
        codec._known_headers.clear()
        assert _fields(request) == _fields(decode_infer_request(body, length, "m", "2"))  # parsed afresh
        codec._known_headers.update(known)
        assert np.shares_memory(request.inputs[0].data, np.frombuffer(body, np.uint8))
        assert request.inputs[0].data.tolist() == [[seed] * 4] and request.inputs[1].data.tolist() == [seed, -seed]
        assert request.inputs[1].parameters == {"x": 1} and request.outputs[0].parameters["classification"] == 2
        assert request.parameters == {"timeout": 5000, "priority": 1}
        request.inputs[1].parameters["x"] = 99
        request.outputs[0].parameters["classification"] = 5
        request.parameters["timeout"] = 1


def test_a_known_header_with_a_body_of_another_size_is_decoded_and_refused_as_before() -> None:
    decode_infer_request(*_body(_REPEATED, bytes(16), bytes(16)), "m", "")
    body, length = _body(_REPEATED, bytes(16), bytes(20))
    with pytest.raises(RequestParseError, match="4 bytes of binary data are not claimed"):
        decode_infer_request(body, length, "m", "")
    body, length = _body(_REPEATED, bytes(16), bytes(8))
    with pytest.raises(RequestParseError, match="unexpected binary_data_size 16 for input 'b'"):
        decode_infer_request(body, length, "m", "")


@pytest.mark.parametrize(
    "header",
    [
        {**_REPEATED, "id": "r1"},
        {**_REPEATED, "parameters": {"priority": 1, "sequence_id": 7}},
        {"inputs": [_REPEATED["inputs"][0], {"name": "b", "shape": [2], "datatype": "INT64", "data": [1, 2]}]},
        {"inputs": [{"name": "s", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 5}}]},
    ],
    ids=["id", "sequence-parameters", "json-data", "bytes"],
)
def test_headers_whose_request_depends_on_more_than_the_header_are_not_kept(header: dict) -> None:
    from geserve.frontends.http import codec

    codec._known_headers.clear()
    binaries = [bytes(16)] if len(header["inputs"]) == 2 and "data" in header["inputs"][1] else [bytes(16), bytes(16)]
    if header["inputs"][0]["datatype"] == "BYTES":
        binaries = [struct.pack("<I", 1) + b"x"]
    decode_infer_request(*_body(header, *binaries), "m", "")
    assert codec._known_headers == {}


def test_long_headers_are_not_kept() -> None:
    """What the known headers hold stays bounded whatever a client sends: a header over 4 KiB is parsed each time."""
    from geserve.frontends.http import codec

    codec._known_headers.clear()
    header = {**_REPEATED, "outputs": [{"name": "y" * 5000}]}
    decode_infer_request(*_body(header, bytes(16), bytes(16)), "m", "")
    assert codec._known_headers == {}
    decode_infer_request(*_body(_REPEATED, bytes(16), bytes(16)), "m", "")
    assert len(codec._known_headers) == 1
