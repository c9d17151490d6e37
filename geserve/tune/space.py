"""The configurations a sweep tries: instance count x max_batch_size x queue delay, and for GE models the
compiler's batch gears and precision variants, each turned into a ModelConfig from the model's own."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from geserve.config import ModelConfig

# Configs the GE backend serves (docs/guide/ge-backend.md): these can take the compile_* parameters.
GE_PLATFORMS = ("graph_executor", "onnxruntime_onnx")
GE_BACKENDS = ("npu_ge", "onnxruntime", "ge")


@dataclass(frozen=True)
class Candidate:
    instances: int
    max_batch_size: int
    queue_delay_us: int | None  # None: no dynamic batcher
    gears: tuple[int, ...] = ()  # compile_dynamic_batch_size; () leaves the model as it is
    precision: str = ""  # compile_precision_mode; "" leaves the model as it is

    @property
    def label(self) -> str:
        parts = [f"inst={self.instances}", f"mbs={self.max_batch_size}"]
        parts.append("no batcher" if self.queue_delay_us is None else f"delay={self.queue_delay_us}us")
        if self.gears:
            parts.append("gears=" + ",".join(map(str, self.gears)))
        if self.precision:
            parts.append(self.precision)
        return " ".join(parts)


@dataclass(frozen=True)
class Space:
    instances: tuple[int, ...] = (1, 2)
    max_batch_sizes: tuple[int, ...] = (1, 8, 32)
    queue_delays_us: tuple[int, ...] = (0, 500)
    precisions: tuple[str, ...] = ()  # compiler variants; () : none
    gears: bool = False  # also try batch gears (powers of two up to max_batch_size)


def is_ge_model(config: ModelConfig) -> bool:
    return config.platform in GE_PLATFORMS or config.backend in GE_BACKENDS


def candidates(base: ModelConfig, space: Space) -> list[Candidate]:
    """Every point of the space the model admits: batch sizes above the model's own limit are dropped (a model
    without batching, max_batch_size 0, is swept over instances only), and a queue delay only matters with
    batching. Compiler variants apply to GE models only."""
    precisions, gear_choices = _compiler_variants(base, space)
    found: list[Candidate] = []
    for instances, size, precision, geared in itertools.product(space.instances, _batch_sizes(base, space),
                                                                  precisions, gear_choices):
        batching = size > 1
        if geared and not batching:
            continue
        gears = _power_gears(size) if geared else ()
        for delay in space.queue_delays_us if batching else [None]:
            found.append(Candidate(instances, size, delay, gears, precision))
    return list(dict.fromkeys(found))


def _batch_sizes(base: ModelConfig, space: Space) -> list[int]:
    if base.max_batch_size <= 0:
        return [0]
    return sorted({min(size, base.max_batch_size) for size in space.max_batch_sizes if size >= 1})


def _compiler_variants(base: ModelConfig, space: Space) -> tuple[list[str], list[bool]]:
    """The precisions ("": the model's own) and whether to try gears, as the model admits them."""
    precisions: list[str] = [""]
    gear_choices: list[bool] = [False]
    if is_ge_model(base):
        precisions += [p for p in space.precisions if p and p != "force_fp32"]
        gear_choices += [True] if space.gears else []
    return precisions, gear_choices


def _power_gears(size: int) -> tuple[int, ...]:
    """The powers of two below `size`, then `size`."""
    return (*(2**k for k in range(size.bit_length()) if 2**k < size), size)


def apply(base: ModelConfig, candidate: Candidate) -> ModelConfig:
    """The model's config with the candidate's choices written in (everything else kept)."""
    config = ModelConfig()
    config.CopyFrom(base)
    config.max_batch_size = candidate.max_batch_size
    if config.instance_group:
        del config.instance_group[1:]
        config.instance_group[0].count = candidate.instances
    else:
        config.instance_group.add(count=candidate.instances)
    if candidate.queue_delay_us is None:
        config.ClearField("dynamic_batching")
    else:  # the model's other batcher settings stay, preferred sizes only where they still fit
        config.dynamic_batching.max_queue_delay_microseconds = candidate.queue_delay_us
        preferred = [s for s in config.dynamic_batching.preferred_batch_size if s <= candidate.max_batch_size]
        config.dynamic_batching.ClearField("preferred_batch_size")
        config.dynamic_batching.preferred_batch_size.extend(preferred)
    if candidate.gears:
        config.parameters["compile_dynamic_batch_size"].string_value = ",".join(map(str, candidate.gears))
    if candidate.precision:
        config.parameters["compile_precision_mode"].string_value = candidate.precision
    return config
