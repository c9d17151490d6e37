"""The GE (graph executor) backend: loads ONNX graphs into ONNX Runtime sessions on the chosen device."""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort
from tritonclient.grpc import model_config_pb2

from geserve import devices
from geserve.backends.base import BackendKind, BackendSettings, InferenceHost, ModelInstance, ModelSource
from geserve.backends.ge.autocomplete import GraphTensor, auto_complete, read_overridable_inputs, read_signature
from geserve.backends.ge.compiled import (
    DEFAULT_SOURCES,
    apply_gears,
    compile_on_load,
    find_package,
    load_graph,
    package_libraries,
    wants_compile,
)
from geserve.backends.ge.dump import dump_folder, make_instance, with_dump
from geserve.backends.ge.instance import GeInstance, ModelLayout, TensorLayout
from geserve.backends.ge.offline import auto_complete_om, create_om_instances, find_offline_model, is_offline_model
from geserve.backends.ge.parameters import GeOptions, parse_ge_options
from geserve.backends.ge.providers import configured_accelerator, provider_options
from geserve.backends.ge.shared_weights import file_identity, fingerprint, packed_graph
from geserve.compiler.package import read_manifest
from geserve.compiler.tensorflow import is_saved_model
from geserve.config import ModelConfig
from geserve.config.sequence import sequence_inputs, sequence_outputs
from geserve.devices import compute_priority
from geserve.devices.cann import gears_from_ge
from geserve.devices.cuda import visible_gpus
from geserve.devices.target import accelerator_of
from geserve.errors import InvalidArgumentError, UnavailableError
from geserve.metrics.custom import CustomMetricStore
from geserve.types.datatypes import BY_CONFIG

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILENAME = "model.onnx"
_OPTIMIZATION_LEVELS = {
    -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    0: ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
}


def model_path(config: ModelConfig, source: ModelSource) -> Path:
    """Triton's onnxruntime layout: `<version>/model.onnx`, a file or a folder holding `model.onnx`;
    or a compiled `<version>/model.gem`; or the compile cache's entry when compile_* parameters ask for one or the
    source is a TensorFlow model (Triton's `model.savedmodel/` or `model.graphdef`, a `.pb`, a `.keras` file)."""
    package = find_package(source.version_dir, config.default_model_filename)
    if package is not None:
        return package
    offline = find_offline_model(source.version_dir, config.default_model_filename)
    if offline is not None:
        return offline
    path = source.version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME)
    if path.is_dir() and not is_saved_model(path):
        path = path / DEFAULT_MODEL_FILENAME
    if not (path.is_file() or is_saved_model(path)):
        raise InvalidArgumentError(f"model file {path} not found for model '{config.name}'")
    return compile_on_load(config, path, source.model_dir) if wants_compile(config, path) else path


class GeBackend:
    name = "ge"
    default_model_filename = DEFAULT_MODEL_FILENAME

    def __init__(self, settings: BackendSettings | None = None) -> None:
        self._settings = settings or BackendSettings()
        # (model, the parameters it ignored) already warned about: once per model, not per version, instance or
        # reload; a config that ignores other parameters warns again.
        self._warned: set[tuple[str, tuple[str, ...]]] = set()

    @property
    def default_max_batch_size(self) -> int:
        return self._settings.get_int("default-max-batch-size", 4)

    def auto_complete_config(self, config: ModelConfig, source: ModelSource) -> None:
        path = model_path(config, source)
        if is_offline_model(path):
            auto_complete_om(config, path, self.default_max_batch_size)
            return
        auto_complete(config, path, self.default_max_batch_size)
        apply_gears(config, path)

    def create_instances(self, config: ModelConfig, source: ModelSource) -> list[ModelInstance]:
        options = parse_ge_options(config)
        self._warn_ignored(config, options.ignored)
        if options.accelerator is None and "execution_accelerators" in self._settings.values:
            options.accelerator = self._settings.values["execution_accelerators"].strip().lower() or None
        path = model_path(config, source)
        if is_offline_model(path):
            return create_om_instances(config, path, options)
        apply_gears(config, path)
        # From here on the libraries every session registers, as paths (a compiled package's own included).
        options.custom_ops = _custom_op_libraries(config, options, path, source)
        layout = _layout(config, path)
        graph = load_graph(path, self._settings.values.get("model-key-file"))
        graph, dumper = with_dump(config, options, source, graph)
        sessions = _Sessions(config, options, source, path, graph)
        placements = sessions.placements()
        threads = options.intra_op_threads or devices.threads_per_instance(len(placements))
        instances: list[GeInstance] = []
        for placement in placements:
            session, target = sessions.create(placement, threads)
            instances.append(make_instance(placement.name, session, layout, target.device, dumper))
        logger.info(
            "loaded '%s' version %d: %d instance(s) on %s, %d intra-op thread(s) each",
            config.name, source.version, len(instances), instances[0].device if instances else "-", threads,
        )
        return list(instances)

    def _warn_ignored(self, config: ModelConfig, ignored: list[str]) -> None:
        key = (config.name, tuple(ignored))
        if not ignored or key in self._warned:
            return
        self._warned.add(key)
        logger.warning(
            "model '%s' (platform '%s'): ignoring parameter(s) %s unknown to geserve, as Triton's onnxruntime "
            "backend ignores parameters it does not know (the GE dialects, platform 'graph_executor' and backend "
            "'ge' / 'npu_ge', refuse them)",
            config.name, config.platform or config.backend, ", ".join(f"'{k}'" for k in ignored),
        )


class _Sessions:
    """The sessions of one model's instances: provider options built once per accelerator family, and the graph
    every CPU session loads (the shared one, or the model's own) once."""

    def __init__(
        self, config: ModelConfig, options: GeOptions, source: ModelSource, path: Path, graph: Path | bytes
    ) -> None:
        self._config, self._options, self._source = config, options, source
        self._path, self._graph = path, graph
        self._configured = configured_accelerator(config)
        self._by_family: dict[str, dict[str, dict[str, str]]] = {}
        self._on_cpu: Path | bytes | None = None

    def accelerator(self, kind: int) -> str | None:
        # Triton's TensorRT accelerator applies to GPU instances only.
        return self._options.accelerator or (self._configured if kind == devices.KIND_GPU else None)

    def placements(self) -> list[devices.Placement]:
        config, options = self._config, self._options
        gpu_groups = [g for g in config.instance_group if g.kind == devices.KIND_GPU]
        on_cuda = any(accelerator_of(g.kind, self.accelerator(g.kind)) in ("cuda", "tensorrt") for g in gpu_groups)
        return devices.placements(
            config.instance_group, options.device_ids, options.instance_exec_blocks, options.device_exec_blocks,
            visible_gpus() if on_cuda else None, config.name,
        )

    def create(
        self, placement: devices.Placement, threads: int
    ) -> tuple[ort.InferenceSession, devices.ExecutionTarget]:
        accelerator = self.accelerator(placement.kind)
        family = accelerator_of(placement.kind, accelerator)
        target = devices.resolve_target(
            placement.kind, placement.device_id, accelerator, self._provider_options(family)
        )
        loaded = self._cpu_graph() if family == "cpu" else self._graph
        session = _create_session(self._path, loaded, self._config, self._options, target, threads, self._source)
        return session, target

    def _provider_options(self, family: str) -> dict[str, dict[str, str]]:
        if family not in self._by_family:
            self._by_family[family] = provider_options(self._config, self._options, family, self._path, self._graph)
            if family == "npu":
                _apply_ge_gears(self._config, self._options)
        return self._by_family[family]

    def _cpu_graph(self) -> Path | bytes:
        if self._on_cpu is None:
            shared = _shared_graph(self._path, self._graph, self._config, self._options, self._source)
            self._on_cpu = shared or self._graph
        return self._on_cpu


def _create(settings: BackendSettings, host: InferenceHost, custom_metrics: CustomMetricStore) -> GeBackend:
    return GeBackend(settings)


# Both GE dialects, Triton's onnxruntime and its tensorflow backend name the same backend (a TensorFlow model is
# converted to ONNX on first load); all read `--backend-config=ge,...`.
BACKEND_KIND = BackendKind(
    names=("ge", "npu_ge", "onnxruntime", "tensorflow"),
    create=_create,
    platforms={"graph_executor": "ge", "onnxruntime_onnx": "onnxruntime", "tensorflow_savedmodel": "tensorflow",
               "tensorflow_graphdef": "tensorflow"},
    implied_platforms={"onnxruntime": "onnxruntime_onnx"},
    model_files={
        DEFAULT_SOURCES["onnxruntime_onnx"]: ("onnxruntime_onnx", "onnxruntime"),
        DEFAULT_SOURCES["tensorflow_savedmodel"]: ("tensorflow_savedmodel", "tensorflow"),
        DEFAULT_SOURCES["tensorflow_graphdef"]: ("tensorflow_graphdef", "tensorflow"),
    },
)


def _apply_ge_gears(config: ModelConfig, options: GeOptions) -> None:
    """On Ascend, Graph Engine's `graph.ge.dynamicDims` gears are the batcher's unless `batch_gears` is set."""
    gears = gears_from_ge(options.ge_options)
    if gears and config.max_batch_size > 0 and "batch_gears" not in config.parameters:
        config.parameters["batch_gears"].string_value = ",".join(str(g) for g in gears if g <= config.max_batch_size)


def _layout(config: ModelConfig, path: Path) -> ModelLayout:
    """Check the config against the graph's signature and precompute the per-tensor reshapes."""
    graph_inputs, graph_outputs = read_signature(path)
    feedable = graph_inputs + read_overridable_inputs(path)
    batching = config.max_batch_size > 0
    # A sequence model's control and state inputs and its state outputs are the graph's too (the batcher feeds them).
    config_inputs = [*config.input, *sequence_inputs(config)]
    config_outputs = [*config.output, *sequence_outputs(config)]
    inputs = {t.name: _tensor_layout(config, t, feedable, "input", path, batching) for t in config_inputs}
    outputs = {t.name: _tensor_layout(config, t, graph_outputs, "output", path, batching) for t in config_outputs}
    missing = {t.name for t in graph_inputs} - set(inputs)
    if missing:
        raise InvalidArgumentError(
            f"model '{config.name}': graph input(s) {sorted(missing)} of {path} are not in the configuration"
        )
    return ModelLayout(batching, inputs, outputs, tuple(outputs))


def _tensor_layout(
    config: ModelConfig,
    tensor: model_config_pb2.ModelInput | model_config_pb2.ModelOutput,
    graph: list[GraphTensor],
    kind: str,
    path: Path,
    batching: bool,
) -> TensorLayout:
    by_name = {t.name: t for t in graph}
    found = by_name.get(tensor.name)
    if found is None:
        raise InvalidArgumentError(
            f"model '{config.name}': configuration {kind} '{tensor.name}' is not a graph {kind} of {path}; "
            f"the graph has {sorted(by_name)}"
        )
    wire = BY_CONFIG[tensor.data_type].wire
    if wire != found.wire_type:
        raise InvalidArgumentError(
            f"model '{config.name}': unexpected datatype {BY_CONFIG[tensor.data_type].config_name} for {kind} "
            f"'{tensor.name}', the graph expects TYPE_{'STRING' if found.wire_type == 'BYTES' else found.wire_type}"
        )
    config_dims = tuple(tensor.dims)
    graph_dims = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None
    _check_dims(config, tensor.name, found, kind, path, batching, graph_dims if graph_dims is not None else config_dims)
    return TensorLayout(tensor.name, wire, config_dims, graph_dims)


def _check_dims(
    config: ModelConfig, name: str, found: GraphTensor, kind: str, path: Path, batching: bool,
    checked: tuple[int, ...],
) -> None:
    """The configured dims (`checked`: the reshape's when there is one) must fit the graph's shape past the batch."""
    expected = found.shape[1:] if batching else found.shape
    compatible = len(expected) == len(checked) and all(
        -1 in (e, c) or e == c for e, c in zip(expected, checked, strict=True)
    )
    if not compatible:
        raise InvalidArgumentError(
            f"model '{config.name}': {kind} '{name}' has dims {list(checked)} in the configuration "
            f"but shape {list(found.shape)} in {path}"
            + (" (the first graph dimension is the batch)" if batching else "")
        )


def _graph_level(config: ModelConfig) -> int:
    """Triton's `optimization { graph { level } }`: 0 (all of ONNX Runtime's optimizations) when unset."""
    return config.optimization.graph.level if config.HasField("optimization") else 0


def _graph_options(config: ModelConfig, options: GeOptions, source: ModelSource) -> ort.SessionOptions:
    """The session options that shape the optimized graph: its optimization level, the `ort.*` entries and the
    custom-op libraries (shared_weights.py saves a graph made with these)."""
    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = _OPTIMIZATION_LEVELS.get(
        _graph_level(config), ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    )
    session_options.log_severity_level = 3
    # Idle intra-op threads spinning for work steal the cores the event loop and other instances need:
    # on 2 cores it doubled the CPU per request of a small model. A model may turn it back on.
    entries = {"session.intra_op.allow_spinning": "0", **options.ort_config_entries}
    for key, value in entries.items():
        try:
            session_options.add_session_config_entry(key, value)
        except Exception as exc:
            raise InvalidArgumentError(f"parameter 'ort.{key}' was refused by onnxruntime: {exc}") from None
    for library in options.custom_ops:
        library_path = source.model_dir / library
        try:
            session_options.register_custom_ops_library(str(library_path))
        except Exception as exc:
            raise UnavailableError(
                f"model '{config.name}': cannot register custom operator library {library_path}: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None
    return session_options


def _custom_op_libraries(config: ModelConfig, options: GeOptions, path: Path, source: ModelSource) -> list[str]:
    """The `custom_ops` parameter's libraries, then those a compiled package needs that it does not name (the same
    file name is the same library: ONNX Runtime refuses a domain registered twice), as paths in the model folder."""
    named = {Path(library).name for library in options.custom_ops}
    wanted = [(library, "parameter 'custom_ops'") for library in options.custom_ops]
    wanted += [(library, f"needed by the compiled model {path.name}")
               for library in package_libraries(path) if Path(library).name not in named]
    for library, origin in wanted:
        if not (source.model_dir / library).is_file():
            raise UnavailableError(
                f"model '{config.name}': custom operator library {source.model_dir / library} ({origin}) not found"
            )
    return [str(source.model_dir / library) for library, _ in wanted]


def _shared_graph(
    path: Path, graph: Path | bytes, config: ModelConfig, options: GeOptions, source: ModelSource
) -> Path | None:
    """The graph whose prepacked weights every CPU session of this model maps, in every worker (shared_weights.py);
    None with `share_weights: false` or for an encrypted model."""
    if not options.share_weights:
        return None
    if isinstance(graph, bytes) and read_manifest(path).encrypted:
        return None  # the packed copy would hold the weights in the clear
    shape = fingerprint(_graph_level(config), sorted(options.ort_config_entries.items()),
                        [file_identity(source.model_dir / library) for library in options.custom_ops])
    packed = packed_graph(path, graph, shape, lambda: _graph_options(config, options, source))
    if packed is not None:
        logger.info("model '%s' version %d: CPU sessions map the prepacked weights of %s", config.name,
                    source.version, packed)
    return packed


def _create_session(
    path: Path,
    graph: Path | bytes,
    config: ModelConfig,
    options: GeOptions,
    target: devices.ExecutionTarget,
    threads: int,
    source: ModelSource,
) -> ort.InferenceSession:
    session_options = _graph_options(config, options, source)
    session_options.intra_op_num_threads = threads
    session_options.inter_op_num_threads = options.inter_op_threads or 1
    session_options.execution_mode = (
        ort.ExecutionMode.ORT_SEQUENTIAL if options.sequential_execution else ort.ExecutionMode.ORT_PARALLEL
    )
    session_options.enable_cpu_mem_arena = options.enable_mem_arena
    session_options.enable_mem_pattern = options.enable_mem_pattern
    dump_dir = dump_folder(config, options, source)
    if options.dump_graph:
        dump_dir.mkdir(parents=True, exist_ok=True)
        session_options.optimized_model_filepath = str(dump_dir / "optimized.onnx")
    if options.profiling:
        dump_dir.mkdir(parents=True, exist_ok=True)
        session_options.enable_profiling = True
        session_options.profile_file_prefix = str(dump_dir / "profile")
    try:
        session = compute_priority.started_lowered(lambda: ort.InferenceSession(
            graph if isinstance(graph, bytes) else str(graph),
            session_options,
            providers=[name for name, _ in target.providers],
            provider_options=[opts for _, opts in target.providers],
        ))
    except Exception as exc:
        raise UnavailableError(f"onnxruntime could not load {path}: {exc}") from None
    # A provider whose libraries fail to load (CUDA, cuDNN, TensorRT) is dropped with a log line, and the session
    # runs on the CPU: an instance placed on a device must not do that unnoticed.
    wanted = target.providers[0][0]
    if wanted not in session.get_providers():
        raise UnavailableError(
            f"model '{config.name}': onnxruntime could not start {wanted} on {target.device} (are its libraries "
            f"installed: CUDA and cuDNN for the CUDA provider, TensorRT for the TensorRT one?); it offered "
            f"{', '.join(session.get_providers())}"
        )
    return session
