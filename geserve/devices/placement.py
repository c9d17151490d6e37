"""Placement: which device each execution context of a model's instance groups runs on, as Triton places them.

A KIND_GPU group with `gpus: [...]` puts `count` instances on each listed GPU, without them on every visible GPU
(Triton) or on the GE dialects' `DEVICE_ID` / `device_ids`; a CPU group runs on the host (device 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

from geserve.errors import InvalidArgumentError

_KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU


@dataclass(frozen=True, slots=True)
class Placement:
    name: str  # the execution context's name: <group>_<index>
    kind: int
    device_id: int


def placements(
    groups: Iterable[model_config_pb2.ModelInstanceGroup],
    device_ids: Sequence[int] = (),
    instance_exec_blocks: int = 1,
    device_exec_blocks: int = 0,
    visible_gpus: Sequence[int] | None = None,
    model: str = "",
) -> list[Placement]:
    """One Placement per execution context (one pool worker each).

    `instance_exec_blocks` multiplies a group's `count`; `device_exec_blocks` instead fixes the group's total on each
    device, as Ascend sizes executors by device memory, not instances. `visible_gpus` (None: unknown) checks the
    ids a group names and is the default list of a GPU group that names none, as in Triton.
    """
    result: list[Placement] = []
    for group in groups:
        ids = _group_devices(group, device_ids, visible_gpus, model)
        per_device = device_exec_blocks or group.count * instance_exec_blocks
        for device_id in ids:
            for _ in range(per_device):
                result.append(Placement(f"{group.name}_{len(result)}", group.kind, device_id))
    return result


def _group_devices(
    group: model_config_pb2.ModelInstanceGroup,
    device_ids: Sequence[int],
    visible_gpus: Sequence[int] | None,
    model: str,
) -> list[int]:
    """The devices a group's instances go on: a GPU group's own list, else the dialect's, else the visible GPUs."""
    if group.kind != _KIND_GPU:
        return list(device_ids[:1]) or [0]
    ids = list(group.gpus) or list(device_ids) or (list(visible_gpus) if visible_gpus else [0])
    if visible_gpus is not None:
        _check_gpus(group, ids, visible_gpus, model)
    return ids


def _check_gpus(
    group: model_config_pb2.ModelInstanceGroup, ids: list[int], visible: Sequence[int], model: str
) -> None:
    for device_id in ids:
        if device_id not in visible:
            # Triton's words (model_config_utils.cc), with the GPUs this process can see.
            raise InvalidArgumentError(
                f"instance group {group.name} of model {model} specifies invalid or unsupported gpu id "
                f"{device_id}. GPUs with at least the minimum required CUDA compute compatibility of 6.0 are: "
                + " ".join(str(i) for i in visible)
            )
