"""Triton's model warmup (`model_warmup` in a config): sample requests run on every instance of a version before it
reports READY, so the first real requests do not pay for lazy initialization.

As in Triton (core's backend_model_instance.cc): a sample of `batch_size` N is N requests of one row each, executed
together (N = 0 skips the sample); it runs `count` times (at least once); `zero_data` is zeros (empty strings for
BYTES), `random_data` random bytes (zeros for BYTES), `input_data_file` the raw bytes of a file in the model's
`warmup` folder (length-prefixed elements for BYTES). Samples run directly on the instances, never through a
scheduler, so they are counted in no statistics. The first failing sample fails the load: "failed to run warmup
sample '<name>': <errors>; ", or "failed to prepare warmup sample '<name>': <fault>" for one that cannot be built
(Triton's own messages for the fault, which Triton gives without naming the sample).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2

from geserve.backends.base import ModelInstance
from geserve.config import ModelConfig
from geserve.errors import GeserveError, InvalidArgumentError
from geserve.types import InferenceRequest, InputTensor, id_prefix
from geserve.types.datatypes import BY_CONFIG, DataType
from geserve.types.streams import ResponseStream
from geserve.types.wire import FramingError, split_bytes

logger = logging.getLogger(__name__)

WARMUP_FOLDER = "warmup"  # Triton's kWarmupDataFolder, inside the model's folder
_PREFIX = id_prefix("")  # warmup requests have no id: Triton's messages say <id_unknown>


@dataclass(frozen=True, slots=True)
class WarmupSample:
    name: str
    count: int
    requests: tuple[InferenceRequest, ...]  # `batch_size` requests of one row each, sharing their data


def build_samples(config: ModelConfig, model_dir: Path, version: int) -> list[WarmupSample]:
    """The config's warmup samples as requests (blocking: reads the data files). Raise InvalidArgumentError naming
    the first fault, in Triton's words where it has them."""
    samples: list[WarmupSample] = []
    for setting in config.model_warmup:
        if setting.batch_size == 0:
            logger.debug("skipping batch 0 warmup sample '%s' of model '%s'", setting.name, config.name)
            continue
        try:
            inputs = _sample_inputs(config, model_dir, setting)
        except InvalidArgumentError as exc:
            # Triton returns these bare; the sample's name tells the reader the load failed in its warmup.
            raise InvalidArgumentError(f"failed to prepare warmup sample '{setting.name}': {exc.message}") from None
        request = InferenceRequest(config.name, str(version), inputs, None, "", batch_size=1)
        # The same tensors in every request of the sample, as Triton shares one buffer among them.
        requests = tuple(replace(request, inputs=list(inputs)) for _ in range(setting.batch_size))
        samples.append(WarmupSample(setting.name, max(setting.count, 1), requests))
    return samples


async def warm_up(config: ModelConfig, model_dir: Path, version: int, instances: Sequence[ModelInstance]) -> None:
    """Run the config's warmup samples on every instance, one after the other, each execution on a worker thread.
    Raise InvalidArgumentError on the first sample that fails."""
    if not config.model_warmup:
        return
    samples = await asyncio.to_thread(build_samples, config, model_dir, version)
    if not samples:
        return
    for instance in instances:
        for sample in samples:
            for iteration in range(1, sample.count + 1):
                logger.debug(
                    "model '%s' instance %s is running warmup sample '%s' for iteration %d",
                    config.name, instance.name, sample.name, iteration,
                )
                errors = await _run(config, instance, sample)
                if errors:
                    raise InvalidArgumentError(
                        f"failed to run warmup sample '{sample.name}': " + "".join(f"{e}; " for e in errors)
                    )
    logger.info(
        "model '%s' version %d: %d warmup sample(s) ran on %d instance(s)", config.name, version, len(samples),
        len(instances),
    )


async def _run(config: ModelConfig, instance: ModelInstance, sample: WarmupSample) -> list[str]:
    """One execution of `sample` on `instance`: the error of every response that failed."""
    decoupled = config.model_transaction_policy.decoupled
    loop = asyncio.get_running_loop()
    requests = [replace(r, stream=ResponseStream(loop)) if decoupled else r for r in sample.requests]
    # A batching model takes the sample's requests as one batch, as Triton hands them to the backend together; a
    # model without batching cannot join them, so each runs alone.
    groups = [requests] if config.max_batch_size > 0 else [[r] for r in requests]
    errors: list[str] = []
    for group in groups:
        await _run_group(instance, group, errors)
    return errors


async def _run_group(instance: ModelInstance, group: list[InferenceRequest], errors: list[str]) -> None:
    try:
        execution = await asyncio.to_thread(instance.execute, group)
    except GeserveError as exc:
        errors.append(exc.message)
        return
    except Exception as exc:  # an instance reports failures as results; keep a bug's traceback in the log
        logger.exception("instance '%s' raised during warmup", instance.name)
        errors.append(f"execution failed: {exc}")
        return
    errors.extend(r.message for r in execution.results if isinstance(r, GeserveError))
    for request in group:
        if request.stream is not None:  # a decoupled model answers through the stream, until its final flag
            async for item in request.stream:
                if item.error is not None:
                    errors.append(item.error.message)


def _sample_inputs(config: ModelConfig, model_dir: Path, setting: model_config_pb2.ModelWarmup) -> list[InputTensor]:
    """The sample's input tensors, checked against the model's inputs as a request's would be, in config order."""
    specs = {i.name: i for i in config.input}
    tensors = {
        name: _sample_input(config, model_dir, specs, name, spec) for name, spec in sorted(setting.inputs.items())
    }
    missing = [i.name for i in config.input if i.name not in tensors and not getattr(i, "optional", False)]
    if missing:
        raise InvalidArgumentError(
            f"{_PREFIX}expected {len(config.input)} inputs but got {len(tensors)} inputs for model "
            f"'{config.name}'. Got input(s) {_names_text(tensors)}, but missing required input(s) "
            f"{_names_text(missing)}. Please provide all required input(s)."
        )
    return [tensors[i.name] for i in config.input if i.name in tensors]


def _sample_input(
    config: ModelConfig,
    model_dir: Path,
    specs: dict[str, model_config_pb2.ModelInput],
    name: str,
    spec: model_config_pb2.ModelWarmup.Input,
) -> InputTensor:
    if -1 in spec.dims:
        raise InvalidArgumentError(
            f"warmup setting expects all variable-size dimensions are specified for input '{name}'"
        )
    model_input = specs.get(name)
    if model_input is None:
        raise InvalidArgumentError(f"unexpected inference input '{name}' for model '{config.name}'")
    datatype = BY_CONFIG.get(spec.data_type)
    if datatype is None:
        raise InvalidArgumentError(f"warmup setting expects input '{name}' to have a valid data_type")
    wanted = BY_CONFIG[model_input.data_type]
    if datatype is not wanted:
        raise InvalidArgumentError(
            f"{_PREFIX}inference input '{name}' data-type is '{datatype.wire}', but model '{config.name}' "
            f"expects '{wanted.wire}'"
        )
    dims = tuple(spec.dims)
    _check_shape(config, model_input, name, dims)
    data = _data(config, model_dir, name, spec, datatype, dims)
    shape = ((1,) if config.max_batch_size > 0 else ()) + dims
    return InputTensor(name, datatype.wire, shape, data.reshape(shape))


def _check_shape(
    config: ModelConfig, model_input: model_config_pb2.ModelInput, name: str, dims: tuple[int, ...]
) -> None:
    configured = tuple(model_input.dims)
    fits = len(dims) == len(configured) and all(m in (-1, d) for m, d in zip(configured, dims, strict=True))
    if fits:
        return
    batching = config.max_batch_size > 0
    expected = ([-1] if batching else []) + list(model_input.dims)
    got = ([1] if batching else []) + list(dims)
    raise InvalidArgumentError(
        f"{_PREFIX}unexpected shape for input '{name}' for model '{config.name}'. "
        f"Expected {_shape_text(expected)}, got {_shape_text(got)}"
    )


def _data(
    config: ModelConfig,
    model_dir: Path,
    name: str,
    spec: model_config_pb2.ModelWarmup.Input,
    datatype: DataType,
    dims: tuple[int, ...],
) -> np.ndarray:
    count = math.prod(dims)
    kind = spec.WhichOneof("input_data_type")
    is_bytes = datatype.itemsize == 0
    if kind == "zero_data" or (kind == "random_data" and is_bytes):
        # Triton sends BYTES random data as zeros too: empty strings, each a zero length prefix.
        if is_bytes:
            return np.array([b""] * count, dtype=np.object_)
        return np.zeros(count, dtype=datatype.numpy)
    if kind == "random_data":
        if datatype.wire == "BOOL":  # any other byte than 0 or 1 is no valid bool
            return np.random.default_rng().integers(0, 2, count).astype(np.bool_)
        return np.frombuffer(os.urandom(count * datatype.itemsize), dtype=datatype.numpy).copy()
    if kind == "input_data_file":
        return _file_data(model_dir, spec.input_data_file, name, datatype, count)
    raise InvalidArgumentError(f"{_PREFIX}warmup setting expects input '{name}' to have input_data_type set")


def _file_data(model_dir: Path, filename: str, name: str, datatype: DataType, count: int) -> np.ndarray:
    path = model_dir / WARMUP_FOLDER / filename
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(
            f"failed to read warmup data file {path} for input '{name}': {exc.strerror or exc}"
        ) from None
    if datatype.itemsize == 0:
        try:
            items, _ = split_bytes(memoryview(raw), count)
        except FramingError as exc:
            items = [b""] * exc.index  # how many whole elements came before the bad one
        if len(items) < count:
            raise InvalidArgumentError(
                f"{_PREFIX}warmup setting expects {count} length-prefixed elements for input '{name}', but the "
                f"data provided from {filename} only has {len(items)}"
            )
        return np.array(items, dtype=np.object_)
    needed = count * datatype.itemsize
    if len(raw) < needed:
        raise InvalidArgumentError(
            f"{_PREFIX}warmup setting expects {needed} bytes, but the data provided from {filename} only has "
            f"{len(raw)} bytes"
        )
    return np.frombuffer(raw[:needed], dtype=datatype.numpy).copy()


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _names_text(names: Sequence[str] | dict[str, InputTensor]) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"
