"""`dump_data: true` on ONNX Runtime targets (CPU, CUDA, ...): every tensor of the first `dump_data_batches` (16)
executed batches as `.npy`, in the dump folders `geserve compare` reads (geserve/compiler/dumps.py)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from geserve.backends.base import ModelSource
from geserve.backends.ge.instance import GeInstance, ModelLayout
from geserve.backends.ge.parameters import GeOptions
from geserve.compiler.dumps import BATCH_PREFIX, batch_name, write_batch
from geserve.compiler.layers import LayerTensor, describe, expose
from geserve.config import ModelConfig
from geserve.errors import UnavailableError

logger = logging.getLogger(__name__)


def dump_folder(config: ModelConfig, options: GeOptions, source: ModelSource) -> Path:
    """Where a model version's dump_graph, profiling and dump_data files go."""
    root = Path(options.dump_path) if options.dump_path else Path(tempfile.gettempdir()) / "geserve_dump"
    return root / config.name / str(source.version)


class DataDumper:
    """One model version's dump, shared by its instances: each batch folder is taken once (an exclusive mkdir, so
    worker processes sharing the folder never write into the same one) until `limit` are written."""

    def __init__(self, model: str, folder: Path, tensors: list[LayerTensor], limit: int) -> None:
        self.folder = folder
        self.extra_names = tuple(t.name for t in tensors if t.kind != "input")
        self._model, self._tensors, self._limit = model, tensors, limit
        self._lock = threading.Lock()
        self._number = 0

    def claim(self) -> Path | None:
        """The next batch folder, created; None once `limit` batches are taken."""
        with self._lock:
            while self._number < self._limit:
                self._number += 1
                folder = self.folder / batch_name(self._number)
                try:
                    folder.mkdir(parents=True)
                    return folder
                except FileExistsError:
                    continue
                except OSError as exc:
                    self._stop(f"cannot create {folder}: {exc.strerror or exc}")
            return None

    def write(self, folder: Path, values: dict[str, np.ndarray]) -> None:
        try:
            write_batch(folder, self._tensors, values)
        except OSError as exc:
            with self._lock:
                self._stop(f"cannot write {folder}: {exc.strerror or exc}")
            return
        if folder.name == batch_name(self._limit):
            logger.info("model '%s': dump_data wrote %d batches under %s; writing no more (parameter "
                        "dump_data_batches)", self._model, self._limit, self.folder)

    def _stop(self, reason: str) -> None:
        logger.warning("model '%s': dump_data stops: %s", self._model, reason)
        self._number = self._limit


class DumpingInstance(GeInstance):
    """A GE instance that also fetches every intermediate tensor of the batches it runs and writes them; once the
    dump is complete it runs as a plain instance."""

    def __init__(self, name: str, session: ort.InferenceSession, layout: ModelLayout, device: str,
                 dumper: DataDumper) -> None:
        super().__init__(name, session, layout, device)
        self.inline_allowed = False  # every batch writes its tensors to disk: never wait for a disk on the loop
        self._dumper = dumper
        self._model_run = self._run
        self._run = self._run_and_dump

    def _run_and_dump(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        folder = self._dumper.claim()
        if folder is None:
            self._run = self._model_run
            return self._model_run(names, feed)
        requested = set(names)
        wanted = [*names, *(n for n in self._dumper.extra_names if n not in requested)]
        results = self._model_run(wanted, feed)
        self._dumper.write(folder, {**feed, **dict(zip(wanted, results, strict=True))})
        return results[:len(names)]


def with_dump(
    config: ModelConfig, options: GeOptions, source: ModelSource, graph: Path | bytes
) -> tuple[Path | bytes, DataDumper | None]:
    """With dump_data: the graph with every tensor exposed and the model version's dumper; else `graph` as it is.

    The dump goes to `<dump_path, else <temp dir>/geserve_dump>/<model>/<version>/batch_000001/`, ...; a load
    clears the batch folders an earlier load of the version left. Every intermediate tensor is a graph output, so
    ONNX Runtime keeps each (and fuses nothing across them: slower, for debugging only); once the bound is reached
    there is one log line and the instances run the model's outputs alone. An `.om` model dumps through pyACL.
    """
    if not options.dump_data:
        return graph, None
    try:
        model = onnx.load_from_string(graph) if isinstance(graph, bytes) else onnx.load(str(graph))
        tensors = describe(model)
        exposed = expose(model, [t.name for t in tensors if t.kind == "layer"]).SerializeToString()
    except Exception as exc:
        raise UnavailableError(f"model '{config.name}': dump_data cannot expose the graph's tensors: "
                               f"{(str(exc).splitlines() or [type(exc).__name__])[0]}") from None
    options.share_weights = False  # the CPU sessions load the exposed graph, not the model's shared prepacked one
    folder = dump_folder(config, options, source)
    for stale in folder.glob(f"{BATCH_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    logger.info("model '%s' version %d: dump_data writes every tensor of up to %d batches under %s",
                config.name, source.version, options.dump_data_batches, folder)
    return exposed, DataDumper(config.name, folder, tensors, options.dump_data_batches)


def make_instance(name: str, session: ort.InferenceSession, layout: ModelLayout, device: str,
                  dumper: DataDumper | None) -> GeInstance:
    if dumper is None:
        return GeInstance(name, session, layout, device)
    return DumpingInstance(name, session, layout, device, dumper)
