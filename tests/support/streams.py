"""One inference request on a tritonclient gRPC stream, read until it ends: the decoupled-model tests' reader."""

from __future__ import annotations

import queue

import numpy as np
import tritonclient.grpc as grpcclient

# One streamed message: (result, None) or (None, the error's message).
Message = tuple[grpcclient.InferResult | None, str | None]


def stream_request(
    grpc_url: str,
    model: str,
    values: list[int],
    *,
    request_id: str = "",
    outputs: list[str] | None = None,
    timeout: float = 20,
    quiet_after_error: float = 0.5,
) -> tuple[list[Message], bool]:
    """Send `values` as the INT32 input IN; return the messages in order and whether the final flag came.

    Reading stops at the final flag, or when `quiet_after_error` seconds pass with nothing after an error (an
    error ends a request's stream without the flag); waiting `timeout` for any other message fails the test."""
    received: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
        tensor.set_data_from_numpy(np.array(values, np.int32))
        wanted = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        client.async_stream_infer(model, [tensor], outputs=wanted, request_id=request_id,
                                  enable_empty_final_response=True)
        messages: list[Message] = []
        while True:
            after_error = bool(messages) and messages[-1][1] is not None
            try:
                result, error = received.get(timeout=quiet_after_error if after_error else timeout)
            except queue.Empty:
                if after_error:
                    return messages, False
                raise
            if error is not None:
                messages.append((None, error.message()))
                continue
            messages.append((result, None))
            if is_final(result):
                return messages, True
    finally:
        client.stop_stream()
        client.close()


def outputs_of(result: grpcclient.InferResult) -> dict[str, list]:
    """Every output of a streamed response as a list, by name in sorted order."""
    names = sorted(o.name for o in result.get_response().outputs)
    return {name: result.as_numpy(name).tolist() for name in names}


def is_final(result: grpcclient.InferResult) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def summarized(messages: list[Message]) -> list[tuple]:
    """Each message as (outputs, final) or ("error", message)."""
    return [
        ("error", error) if result is None else (outputs_of(result), is_final(result)) for result, error in messages
    ]
