"""Triton's response cache: `--cache-config local,size=<bytes>` on the server and `response_cache { enable: true }`
in a model's config; a request that was answered before is answered from memory, without running the model.

The cache sits in the service's one infer path (`InferenceService._execute`), after the request is validated
and before the model's scheduler, so every caller gets it: HTTP, gRPC, BLS calls and ensemble steps alike (a cached
step skips its execution), and an ensemble that enables it caches its own top-level answers too, as Triton does.

Key. A SHA-256 over what decides the answer: the model's name and version and the number of its load (a model
reloaded with new files under the same version, as poll mode does, must not answer with the old one's answers),
the caller's identity (a model may answer per caller, so one caller never gets another's entry), every input's
name, datatype, shape and bytes (in name order, each length-prefixed), the requested outputs in order with their
classification, and the request parameters that reach the model (not `priority`, `timeout` or
`binary_data_output`, which change how or when it is answered, not what). Triton hashes the name, version and input
names and bytes only; geserve's key is a superset, so it never answers a request with another's response where
Triton would not. SHA-256 rather than BLAKE2: with the SHA
extensions of current x86 and ARM CPUs it is the fastest strong hash in `hashlib` (a ResNet-50 input, 602 KB:
~340 us against ~660 us). Inputs are fed as memoryviews of their arrays, never copied (BYTES inputs are serialized
first, as on the wire); a request whose inputs exceed `_HASH_ON_LOOP_BYTES` is hashed in a worker thread
(hashlib releases the GIL) so that one large request does not stall the event loop.

Memory. An LRU bounded by bytes: an entry counts its output tensors' bytes (BYTES elements by their lengths) plus a
fixed overhead per entry and per tensor; an entry larger than the whole cache is not stored. Only successful
responses are stored. Each output is copied once when stored: the cache then owns exactly what it counts (a
response's output may be a slice of a whole batch's array, which a reference would keep alive) and nothing the
model or the first caller does later can change it. Cached arrays are read-only, and a hit hands out those arrays
themselves in new tensor objects: frontends only read them, and code in the server that tried to write into one
gets numpy's "read-only" error instead of silently changing every later answer.

Threads. The cache is used from the event loop only (the service's infer path runs there; BLS calls from model
threads are scheduled onto it), so it takes no lock.

Workers. This is one process's cache. The workers of a server (`--workers N`) share one instead, in shared memory
(shared_cache.py: `SharedResponseCache`, the same `execute` over a table every worker maps), so that a response any
worker cached is a hit on all of them and `size` bounds the server's entries; a worker's link puts it in place of
this one when the worker joins the server. A single process keeps this one: its hit path is a dictionary lookup.

Statistics, as Triton keeps them: a hit is a success whose duration is the whole request, with `cache_hit` counting
its lookup time; it runs nothing, so `inference_count`, `execution_count` and the compute durations do not grow. A
miss is counted in `cache_miss` with its lookup and insertion time once the model answered successfully, and the
insertion time is added to the request's success duration.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from geserve.repository.model import LoadedModel
from geserve.types import InferenceRequest, InferenceResponse, OutputTensor
from geserve.types.wire import tensor_bytes

logger = logging.getLogger(__name__)

# The caches `--cache-config` may name. Triton loads others (redis, custom) as shared libraries; geserve has none.
SUPPORTED_CACHES = ("local",)
# Request parameters that never reach the model's answer: scheduling hints and the HTTP binary-output switch.
_NOT_IN_KEY = frozenset({"priority", "timeout", "binary_data_output"})
# Bookkeeping an entry costs beyond its tensors' bytes: the entry, its key and ordering, and each tensor object.
ENTRY_OVERHEAD = 256
TENSOR_OVERHEAD = 128
# Inputs larger than this are hashed off the event loop.
_HASH_ON_LOOP_BYTES = 1 << 20
_LENGTH = 8  # bytes of the length prefix before each hashed field

Execute = Callable[[LoadedModel, InferenceRequest, int], Awaitable[InferenceResponse]]


class CacheConfigError(ValueError):
    """`--cache-config` names a cache geserve does not have, or settings the local cache cannot use."""


def build_response_cache(config: Mapping[str, Mapping[str, str]]) -> ResponseCache | None:
    """The server's cache from `--cache-config` settings by cache name; None when none is configured."""
    if not config:
        return None
    if len(config) > 1:
        raise CacheConfigError(
            f"multiple cache configurations provided ({', '.join(sorted(config))}); only one cache can be used"
        )
    (name, settings), = config.items()
    if name not in SUPPORTED_CACHES:
        raise CacheConfigError(
            f"unknown cache '{name}' in --cache-config: geserve has the 'local' cache only (--cache-config "
            f"local,size=<bytes>)"
        )
    unknown = sorted(set(settings) - {"size"})
    if unknown:
        raise CacheConfigError(f"unknown setting(s) {', '.join(unknown)} for the 'local' cache; it takes 'size'")
    raw = settings.get("size")
    if raw is None:
        raise CacheConfigError("the 'local' cache needs its size: --cache-config local,size=<bytes>")
    try:
        size = int(raw)
    except ValueError:
        raise CacheConfigError(f"--cache-config local,size expects a number of bytes, got '{raw}'") from None
    if size <= 0:
        raise CacheConfigError(f"--cache-config local,size must be a positive number of bytes, got {size}")
    return ResponseCache(size)


@dataclass(slots=True)
class _Entry:
    outputs: tuple[OutputTensor, ...]
    parameters: dict[str, Any]
    size: int


class ResponseCache:
    """The local cache: request key -> a successful response's outputs, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # Server-wide counters (Triton's local cache keeps these too); the per-model ones are in the statistics.
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, key: bytes) -> tuple[tuple[OutputTensor, ...], dict[str, Any]] | None:
        """The stored outputs and response parameters of `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry.outputs, entry.parameters

    def insert(self, key: bytes, response: InferenceResponse) -> bool:
        """Store a copy of `response`'s outputs under `key`, evicting the least recently used entries as needed;
        False when the entry alone is larger than the cache (then nothing is evicted)."""
        size = entry_size(response.outputs)
        if size > self.capacity:
            return False
        old = self._entries.pop(key, None)  # two identical requests that both missed: the later answer stays
        if old is not None:
            self.used -= old.size
        while self.used + size > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self.used -= evicted.size
            self.evictions += 1
        outputs = tuple(_frozen(o) for o in response.outputs)
        self._entries[key] = _Entry(outputs, dict(response.parameters), size)
        self.used += size
        return True

    async def execute(
        self, model: LoadedModel, request: InferenceRequest, started: int, execute: Execute
    ) -> InferenceResponse:
        """`request`'s response from the cache, or from `execute` (the model's path, which records the request's
        own statistics) and then stored if it succeeded."""
        lookup_started = time.monotonic_ns()
        key = await request_key_async(model, request)
        cached = self.lookup(key)
        if cached is not None:
            outputs, parameters = cached
            done = time.monotonic_ns()
            model.statistics.record_cache_hit(done - started, done - lookup_started)
            return InferenceResponse(
                request.model_name, str(model.version), [_shared(o) for o in outputs], request.id, dict(parameters)
            )
        lookup_ns = time.monotonic_ns() - lookup_started
        response = await execute(model, request, started)  # a failure propagates: it is never stored
        inserting = time.monotonic_ns()
        if not self.insert(key, response):
            logger.debug("response of model '%s' (%d bytes) is larger than the response cache (%d bytes): not "
                         "cached", model.name, entry_size(response.outputs), self.capacity)
        model.statistics.record_cache_miss(lookup_ns, time.monotonic_ns() - inserting)
        return response


def entry_size(outputs: list[OutputTensor] | tuple[OutputTensor, ...]) -> int:
    """What an entry of these outputs counts against the cache's size."""
    size = ENTRY_OVERHEAD
    for output in outputs:
        data = output.data
        if data.dtype == object:  # BYTES: the elements' lengths (and their pointers), not the pointers alone
            size += data.nbytes + sum(len(v) if isinstance(v, bytes | str) else 8 for v in data.reshape(-1))
        else:
            size += data.nbytes
        size += TENSOR_OVERHEAD
    return size


def _frozen(output: OutputTensor) -> OutputTensor:
    """A read-only copy the cache owns (contiguous, exactly its own bytes)."""
    data = np.array(output.data, copy=True, order="C")
    data.flags.writeable = False
    return OutputTensor(output.name, output.datatype, tuple(output.shape), data, dict(output.parameters))


def _shared(output: OutputTensor) -> OutputTensor:
    """A hit's output: a new tensor object over the cached (read-only) array, with its own parameters."""
    return OutputTensor(output.name, output.datatype, output.shape, output.data, dict(output.parameters))


def _key_header(model: LoadedModel, request: InferenceRequest, load: object) -> bytes:
    """Everything but the input bytes, as one deterministic text (ints as ints, whatever type a frontend used)."""
    inputs = [(t.name, t.datatype, tuple(int(d) for d in t.shape)) for t in sorted(request.inputs, key=_name)]
    outputs = None if request.outputs is None else [(o.name, o.classification) for o in request.outputs]
    parameters = sorted((k, repr(v)) for k, v in request.parameters.items() if k not in _NOT_IN_KEY)
    return repr((model.name, model.version, load, request.identity, inputs, outputs, parameters)).encode()


def _name(tensor: OutputTensor) -> str:
    return tensor.name


def request_key(model: LoadedModel, request: InferenceRequest, load: object = None) -> bytes:
    """The cache key of a validated request on `model` (see the module docstring for what it covers). `load` names
    the model's load: by default its own number (a reloaded model starts with no entries); a cache the workers of a
    server share passes the server's (shared_cache.py)."""
    digest = hashlib.sha256()
    header = _key_header(model, request, model.response_cache if load is None else load)
    digest.update(len(header).to_bytes(_LENGTH, "little"))
    digest.update(header)
    for tensor in sorted(request.inputs, key=_name):
        data = tensor_bytes(tensor)  # a view of the array's own memory unless small, BYTES or not contiguous
        digest.update(len(data).to_bytes(_LENGTH, "little"))
        digest.update(data)
    return digest.digest()


async def request_key_async(model: LoadedModel, request: InferenceRequest, load: object = None) -> bytes:
    """`request_key`, in a worker thread when the inputs are large enough to stall the event loop."""
    if sum(t.data.nbytes for t in request.inputs) > _HASH_ON_LOOP_BYTES:
        return await asyncio.to_thread(request_key, model, request, load)
    return request_key(model, request, load)
