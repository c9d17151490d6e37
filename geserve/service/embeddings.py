"""OpenAI's embeddings task, once its frontend has decoded the call: which models answer (`/v1/models`), and for
`/v1/embeddings` the rules between the wire and the models' inferences, each run through the service's one door.

A call is admitted first (inference's group for embeddings, metadata's for the model list: bearer-token scopes,
restricted APIs, the audit log of refusals), then its model resolved and checked for the `openai.embeddings` parameter
(config/embeddings.py), its texts counted with the model's own tokenizer (too long: refused, or cut where the config
says `truncate`), token arrays decoded by that tokenizer, and the texts sent, all at once, as inference requests of
texts of about the same length, up to max_batch_size rows each (N texts are N rows, batched by the model's scheduler
with everything else), through `InferenceService.infer`: statistics, metrics, tracing, the response cache, deadlines
and admission control apply there as to any inference. A `dimensions` smaller than the vector is a cut and an L2
normalization, where the config allows.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from geserve.config.embeddings import PARAMETER, EmbeddingsSpec, embeddings_spec
from geserve.errors import ErrorCode, GeserveError, InternalError, NotFoundError
from geserve.repository.lifecycle import ModelManager
from geserve.repository.model import LoadedModel
from geserve.service.context import ApiGroup, CallContext, FrontendTrace
from geserve.types import InferenceRequest, InferenceResponse
from geserve.types.tensors import InputTensor, RequestedOutput

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
# Larger inputs are tokenized on a thread, not the event loop (2,000 characters take about a millisecond here)
_INLINE_CHARACTERS = 2_000
_OFF = "the OpenAI-compatible API is turned off on this server (--openai-api off)"
# Texts whose token counts are within this many of each other go in one request (`_groups`).
_LENGTH_STEP = 16


class EmbeddingsError(GeserveError):
    """A call the embeddings API refuses. `param`: the request field at fault, `reason`: a short machine-readable
    cause (OpenAI's error `param` and `code`: "model_not_found", "context_length_exceeded", ...)."""

    def __init__(
        self, message: str, code: ErrorCode = ErrorCode.INVALID_ARG, param: str | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.reason = reason


@dataclass(slots=True)
class EmbeddingsCall:
    """`POST /v1/embeddings` decoded: texts, or token arrays of the model's own tokenizer (exactly one is set)."""

    model: str
    texts: list[str] | None = None
    tokens: list[list[int]] | None = None
    dimensions: int | None = None


@dataclass(slots=True)
class EmbeddingsResult:
    model: str
    vectors: np.ndarray
    """float32, one row per input, in the inputs' order."""
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ExposedModel:
    """A model as `/v1/models` lists it."""

    id: str
    created: int
    """When its version was written (its version folder's time, Unix seconds): OpenAI's "when the model was made"."""
    owned_by: str


class FrontDoor(Protocol):
    """What the task asks of the service (InferenceService)."""

    server_name: str

    def admit(
        self, group: ApiGroup, context: CallContext, action: str = "", model: str = "", region: str = ""
    ) -> None: ...

    def admit_ahead(self, group: ApiGroup, context: CallContext, action: str = "", model: str = "") -> None: ...

    async def infer(
        self, request: InferenceRequest, context: CallContext, action: str = "infer"
    ) -> InferenceResponse: ...


@dataclass(frozen=True, slots=True)
class _Tokenizer:
    """A model's tokenizer file, loaded, with the length limit that applies to its texts."""

    encoder: Any  # tokenizers.Tokenizer, padding and truncation off: it counts
    limit: int
    specials: int
    """Special tokens it adds to a text ([CLS] and [SEP]: 2)."""


@dataclass(frozen=True, slots=True)
class _Exposed:
    config: object  # the ModelConfig of the loaded model it was read from: a reload reads again
    spec: EmbeddingsSpec
    tokenizer: _Tokenizer


class Embeddings:
    """The task, for one server's models. `enabled`: --openai-api (off: every call is answered 404)."""

    def __init__(self, manager: ModelManager, door: FrontDoor, enabled: bool = True) -> None:
        self._manager = manager
        self._door = door
        self.enabled = enabled
        self._exposed: dict[str, _Exposed] = {}

    def models(self, context: CallContext) -> list[ExposedModel]:
        """Every ready model with the `openai.embeddings` parameter, by name."""
        self._check_on()
        self._door.admit(ApiGroup.METADATA, context, "openai_models")
        names = sorted({m.name for m in self._manager.models() if PARAMETER in m.config.parameters})
        return [self._described(self._manager.get(name)) for name in names]

    def model(self, name: str, context: CallContext) -> ExposedModel:
        self._check_on()
        self._door.admit(ApiGroup.METADATA, context, "openai_model", name)
        model = self._resolve(name)
        _spec(model)
        return self._described(model)

    async def create(self, call: EmbeddingsCall, context: CallContext) -> EmbeddingsResult:
        """The call's vectors and the tokens they took."""
        self._check_on()
        self._door.admit_ahead(ApiGroup.INFERENCE, context, "embeddings", call.model)
        inputs = len(call.texts if call.texts is not None else call.tokens or ())
        if inputs > MAX_INPUTS:
            raise EmbeddingsError(f"'input' may hold at most {MAX_INPUTS} inputs, got {inputs}", param="input")
        model = self._resolve(call.model)
        exposed = await self._exposure(model)
        size = _size(call.model, exposed.spec, call.dimensions)
        if _size_of(call) > _INLINE_CHARACTERS:  # tokenizing it would hold the loop: tokenizers lets go of the GIL
            texts, counts = await asyncio.to_thread(_prepared, call, exposed.tokenizer, exposed.spec.truncate)
        else:
            texts, counts = _prepared(call, exposed.tokenizer, exposed.spec.truncate)
        vectors = await self._vectors(call.model, exposed.spec, texts, counts, context)
        return EmbeddingsResult(call.model, _cut(vectors, size), sum(counts))

    def _check_on(self) -> None:
        if not self.enabled:
            raise EmbeddingsError(_OFF, ErrorCode.NOT_FOUND)

    def _resolve(self, name: str) -> LoadedModel:
        try:
            return self._manager.get(name)
        except NotFoundError as exc:
            raise EmbeddingsError(
                f"The model `{name}` does not exist or is not ready ({exc.message})",
                ErrorCode.NOT_FOUND,
                "model",
                "model_not_found",
            ) from None

    def _described(self, model: LoadedModel) -> ExposedModel:
        return ExposedModel(model.name, _created(model), self._door.server_name)

    async def _exposure(self, model: LoadedModel) -> _Exposed:
        """The model's spec and tokenizer, read once per loaded config (the file in a thread: it takes tens of ms)."""
        exposed = self._exposed.get(model.name)
        if exposed is None or exposed.config is not model.config:
            spec = _spec(model)
            tokenizer = await asyncio.to_thread(_load_tokenizer, model, spec)
            exposed = self._exposed[model.name] = _Exposed(model.config, spec, tokenizer)
        return exposed

    async def _vectors(
        self, name: str, spec: EmbeddingsSpec, texts: list[str], counts: list[int], context: CallContext
    ) -> np.ndarray:
        """The texts' vectors, in their order, from inferences of texts of about the same length (`_groups`), all
        submitted at once: the model's scheduler batches them, with every other request of the same shape."""
        groups = _groups(counts, spec.rows_per_request)
        requests = [_request(name, spec, [texts[i] for i in group]) for group in groups]
        if len(requests) == 1:
            return _output(await self._door.infer(requests[0], context), spec, len(texts))[np.argsort(groups[0])]
        responses = await self._all(requests, context)
        vectors = np.empty((len(texts), spec.size), dtype=np.float32)
        for response, group in zip(responses, groups, strict=True):
            vectors[group] = _output(response, spec, len(group))
        return vectors

    async def _all(self, requests: list[InferenceRequest], context: CallContext) -> list[InferenceResponse]:
        """Several inferences of one call, each in a context of its own (a traced request's trace is its context's),
        their traces then sent as the call's."""
        contexts = [replace(context) for _ in requests]
        responses = await _together(self._door.infer(r, c) for r, c in zip(requests, contexts, strict=True))
        traces = [c.trace for c in contexts if c.trace is not None]
        if traces:
            context.trace = _Traces(traces)
        return responses


def _spec(model: LoadedModel) -> EmbeddingsSpec:
    spec = embeddings_spec(model.config)
    if spec is None:
        raise EmbeddingsError(
            f"The model `{model.name}` is served here, but not on the OpenAI API: its config has no '{PARAMETER}' "
            f"parameter",
            ErrorCode.NOT_FOUND,
            "model",
            "model_not_found",
        )
    return spec


def _created(model: LoadedModel) -> int:
    if model.model_dir is None:
        return 0
    try:
        return int(os.stat(model.model_dir / str(model.version)).st_mtime)
    except OSError:
        return 0


def _load_tokenizer(model: LoadedModel, spec: EmbeddingsSpec) -> _Tokenizer:
    from tokenizers import Tokenizer  # only for models that serve embeddings

    path = _inside(model, spec.tokenizer)
    try:
        encoder = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception for a file it cannot read or parse
        raise InternalError(f"model '{model.name}': cannot read its tokenizer {spec.tokenizer}: {exc}") from None
    limit = spec.max_input_tokens or (encoder.truncation or {}).get("max_length")
    if not limit:
        raise InternalError(
            f"model '{model.name}': '{PARAMETER}' needs max_input_tokens: its tokenizer sets no truncation length"
        )
    encoder.no_padding()
    encoder.no_truncation()
    return _Tokenizer(encoder, int(limit), encoder.num_special_tokens_to_add(False))


def _inside(model: LoadedModel, relative: str) -> Path:
    """The tokenizer's path, which must be inside the model's folder (a config loaded through the API names it)."""
    if model.model_dir is None:
        raise InternalError(f"model '{model.name}' has no folder to read its tokenizer from")
    folder = model.model_dir.resolve()
    path = (folder / relative).resolve()
    if not path.is_relative_to(folder):
        raise InternalError(f"model '{model.name}': its tokenizer {relative} is outside the model's folder")
    return path


def _size(name: str, spec: EmbeddingsSpec, dimensions: int | None) -> int:
    if dimensions is None or spec.allows(dimensions):
        return spec.size if dimensions is None else dimensions
    if spec.dimensions is None:
        allowed = f"from 1 to {spec.size}"
    elif spec.dimensions:
        allowed = f"one of {sorted({*spec.dimensions, spec.size})}"
    else:
        allowed = (
            f"only {spec.size}: the model's '{PARAMETER}' parameter allows no other (a vector may be cut only "
            f"where the model was trained for it, as Matryoshka models are)"
        )
    raise EmbeddingsError(
        f"The model `{name}` does not support dimensions={dimensions}: it takes {allowed}", param="dimensions"
    )


def _groups(counts: list[int], rows: int) -> list[list[int]]:
    """The texts' indices in groups of at most `rows`, each of texts of about the same length (their token counts
    within one `_LENGTH_STEP`): a model pads a request's texts to its longest, so a long text does not make the short
    ones of its call cost as much as itself. In the texts' order where they are all of one length."""
    steps = [(count - 1) // _LENGTH_STEP for count in counts]
    order = sorted(range(len(counts)), key=steps.__getitem__)  # stable: the texts' order within a length
    groups: list[list[int]] = []
    for index in order:
        if not groups or len(groups[-1]) == rows or steps[groups[-1][0]] != steps[index]:
            groups.append([])
        groups[-1].append(index)
    return groups


def _prepared(call: EmbeddingsCall, tokenizer: _Tokenizer, truncate: bool) -> tuple[list[str], list[int]]:
    """The texts to embed (token arrays decoded; texts over the limit cut, where the model truncates) and the tokens
    each takes, counted by the model's tokenizer."""
    texts = list(call.texts) if call.texts is not None else _decoded(call.tokens or [], tokenizer)
    encoder = tokenizer.encoder
    encodings = [encoder.encode(texts[0])] if len(texts) == 1 else encoder.encode_batch(texts)
    counts = []
    for index, encoding in enumerate(encodings):
        count = len(encoding.ids)
        if count > tokenizer.limit:
            if not truncate:
                raise EmbeddingsError(
                    f"This model's maximum context length is {tokenizer.limit} tokens, however you requested {count} "
                    f'tokens in input {index}. Please reduce the input (or serve the model with "truncate": true in '
                    f"its '{PARAMETER}' parameter)",
                    param="input",
                    reason="context_length_exceeded",
                )
            texts[index] = _truncated(texts[index], encoding, tokenizer)
            count = tokenizer.limit
        counts.append(count)
    return texts, counts


def _size_of(call: EmbeddingsCall) -> int:
    """Characters of the texts, or token ids of the arrays."""
    return sum(map(len, call.texts)) if call.texts is not None else sum(map(len, call.tokens or ()))


def _decoded(arrays: list[list[int]], tokenizer: _Tokenizer) -> list[str]:
    """Token arrays as the texts they spell, checked against the tokenizer's vocabulary."""
    vocabulary = tokenizer.encoder.get_vocab_size()
    for index, ids in enumerate(arrays):
        if not ids:
            raise EmbeddingsError(f"input {index} is an empty token array", param="input")
        outside = next((i for i in ids if not 0 <= i < vocabulary), None)
        if outside is not None:
            raise EmbeddingsError(
                f"input {index} has token id {outside}, outside this model's tokenizer (ids 0 to {vocabulary - 1}): "
                f"token arrays are the model's own token ids",
                param="input",
                reason="invalid_token_id",
            )
    return list(tokenizer.encoder.decode_batch(arrays, skip_special_tokens=True))


def _truncated(text: str, encoding: Any, tokenizer: _Tokenizer) -> str:
    """`text` up to the end of the last token that fits the limit (special tokens counted)."""
    kept = tokenizer.limit - tokenizer.specials
    words = [
        offset for offset, special in zip(encoding.offsets, encoding.special_tokens_mask, strict=True) if not special
    ]
    return text[: words[kept - 1][1]] if kept > 0 else ""


def _request(name: str, spec: EmbeddingsSpec, texts: list[str]) -> InferenceRequest:
    data = np.array([text.encode() for text in texts], dtype=np.object_)
    shape = (len(texts), 1) if spec.rows_per_request > 1 else (1,)  # a model without batching: one text, no batch axis
    tensor = InputTensor(spec.input, "BYTES", shape, data.reshape(shape))
    return InferenceRequest(name, "", [tensor], outputs=[RequestedOutput(spec.output)])


def _output(response: InferenceResponse, spec: EmbeddingsSpec, rows: int) -> np.ndarray:
    for output in response.outputs:
        if output.name == spec.output:
            return np.asarray(output.data, dtype=np.float32).reshape(rows, spec.size)
    raise InternalError(f"model '{response.model_name}' answered without its output '{spec.output}'")


def _cut(vectors: np.ndarray, size: int) -> np.ndarray:
    """The first `size` values of each vector, L2-normalized again (Matryoshka truncation)."""
    if size >= vectors.shape[1]:
        return vectors
    cut = vectors[:, :size]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), np.float32(1e-12))


async def _together(calls: Iterable[Awaitable[InferenceResponse]]) -> list[InferenceResponse]:
    """Every call's response, in order; the first failure (or a cancel of the caller) withdraws the others."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op for the finished ones


class _Traces:
    """The traces of one call's several inferences, marked as the frontend sends the call's one answer."""

    def __init__(self, traces: list[FrontendTrace]) -> None:
        self._traces = traces

    def mark(self, name: str) -> None:
        for trace in self._traces:
            trace.mark(name)

    def finish(self, name: str) -> None:
        for trace in self._traces:
            trace.finish(name)
