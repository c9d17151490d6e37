"""Fills Triton's defaults into a ModelConfig and rejects configurations Triton would reject."""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2
from tritonclient.grpc.model_config_pb2 import ModelConfig, ModelInput, ModelOutput

from geserve.config.embeddings import embeddings_spec
from geserve.config.ensemble import is_ensemble, validate_ensemble_graph
from geserve.config.sequence import fill_sequence_defaults, validate_sequence_batching
from geserve.errors import InvalidArgumentError


def fill_defaults(config: ModelConfig, default_instance_kind: int, default_model_filename: str) -> None:
    """What Triton's normalization adds before a config is served and printed by `/config`."""
    if not config.default_model_filename:
        config.default_model_filename = default_model_filename
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if is_ensemble(config):
        # As in Triton: no instances and no optimization settings of its own; the transaction policy is printed.
        config.model_transaction_policy.SetInParent()
        return
    _fill_instance_groups(config, default_instance_kind)
    batching = config.dynamic_batching
    # Triton prints the batch size a batch waits for when none is given: the largest one.
    if (config.WhichOneof("scheduling_choice") == "dynamic_batching" and not batching.preferred_batch_size
            and config.max_batch_size > 0):
        batching.preferred_batch_size.append(config.max_batch_size)
    fill_sequence_defaults(config)
    if not config.HasField("optimization"):
        config.optimization.input_pinned_memory.enable = True
        config.optimization.output_pinned_memory.enable = True


def _fill_instance_groups(config: ModelConfig, default_instance_kind: int) -> None:
    if not config.instance_group:
        config.instance_group.add().name = config.name  # Triton names its default group after the model
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}"
        if group.kind == model_config_pb2.ModelInstanceGroup.KIND_AUTO:
            group.kind = default_instance_kind
        if group.count == 0:
            group.count = 1


def validate(config: ModelConfig, model_dir_name: str) -> None:
    """Raise InvalidArgumentError naming the first problem, in Triton's wording where it has one."""
    if config.name != model_dir_name:
        raise InvalidArgumentError(
            f"unexpected 'name' in model configuration: got '{config.name}', expected '{model_dir_name}'"
        )
    if not config.platform and not config.backend:
        raise InvalidArgumentError(
            f"unexpected platform type '' for {config.name}: set 'backend' or 'platform'"
        )
    if config.max_batch_size < 0:
        raise InvalidArgumentError(f"'max_batch_size' must be non-negative value for {config.name}")
    if not config.output and not config.input:
        raise InvalidArgumentError(f"model '{config.name}' must specify at least one input or output")
    _validate_tensors(config)
    _validate_instance_groups(config)
    policy = config.version_policy
    if policy.HasField("latest") and policy.latest.num_versions < 1:
        raise InvalidArgumentError(f"version_policy.latest.num_versions must be >= 1 for {config.name}")
    validate_ensemble_graph(config)
    validate_sequence_batching(config)
    embeddings_spec(config)  # the OpenAI embeddings parameter, when the model has it


def _validate_instance_groups(config: ModelConfig) -> None:
    for group in config.instance_group:
        if group.count < 1:
            raise InvalidArgumentError(
                f"instance group {group.name} of model {config.name} must specify 'count' >= 1"
            )


def _validate_tensors(config: ModelConfig) -> None:
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for tensor in tensors:
            _validate_tensor(config, kind, tensor)
            if tensor.name in seen:
                raise InvalidArgumentError(f"{kind} '{tensor.name}' specified multiple times for {config.name}")
            seen.add(tensor.name)


def _validate_tensor(config: ModelConfig, kind: str, tensor: ModelInput | ModelOutput) -> None:
    if not tensor.name:
        raise InvalidArgumentError(f"model '{config.name}' has an {kind} without a name")
    if tensor.data_type == model_config_pb2.TYPE_INVALID:
        raise InvalidArgumentError(f"model '{config.name}' must specify 'data_type' for {kind} '{tensor.name}'")
    if not tensor.dims and config.max_batch_size == 0:
        raise InvalidArgumentError(f"model '{config.name}' must specify 'dims' for {kind} '{tensor.name}'")
    _validate_dims(config, tensor)


def _validate_dims(config: ModelConfig, tensor: ModelInput | ModelOutput) -> None:
    for dim in tensor.dims:
        if dim < -1 or dim == 0:
            raise InvalidArgumentError(
                f"model '{config.name}', tensor '{tensor.name}': dimension must be integer >= 1, "
                f"or -1 to indicate a variable-size dimension"
            )
    if tensor.HasField("reshape"):
        for dim in tensor.reshape.shape:
            if dim < -1:
                raise InvalidArgumentError(f"model '{config.name}' has an invalid reshape for '{tensor.name}'")
