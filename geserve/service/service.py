"""The one front door: every call of every protocol, with its call context, grouped by Triton's API groups.

Frontends translate bytes and call here; everything that is not wire format happens here once: admission by
API group, model lookup, the decoupled refusal, request parameters, shared-memory placement, statistics with
failure reasons, classification, and the control APIs (repository, shared memory, trace, logging, statistics).

A call starts in `admit` (its policies; a refusal is recorded in the audit log there) and, for every group but
inference, its body runs inside `_call`, whose end the audit log sees with the outcome: the audit rule itself lives
in service/audit.py, and no frontend needs a hook for it (see that module).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from functools import partial
from types import TracebackType
from typing import Any, NoReturn, cast

from geserve.config import ModelConfig
from geserve.errors import (
    CancelledError,
    DeadlineExceededError,
    GeserveError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnknownModelError,
    UnknownSequenceError,
    UnsupportedError,
)
from geserve.repository.budget import ModelLoads, pin_parameter
from geserve.repository.lifecycle import ModelManager, group_index
from geserve.repository.model import LoadedModel
from geserve.scheduling.queue import Pending
from geserve.scheduling.scheduler import Schedules
from geserve.service import deadlines
from geserve.service.audit import AuditLog
from geserve.service.classification import classify
from geserve.service.cluster import Cluster
from geserve.service.context import IN_PROCESS, ApiGroup, CallContext, CallPolicy, Transport
from geserve.service.deadlines import Answer, Watched, Withdraw
from geserve.service.embeddings import Embeddings
from geserve.service.model_files import DEFAULT_MAX_FILE_BYTES, check_model_name, model_files
from geserve.service.parameters import apply_parameters
from geserve.service.raw_input import expand_raw_input
from geserve.service.response_cache import ResponseCache
from geserve.service.runtime_settings import LogSettings, LogValue
from geserve.service.shared_memory import (
    CudaRegionStatus,
    OutputPlacementError,
    RegionStatus,
    SharedMemoryRegistry,
)
from geserve.service.tracing.tracer import Tracing
from geserve.service.validation import prepare
from geserve.statistics import merge_statistics
from geserve.types import InferenceRequest, InferenceResponse
from geserve.types.requests import expiry
from geserve.types.streams import ResponseStream, StreamResponse
from geserve.types.wire import tensor_bytes
from geserve.version import __version__

logger = logging.getLogger(__name__)

SERVER_NAME = "geserve"
SHUTTING_DOWN = "Server is shutting down: it accepts no new requests"
_IN_PROCESS = Transport.IN_PROCESS
_INFERENCE = ApiGroup.INFERENCE
# What a server that is shutting down still answers from outside: health, metadata, settings, statistics. New work
# (inference, model loads) is refused; calls from models (BLS, ensemble steps) belong to requests in flight.
_REFUSED_WHILE_DRAINING = frozenset({ApiGroup.INFERENCE, ApiGroup.MODEL_REPOSITORY})
# In Triton's order. Both frontends serve system shared memory (refused unless --allow-system-shared-memory, yet
# listed, as Triton lists it), trace and logging settings; CUDA shared memory is not claimed: no region can exist.
EXTENSIONS = [
    "classification",
    "model_repository",
    "model_configuration",
    "system_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
]
# How `submit` ran a request (`InferenceService.paths`, ge_inference_path_total): at once on the loop, queued
# with a callback, or in a task (anything traced or cached, a scheduler that awaits, or with the shortcuts off).
_INLINE, _QUEUED, _TASK = "inline", "queued", "task"
# What a request whose caller went away is counted as (the failure reason CANCELED); the caller never sees it.
_CANCELLED = CancelledError("the request was cancelled: its client went away")
# How often a request waits for its model's load on demand: another load may evict it before the request reaches it.
_DEMAND_ATTEMPTS = 3
# How long before its deadline a caller's cancel is still its deadline (`_gone`): the client's clock ran out first.
_CALLER_DEADLINE_LEAD_S = 0.02
# How Triton refuses a decoupled model on a call that can carry one response only.
_DECOUPLED_REFUSAL = {
    Transport.HTTP: "HTTP end point doesn't support models with decoupled transaction policy",
    Transport.GRPC: "ModelInfer RPC doesn't support models with decoupled transaction policy",
    Transport.IN_PROCESS: "model '{}' uses the decoupled transaction policy: its responses can only be streamed",
}


class InferenceService:
    """Every operation of the server. `policies` see each call (its API group and context) before it runs."""

    def __init__(
        self,
        manager: ModelManager,
        *,
        explicit_control: bool,
        strict_readiness: bool,
        shared_memory: SharedMemoryRegistry | None = None,
        log_settings: LogSettings | None = None,
        tracing: Tracing | None = None,
        policies: Sequence[CallPolicy] = (),
        server_name: str = SERVER_NAME,
        audit: AuditLog | None = None,
        model_load_max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        response_cache: ResponseCache | None = None,
        cluster: Cluster | None = None,
        shortcuts: bool = True,
        openai_api: bool = True,
        load_on_demand: bool = False,
        loads: ModelLoads | None = None,
    ) -> None:
        self._manager = manager
        self._explicit = explicit_control
        self._strict = strict_readiness
        self.shared_memory = shared_memory if shared_memory is not None else SharedMemoryRegistry(False)
        self._log = log_settings if log_settings is not None else LogSettings()
        self._trace = tracing if tracing is not None else Tracing()
        # The tracing while any trace setting can trace a request, else None: all an untraced request pays.
        self.tracer: Tracing | None = self._trace if self._trace.on else None
        self.policies = list(policies)
        self.audit = audit
        self.response_cache = response_cache  # Triton's response cache (--cache-config); None without one
        self.server_name = server_name
        self.model_load_max_file_bytes = model_load_max_file_bytes
        # The other workers of this server (--workers N), None in a single process: control calls then run on
        # every worker, statistics add up theirs, and readiness waits for all of them.
        self.cluster = cluster
        # --load-on-demand: a request for a model in a repository that is not loaded loads it. `loads`: this process's
        # decider of loads and unloads (repository/budget.py) with a memory budget or load on demand; None with
        # workers (the supervisor decides for all) and without either.
        self.load_on_demand = load_on_demand
        self.loads = loads
        self.accepting = True
        self._inflight = 0  # inference calls under way, of every transport
        self._idle: asyncio.Event | None = None  # set when the last one ends, once someone waits for that
        self.host = ModelHost(self)
        # OpenAI's /v1/models and /v1/embeddings (--openai-api): their rules, each inference through `infer`.
        self.embeddings = Embeddings(manager, self, openai_api)
        # Whether `submit` may run a request without a task (`_shortcut`), and how many it ran each way: the switch
        # (--inference-shortcuts) and the counts that show which path served (ge_inference_path_total).
        self.shortcuts = shortcuts
        self.paths = dict.fromkeys((_INLINE, _QUEUED, _TASK), 0)
        # Set by the server once it runs: where calls from other threads (Python models' BLS) are scheduled.
        self.loop: asyncio.AbstractEventLoop | None = None

    def admit(
        self, group: ApiGroup, context: CallContext, action: str = "", model: str = "", region: str = ""
    ) -> None:
        """Every call's first step: its policies, then the refusal of new work while shutting down. `action`,
        `model` and `region` only describe the call to the audit log."""
        self.authorize(group, context, action, model, region)
        if not self.accepting and group in _REFUSED_WHILE_DRAINING and context.transport is not _IN_PROCESS:
            self._refuse(UnavailableError(SHUTTING_DOWN), group, action, model, context, region)

    def admit_ahead(
        self, group: ApiGroup, context: CallContext, action: str = "", model: str = "", version: str = ""
    ) -> None:
        """`admit`, for a frontend that admits a call before it reads or decodes the call's body (inference: a body
        from a caller who may not infer is never decoded, nor one that the model's admission control sheds by the
        rules no body changes). The context records it, and the service's own admission of that call then passes:
        each call is admitted once. A context is one call's; the shared in-process one is never marked."""
        self.admit(group, context, action, model)
        if context is not IN_PROCESS:
            context.admitted = group
            if group is _INFERENCE and model:
                self._shed_ahead(model, version, context)

    def _shed_ahead(self, name: str, version: str, context: CallContext) -> None:
        """Admission control ahead of decoding (`Admission.admit_ahead`): a refusal counted as any other. A model
        not found is left to the resolve step, which says why."""
        try:
            loaded = self._manager.get(name, version)
        except GeserveError:
            return
        admission = loaded.admission
        if admission is not None:
            started = time.monotonic_ns()
            _counted(loaded, started, partial(admission.admit_ahead, context.deadline, loaded.scheduler.inflight_count))

    def authorize(
        self, group: ApiGroup, context: CallContext, action: str = "", model: str = "", region: str = ""
    ) -> None:
        """The policies alone, for a frontend that must refuse before it starts reading (a gRPC stream, refused
        at its start as Triton does); each call it then makes is admitted as usual."""
        try:
            for policy in self.policies:
                policy.admit(group, context)
        except GeserveError as exc:
            self._refuse(exc, group, action, model, context, region)

    def _refuse(
        self, error: GeserveError, group: ApiGroup, action: str, model: str, context: CallContext, region: str
    ) -> NoReturn:
        """Every refusal of a call goes to the audit log, then to the caller."""
        if self.audit is not None:
            self.audit.refused(group, action, model, context, error, region)
        raise error

    def _call(
        self, group: ApiGroup, action: str, context: CallContext, model: str = "", region: str = ""
    ) -> _CallEnd | _NoAudit:
        """Admit a call and return what its body runs in (`with`): without an audit log nothing, else the end
        of the call reported to the audit log, with the exception that left the body if any."""
        self.admit(group, context, action, model, region)
        if self.audit is None:
            return _NO_AUDIT
        return _CallEnd(self.audit, group, action, model, region, context)

    def stop_accepting(self) -> None:
        """Readiness turns false and new inference and repository calls are refused; calls in flight go on."""
        self.accepting = False

    @property
    def inflight(self) -> int:
        return self._inflight

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no inference call is under way, at most `timeout_s`; True when none is."""
        if self._inflight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
            except asyncio.TimeoutError:  # not the builtin before 3.11
                pass
            finally:
                self._idle = None
        return not self._inflight

    def _enter(self, model: LoadedModel | None = None) -> None:
        """An inference call starts; of `model`, whose admission control then counts it held until `_leave`: counted
        before `submit` returns, so requests read in the same loop turn are admitted against each other. The model
        counts it among its users meanwhile: the memory budget never unloads a model with any."""
        self._inflight += 1
        if model is not None:
            model.users += 1
            if model.admission is not None:
                model.admission.held += 1

    def _leave(self, model: LoadedModel | None = None) -> None:
        self._inflight -= 1
        if model is not None:
            model.users -= 1
            if model.admission is not None:
                model.admission.held -= 1
        if not self._inflight and self._idle is not None:
            self._idle.set()

    # ---- health and metadata ----------------------------------------------------------------------

    def live(self, context: CallContext = IN_PROCESS) -> bool:
        with self._call(ApiGroup.HEALTH, "live", context):
            return True

    def ready(self, context: CallContext = IN_PROCESS) -> bool:
        with self._call(ApiGroup.HEALTH, "ready", context):
            return (
                self.accepting
                and (not self._strict or self._manager.all_ready())
                and (self.cluster is None or self.cluster.ready)
            )

    async def model_ready(self, name: str, version: str = "", context: CallContext = IN_PROCESS) -> bool:
        """READY in the lifecycle, and (for models whose instances check their own readiness) ready by them."""
        with self._call(ApiGroup.HEALTH, "model_ready", context, name):
            try:
                model = self._manager.get(name, version)
            except GeserveError:
                return False
            return model.readiness is None or await model.readiness()

    def server_metadata(self, context: CallContext = IN_PROCESS) -> dict[str, Any]:
        with self._call(ApiGroup.METADATA, "server_metadata", context):
            return {"name": self.server_name, "version": __version__, "extensions": EXTENSIONS}

    def model_metadata(self, name: str, version: str = "", context: CallContext = IN_PROCESS) -> dict[str, Any]:
        with self._call(ApiGroup.METADATA, "model_metadata", context, name):
            return self._model_metadata(name, version)

    def _model_metadata(self, name: str, version: str) -> dict[str, Any]:
        model = self._manager.get(name, version)
        record = self._manager.record(name)
        versions = sorted(v for v, s in record.versions.items() if s.model is not None) if record else []
        batch = [-1] if model.max_batch_size > 0 else []
        return {
            "name": name,
            "versions": [str(v) for v in versions],
            "platform": model.config.platform or model.config.backend,
            "inputs": [
                {"name": s.name, "datatype": s.wire_type, "shape": batch + list(s.dims)} for s in model.inputs.values()
            ],
            "outputs": [
                {"name": s.name, "datatype": s.wire_type, "shape": batch + list(s.dims)}
                for s in model.outputs.values()
            ],
        }

    def model_config(self, name: str, version: str = "", context: CallContext = IN_PROCESS) -> ModelConfig:
        with self._call(ApiGroup.MODEL_CONFIG, "model_config", context, name):
            return self._manager.get(name, version).config

    # ---- inference --------------------------------------------------------------------------------

    def _admit_inference(self, request: InferenceRequest, context: CallContext, action: str) -> None:
        if context.admitted is not _INFERENCE:  # else admitted by the frontend before it decoded the body
            self.admit(ApiGroup.INFERENCE, context, action, request.model_name)
        if context.transport is not _IN_PROCESS:
            # From the context only: a request from outside cannot name its own caller. A call from a model (an
            # ensemble step) carries the identity of the request it serves, set by whoever made it.
            request.identity = context.caller

    def submit(
        self, request: InferenceRequest, context: CallContext, answer: Answer, action: str = "infer"
    ) -> InferenceResponse | Withdraw:
        """The one way in for an inference with one response, from every frontend and every path: the response when
        it was answered at once (on the loop), else the call that withdraws the request (its caller went away:
        counted CANCELED, `answer` never called), `answer` being called with its response or error later. Raises
        what fails before the model runs (admission, an unknown model, a bad request, a passed deadline, a refusal by
        admission control).

        The steps, in order: admit, resolve the model, prepare (skipped for a request its frontend made from a
        remembered header of this very model: `request.prepared`), deadlines and admission control, run, account,
        place outputs.
        How it runs is the run step's choice (`_shortcut`, then a task); no frontend chooses it. A model that is not
        loaded, with load on demand, is loaded first: the resolve step waits for it (`_after_loading`)."""
        self._admit_inference(request, context, action)
        model = self._resolve(request)
        if model is None:
            return self._after_loading(request, context, answer, action)
        return self._submit(model, request, context, answer, action)

    def _submit(
        self, model: LoadedModel, request: InferenceRequest, context: CallContext, answer: Answer, action: str,
        arrived: int = 0,
    ) -> InferenceResponse | Withdraw:
        """`submit`'s steps once the model is resolved (`arrived`: when the request came, if it waited for a load)."""
        started = self._checked(model, request, context, action, arrived)
        outcome = self._shortcut(model, request, started, answer)
        if outcome is not None:
            return outcome
        self.paths[_TASK] += 1
        self._enter(model)
        if deadlines.next_due(request) is not None:
            answer = Watched(answer, request)
        frontend = action == "infer" and context.transport is not _IN_PROCESS
        task = asyncio.get_running_loop().create_task(self._traced(model, request, context, started, frontend))
        task.add_done_callback(partial(self._task_done, model, request, answer))
        withdraw = partial(_cancel, task)
        return answer.bind(withdraw) if isinstance(answer, Watched) else withdraw

    async def infer(
        self, request: InferenceRequest, context: CallContext = IN_PROCESS, action: str = "infer"
    ) -> InferenceResponse:
        """`submit`, awaited: for callers that are coroutines (the in-process API, models' BLS calls and ensemble
        steps, an ASGI host, grpc.aio). A cancelled caller withdraws its request."""
        future: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()
        outcome = self.submit(request, context, partial(_settle, future), action)
        if isinstance(outcome, InferenceResponse):
            return outcome
        try:
            return await future
        except asyncio.CancelledError:
            outcome()
            raise

    def _checked(
        self, model: LoadedModel, request: InferenceRequest, context: CallContext, action: str, arrived: int = 0
    ) -> int:
        """Prepare `request` for its model and check its deadlines and admission: when it started (when it arrived,
        for one that waited for its model's load: that wait is its queue time)."""
        if model.decoupled and action == "infer":
            raise UnsupportedError(_DECOUPLED_REFUSAL[context.transport].format(model.name))
        started = time.monotonic_ns()
        if arrived:
            request.waited_ns, started = started - arrived, arrived
        self._gate(model, request, context, started)
        return started

    # ---- load on demand: the resolve step waits for the model's load ----------------------------------

    def _resolve(self, request: InferenceRequest) -> LoadedModel | None:
        """The request's model; None for one that is not loaded and that load on demand will load."""
        try:
            return self._lookup(request)
        except (UnknownModelError, UnavailableError):
            if not self._loads_on_demand(request.model_name):
                raise
            return None

    def _loads_on_demand(self, name: str) -> bool:
        return self.load_on_demand and not self._manager.is_up(name) and self._manager.folder(name) is not None

    def _after_loading(self, request: InferenceRequest, context: CallContext, answer: Answer, action: str) -> Withdraw:
        """A task waits for the model's load (within the request's deadline), then submits the request as if it had
        found it loaded; the caller's withdrawal ends the wait, or withdraws the request once submitted."""
        later = _AfterLoad()
        task = asyncio.get_running_loop().create_task(self._load_then_submit(request, context, answer, action, later))
        later.task = task
        return later

    async def _load_then_submit(
        self, request: InferenceRequest, context: CallContext, answer: Answer, action: str, later: _AfterLoad
    ) -> None:
        arrived = time.monotonic_ns()
        try:
            model = await self._loaded(request, context)
            outcome = self._submit(model, request, context, answer, action, arrived)
        except asyncio.CancelledError:  # withdrawn while its model loaded: nobody to answer
            return
        except Exception as exc:  # the load failed or did not fit, its deadline passed, the request was refused
            _deliver(answer, exc, request.model_name)
            return
        if isinstance(outcome, InferenceResponse):
            _deliver(answer, outcome, request.model_name)
        else:
            later.withdraw = outcome

    async def _loaded(self, request: InferenceRequest, context: CallContext) -> LoadedModel:
        """The request's model, loaded on demand by the server's one decider and looked up again. A model evicted again
        to make room for another before this request reached it is loaded again, a few times at most."""
        for _ in range(_DEMAND_ATTEMPTS):
            await deadlines.within(self._demand(request.model_name), request, context.deadline)
            model = self._resolve(request)
            if model is not None:
                return model
        return self._lookup(request)

    async def _demand(self, name: str) -> None:
        """Have `name` loaded: the server decides (the supervisor with workers), under the memory budget if any."""
        decider: Cluster | ModelLoads | None = self.cluster if self.cluster is not None else self.loads
        if decider is None:
            raise InternalError("load on demand needs the server's decider of loads")
        await decider.demand(name)

    def _gate(self, model: LoadedModel, request: InferenceRequest, context: CallContext, started: int) -> None:
        """From a resolved model to a request it may start: its decoding fault and parameters, its deadlines,
        admission control (before the checks of its tensors: a request shed under overload costs no validation),
        prepare, then a deadline already passed (after the checks, as Triton's scheduler finds a timeout)."""
        if request.fault is not None:
            raise request.fault
        apply_parameters(request, context.transport)
        deadlines.assign(request, context.deadline, model.scheduler, started / 1e9)
        admission = model.admission if context.transport is not _IN_PROCESS else None
        if admission is not None:
            _counted(model, started, partial(admission.admit, request, model.scheduler.inflight_count))
        self._prepare_once(model, request, context)
        if deadlines.next_due(request) is not None:
            _counted(model, started, partial(deadlines.check, request))

    def _prepare_once(self, model: LoadedModel, request: InferenceRequest, context: CallContext) -> None:
        """Prepare `request`, or apply what preparing the request of the same remembered header for this very model
        made (`request.prepared`). A request the model never sees is no failure of the model's: nothing counted."""
        prepared = request.prepared
        if prepared is not None and prepared.model is model and self.shortcuts:
            if prepared.order is not None:
                request.inputs = [request.inputs[i] for i in prepared.order]
            request.batch_size = prepared.batch_size
        else:
            self._prepare(model, request, context)
            request.checked_by = model

    def _shortcut(
        self, model: LoadedModel, request: InferenceRequest, started: int, answer: Answer
    ) -> InferenceResponse | Withdraw | None:
        """The run step without a task, where nothing needs one (no tracer, no response cache): the response of a
        model whose scheduler runs it now, on the loop; or the withdrawal of a request its scheduler queued with a
        callback. None, having done nothing, where a task must run it (or the shortcuts are off)."""
        if not self.shortcuts or self.tracer is not None or model.response_cache:
            return None
        scheduler = model.scheduler
        if scheduler.runs_now():
            self.paths[_INLINE] += 1
            return self._run_now(model, request, started)
        schedule = getattr(scheduler, "schedule", None)
        if schedule is None:
            return None
        watched = Watched(answer, request) if deadlines.next_due(request) is not None else None
        done = partial(self._finished, model, request, started, watched or answer)
        try:
            pending = schedule(request, done)
        except Exception as exc:  # a refusal (a full queue): counted as `_run` counts it
            _account(model, started, exc)
            raise
        if pending is None:
            return None
        self.paths[_QUEUED] += 1
        self._enter(model)
        withdraw = partial(self._withdraw, cast(Schedules, scheduler), pending, model, request, started)
        return withdraw if watched is None else watched.bind(withdraw)

    def _run_now(self, model: LoadedModel, request: InferenceRequest, started: int) -> InferenceResponse:
        self._enter(model)
        try:
            response = self._succeeded(model, request, model.scheduler.run_now(request), started)
        except Exception as exc:  # as in `_run`
            _account(model, started, exc)
            raise
        finally:
            self._leave(model)
        self._place_outputs(request, response)
        return response

    def _withdraw(
        self, scheduler: Schedules, pending: Pending, model: LoadedModel, request: InferenceRequest, started: int
    ) -> None:
        if scheduler.withdraw(pending):
            self._leave(model)
            request.cancelled = True
            _account(model, started, _gone(request))

    def _finished(
        self, model: LoadedModel, request: InferenceRequest, started: int, answer: Answer,
        result: InferenceResponse | BaseException,
    ) -> None:
        """Called by the scheduler as a queued request's batch completes: counted as `_run` counts it, then answered.
        Raises nothing (the other requests of the batch are answered after it)."""
        self._leave(model)
        if request.cancelled and not isinstance(result, BaseException):  # its deadline passed while it ran
            result = _gone(request)
        outcome: InferenceResponse | Exception
        if isinstance(result, BaseException):
            outcome = _as_error(result)
            _account(model, started, outcome)
        else:
            outcome = self._answer_of(model, request, result, started)
        _deliver(answer, outcome, model.name)

    def _answer_of(
        self, model: LoadedModel, request: InferenceRequest, response: InferenceResponse, started: int
    ) -> InferenceResponse | Exception:
        """A model's answer as delivered (`_succeeded`, its outputs placed where asked), or what failed it, counted:
        DeadlineExceededError once its deadline passed (a success is never delivered after it, even when its timer
        has not run yet: the loop was busy, or both are due in the same turn). That one is made, not raised: a
        raised error's traceback holds the frames that keep it, a cycle only the cyclic collector frees (its
        collections stalled the loop for tens of ms at 4x overload)."""
        deadline = request.deadline
        if deadline is not None and deadline <= time.monotonic():
            expired = DeadlineExceededError()
            _account(model, started, expired)
            return expired
        try:
            outcome = self._succeeded(model, request, response, started)
        except Exception as exc:
            _account(model, started, exc)
            return exc
        try:
            self._place_outputs(request, outcome)
        except Exception as exc:
            return exc
        return outcome

    def _task_done(
        self, model: LoadedModel, request: InferenceRequest, answer: Answer, task: asyncio.Task[InferenceResponse]
    ) -> None:
        self._leave(model)
        if task.cancelled():  # withdrawn: counted CANCELED by `_execute`, and nobody to answer
            return
        error = task.exception()
        outcome: InferenceResponse | Exception
        if error is None:
            outcome = task.result()
            try:
                self._place_outputs(request, outcome)
            except Exception as exc:
                outcome = exc
        else:
            outcome = _as_error(error)
        _deliver(answer, outcome, model.name)

    async def _traced(
        self, model: LoadedModel, request: InferenceRequest, context: CallContext, started: int, frontend: bool
    ) -> InferenceResponse:
        tracer = self.tracer
        if tracer is None:
            return await self._execute(model, request, started)
        return await tracer.run(model, request, context, started, self._execute, frontend)

    def decoupled(self, name: str, version: str = "") -> bool:
        """Whether the model's transaction policy is decoupled (Triton's TRITONSERVER_ServerModelTransactionProperties),
        asked when a stream reads a request: a decoupled model's responses are streamed (`infer_stream`), any other's
        one response is `submit`'s and keeps its request's place. False for a model not found, whose error then takes
        its place, as in Triton."""
        try:
            return self._manager.get(name, version).decoupled
        except GeserveError:
            return False

    async def infer_stream(
        self, request: InferenceRequest, context: CallContext = IN_PROCESS
    ) -> AsyncGenerator[StreamResponse, None]:
        """Each response of `request` as the model sends it, the last flagged final: any number for a decoupled
        model, one otherwise (`submit`'s). Faults found before the model runs are raised; later ones come as items."""
        if self._loads_on_demand(request.model_name):  # loaded first: whether it streams is its config's to say
            self.admit_ahead(_INFERENCE, context, "infer_stream", request.model_name)
            await self._loaded(request, context)
        if not self.decoupled(request.model_name, request.model_version):
            yield StreamResponse(await self.infer(request, context, "infer_stream"), final=True)
            return
        self._admit_inference(request, context, "infer_stream")
        self._enter()
        model: LoadedModel | None = None
        try:
            model = self._lookup(request)
            model.users += 1  # the memory budget never unloads a model under a stream
            started = time.monotonic_ns()
            # Its deadline is checked now and seen by the model (`request.deadline()`); a stream under way is not cut.
            self._gate(model, request, context, started)
            responses = self._decoupled_responses(model, request, started)
            try:
                async for item in responses:
                    yield item
            finally:
                await responses.aclose()  # at once, not when collected: its cancel and statistics are due now
        finally:
            self._leave()
            if model is not None:
                model.users -= 1

    async def _decoupled_responses(
        self, model: LoadedModel, request: InferenceRequest, started: int
    ) -> AsyncGenerator[StreamResponse, None]:
        stream = ResponseStream(asyncio.get_running_loop())
        request.stream = stream
        execution = asyncio.ensure_future(model.scheduler.enqueue(request))
        execution.add_done_callback(lambda done: _fail_unfinished(stream, done))
        version = request.model_version = str(model.version)  # what a final flag sent alone is answered with
        error: GeserveError | None = None
        read_final = False
        try:
            async for item in stream:
                if item.response is not None:
                    item.response.model_version = version
                    self._place_outputs(request, item.response)
                error, read_final = item.error, item.final
                yield item
        except GeserveError as exc:  # an output its shared memory region cannot hold
            error, read_final = exc, True
            raise
        finally:
            if not read_final:
                stream.cancelled = True  # the reader left early: the model's senders see is_cancelled()
                request.cancelled = True
                error = CancelledError("the client stopped reading the responses")
                # A request still queued leaves its scheduler and never runs; one running finishes, unread.
                execution.cancel()
            _account(model, started, error)

    def _lookup(self, request: InferenceRequest) -> LoadedModel:
        try:
            return self._manager.get(request.model_name, request.model_version)
        except NotFoundError as exc:
            raise UnknownModelError(exc.message) from None

    def _prepare(self, model: LoadedModel, request: InferenceRequest, context: CallContext) -> None:
        """Triton's order once the model is known (after the decoding fault and the parameters, `_gate`): the output
        placements, then the core's checks, then the faults Triton's core finds after them."""
        if request.outputs is not None:
            for output in request.outputs:
                if output.shm is not None:  # the region must hold the window now: Triton checks before inference
                    self.shared_memory.read(*output.shm)
        if request.raw_input is not None:
            expand_raw_input(model, request, request.raw_input)
        prepare(model, request)
        if request.late_fault is not None:
            raise request.late_fault

    async def _execute(self, model: LoadedModel, request: InferenceRequest, started: int) -> InferenceResponse:
        """The model's answer: from the response cache for a model that uses it (decided at load, so any other model
        pays this one attribute test), else from its scheduler (`_run`).

        A cancelled call (the gRPC client cancelled, the HTTP client disconnected, the ensemble it is a step of was
        cancelled) arrives here as asyncio.CancelledError, a BaseException that `_run` does not count: it is counted
        here, once, as CANCELED. The scheduler it was awaiting has already taken a queued request out (it never runs)
        or left an executing one to finish its batch (its result is dropped); the request's flag tells a model that
        polls it."""
        try:
            if model.response_cache:
                cache = self.response_cache
                if cache is not None:
                    return await cache.execute(model, request, started, self._run)
            return await self._run(model, request, started)
        except asyncio.CancelledError:
            request.cancelled = True
            _account(model, started, _gone(request))
            raise

    async def _run(self, model: LoadedModel, request: InferenceRequest, started: int) -> InferenceResponse:
        try:
            try:
                response = await model.scheduler.enqueue(request)
            except UnknownSequenceError:
                forwarded = await self._forward_sequence(request)
                if forwarded is None:
                    raise
                if request.outputs is not None:
                    _apply_classification(model, request, forwarded)
                return forwarded  # counted by the worker that ran it
            return self._succeeded(model, request, response, started)
        except Exception as exc:  # counted whatever failed, then answered by the frontend's error table
            _account(model, started, exc)
            raise

    @staticmethod
    def _succeeded(
        model: LoadedModel, request: InferenceRequest, response: InferenceResponse, started: int
    ) -> InferenceResponse:
        """The model's answer, classified as asked and counted as a success."""
        if request.outputs is not None:
            _apply_classification(model, request, response)
        _account(model, started)
        response.model_version = str(model.version)
        return response

    async def _forward_sequence(self, request: InferenceRequest) -> InferenceResponse | None:
        """A request of a sequence another worker holds (its START came in on another connection) runs there;
        None when this server runs one process, or no worker holds it."""
        if self.cluster is None or request.stream is not None:
            return None
        request.checked_by = request.prepared = None  # this process's model objects: the request travels without
        return await self.cluster.forward_sequence(request)

    async def run_forwarded(self, request: InferenceRequest) -> InferenceResponse | None:
        """Another worker's request of a sequence (`_forward_sequence`): its answer when this worker holds the
        sequence, else None. The request was admitted and checked by the worker it came to."""
        model = self._lookup(request)
        self._enter(model)
        started = time.monotonic_ns()
        try:
            response = await model.scheduler.enqueue(request)
        except UnknownSequenceError:
            return None
        except Exception as exc:
            _account(model, started, exc)
            raise
        finally:
            self._leave(model)
        _account(model, started)
        response.model_version = str(model.version)
        return response

    def _place_outputs(self, request: InferenceRequest, response: InferenceResponse) -> None:
        """Write the outputs the client placed in shared memory into their regions."""
        if request.outputs is None:
            return
        placed = {o.name: o.shm for o in request.outputs if o.shm is not None}
        if not placed:
            return
        for output in response.outputs:
            location = placed.get(output.name)
            if location is not None:
                try:
                    self.shared_memory.write(*location, output.name, tensor_bytes(output))
                except InternalError as exc:
                    raise OutputPlacementError(exc.message) from None

    # ---- model repository -------------------------------------------------------------------------

    def repository_index(self, ready_only: bool = False, context: CallContext = IN_PROCESS) -> list[dict[str, Any]]:
        with self._call(ApiGroup.MODEL_REPOSITORY, "repository_index", context):
            return self._manager.index(ready_only)

    def model_list(self, context: CallContext = IN_PROCESS) -> list[dict[str, Any]]:
        """The index grouped by model (`GET /v2/models`): each model's name, its state (READY when a version is) and
        its versions with theirs. Admitted as the index is."""
        with self._call(ApiGroup.MODEL_REPOSITORY, "model_list", context):
            return group_index(self._manager.index())

    async def load_model(
        self, name: str, parameters: dict[str, Any] | None = None, context: CallContext = IN_PROCESS
    ) -> None:
        """Load (or reload) `name`. The `config` parameter (JSON text) overrides its config.pbtxt; with
        `file:<version>/<name>` parameters too (Triton's model file override: base64 text over HTTP, bytes over
        gRPC and in process), the model loads from those files, written into a private folder, instead of the
        repository's (service/model_files.py has the rules)."""
        with self._call(ApiGroup.MODEL_REPOSITORY, "load_model", context, name):
            await self._everywhere("load_model", name, parameters or {}, context.transport)

    async def _load_model(self, name: str, parameters: dict[str, Any], transport: Transport) -> None:
        self._require_explicit()  # Triton's order: the control mode, the model's name, then the parameters
        check_model_name(name)
        config = parameters.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidArgumentError("Config parameter 'config' must have string type for its value")
        files = model_files(parameters, transport, self.model_load_max_file_bytes, name)
        pin = pin_parameter(parameters)
        if self.loads is None:
            await self._manager.load(name, config, files)
        else:
            await self.loads.load(name, partial(self._manager.load, name, config, files), pin)

    async def unload_model(self, name: str, context: CallContext = IN_PROCESS) -> None:
        with self._call(ApiGroup.MODEL_REPOSITORY, "unload_model", context, name):
            await self._everywhere("unload_model", name)

    async def _unload_model(self, name: str) -> None:
        self._require_explicit()
        if self.loads is None:
            await self._manager.unload(name)
        else:
            await self.loads.unload(name, partial(self._manager.unload, name))

    def _require_explicit(self) -> None:
        if not self._explicit:
            raise UnavailableError("explicit model load / unload is not allowed if polling is enabled")

    # ---- statistics -------------------------------------------------------------------------------

    async def statistics(
        self, name: str = "", version: str = "", context: CallContext = IN_PROCESS
    ) -> dict[str, Any]:
        """The statistics of the whole server: with several workers, every worker's added up."""
        with self._call(ApiGroup.STATISTICS, "statistics", context, name):
            local = self._statistics(name, version)  # this worker's errors first (an unknown model, version)
            if self.cluster is None:
                return local
            return merge_statistics(await self.cluster.gather("statistics", name, version))

    def _statistics(self, name: str, version: str) -> dict[str, Any]:
        if name:
            record = self._manager.record(name)
            models = [s.model for _, s in sorted(record.versions.items()) if s.model is not None] if record else []
            if not models:
                raise InvalidArgumentError(f"requested model '{name}' is not available")
            if version:
                models = [m for m in models if str(m.version) == version]
                if not models:
                    raise InvalidArgumentError(f"requested model version is not available for model '{name}'")
        else:
            models = sorted(self._manager.models(), key=lambda m: (m.name, m.version))
        return {"model_stats": [_model_stats(m) for m in models]}

    # ---- shared memory ----------------------------------------------------------------------------

    def shared_memory_status(self, name: str = "", context: CallContext = IN_PROCESS) -> list[RegionStatus]:
        with self._call(ApiGroup.SHARED_MEMORY, "shared_memory_status", context, region=name):
            return self.shared_memory.status(name)

    async def register_shared_memory(
        self, name: str, key: str, offset: int, byte_size: int, context: CallContext = IN_PROCESS
    ) -> None:
        """A region every worker can read inputs from and write outputs to."""
        with self._call(ApiGroup.SHARED_MEMORY, "register_shared_memory", context, region=name):
            await self._everywhere("register_shared_memory", name, key, offset, byte_size)

    async def unregister_shared_memory(self, name: str = "", context: CallContext = IN_PROCESS) -> None:
        with self._call(ApiGroup.SHARED_MEMORY, "unregister_shared_memory", context, region=name):
            await self._everywhere("unregister_shared_memory", name)

    # CUDA regions (device memory shared by an IPC handle); where CUDA cannot open one, Triton's answers there.

    def cuda_shared_memory_status(
        self, name: str = "", context: CallContext = IN_PROCESS
    ) -> list[CudaRegionStatus]:
        with self._call(ApiGroup.SHARED_MEMORY, "cuda_shared_memory_status", context, region=name):
            return self.shared_memory.cuda_status(name)

    async def register_cuda_shared_memory(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, context: CallContext = IN_PROCESS
    ) -> None:
        """A device region every worker opens from its IPC handle."""
        with self._call(ApiGroup.SHARED_MEMORY, "register_cuda_shared_memory", context, region=name):
            await self._everywhere("register_cuda_shared_memory", name, raw_handle, device_id, byte_size)

    async def unregister_cuda_shared_memory(self, name: str = "", context: CallContext = IN_PROCESS) -> None:
        """Unregistering a region that does not exist succeeds, as in Triton."""
        with self._call(ApiGroup.SHARED_MEMORY, "unregister_cuda_shared_memory", context, region=name):
            await self._everywhere("unregister_cuda_shared_memory", name)

    # ---- trace and logging ------------------------------------------------------------------------

    async def trace_setting(
        self, model: str = "", changes: dict[str, list[str]] | None = None, context: CallContext = IN_PROCESS
    ) -> dict[str, list[str]]:
        """The trace settings of `model` (the server's when empty), after applying `changes` if any (on every
        worker)."""
        with self._call(ApiGroup.TRACE, "trace_setting", context, model):
            if model:
                try:
                    self._manager.get(model)
                except NotFoundError:
                    raise InvalidArgumentError(f"Request for unknown model : {model}") from None
            if not changes:
                return self._trace.settings.get(model)
            return await self._everywhere("trace_setting", model, changes, context.transport is Transport.GRPC)

    def _update_trace_setting(self, model: str, changes: dict[str, list[str]], grpc: bool) -> dict[str, list[str]]:
        values = self._trace.settings.update(changes, model, grpc)
        self.tracer = self._trace if self._trace.on else None
        return values

    def close_tracing(self) -> None:
        """Write the trace file, or export the spans still queued (the server is stopping)."""
        self._trace.close()

    async def log_settings(
        self, changes: dict[str, LogValue] | None = None, context: CallContext = IN_PROCESS
    ) -> dict[str, LogValue]:
        with self._call(ApiGroup.LOGGING, "log_settings", context):
            return await self._everywhere("log_settings", changes) if changes else self._log.get()

    # ---- control calls of the whole server ----------------------------------------------------------

    async def _everywhere(self, method: str, *args: Any) -> Any:
        """Run a control call (one of cluster.CONTROL_CALLS) on every worker of the server, or here in one
        process; the caller has admitted it."""
        if self.cluster is None:
            return await self.run_control(method, args)
        return await self.cluster.broadcast(method, *args)

    async def run_control(self, method: str, args: tuple[Any, ...]) -> Any:
        """The body of a control call, on this worker: admitted by the worker the call came to."""
        if method == "load_model":
            return await self._load_model(*args)
        if method == "unload_model":
            return await self._unload_model(*args)
        # Poll mode with workers: what the supervisor's scan found changed (repository/poller.py), not a request.
        if method == "poll_load":
            return await self._manager.load(*args)
        if method == "poll_unload":
            return await self._manager.unload(*args)
        if method.endswith("_shared_memory"):
            return self._region_control(method, args)
        if method == "log_settings":
            return self._log.update(*args)
        if method == "trace_setting":
            return self._update_trace_setting(*args)
        if method == "statistics":
            return self._statistics(*args)
        raise InternalError(f"unknown control call '{method}'")

    def _region_control(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "register_shared_memory":
            return self.shared_memory.register(*args)
        if method == "unregister_shared_memory":
            return self.shared_memory.unregister(*args)
        if method == "register_cuda_shared_memory":
            return self.shared_memory.register_cuda(*args)
        if method == "unregister_cuda_shared_memory":
            return self.shared_memory.unregister_cuda(*args)
        raise InternalError(f"unknown control call '{method}'")


class _NoAudit:
    """What a call's body runs in without an audit log: nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        return None


_NO_AUDIT = _NoAudit()


class _CallEnd:
    """What a call's body runs in with an audit log: its end, and how it ended, reported there."""

    __slots__ = ("_action", "_audit", "_context", "_group", "_model", "_region")

    def __init__(
        self, audit: AuditLog, group: ApiGroup, action: str, model: str, region: str, context: CallContext
    ) -> None:
        self._audit, self._group, self._action = audit, group, action
        self._model, self._region, self._context = model, region, context

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if isinstance(error, asyncio.CancelledError):  # the client went away: nothing ended here to record
            return
        self._audit.finished(self._group, self._action, self._model, self._context, error, self._region)


class ModelHost:
    """The service as models see it (`InferenceHost`): BLS calls and ensemble steps are in-process calls."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._service.loop

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        return await self._service.infer(request, IN_PROCESS)

    def infer_stream(self, request: InferenceRequest) -> AsyncGenerator[StreamResponse, None]:
        return self._service.infer_stream(request, IN_PROCESS)


def _cancel(task: asyncio.Task[InferenceResponse]) -> None:
    task.cancel()


class _AfterLoad:
    """The withdrawal of a request waiting for its model's load (`_after_loading`): the wait ends; once the request is
    submitted, the submitted request's own withdrawal."""

    __slots__ = ("task", "withdraw")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.withdraw: Withdraw | None = None

    def __call__(self) -> None:
        if self.withdraw is not None:
            self.withdraw()
        elif self.task is not None:
            self.task.cancel()


def _counted(model: LoadedModel, started: int, check: Callable[[], None]) -> None:
    """Run `check`; a refusal it raises (a passed deadline, admission control's) is counted before it goes on."""
    try:
        check()
    except GeserveError as exc:
        _account(model, started, exc)
        raise


def _model_stats(model: LoadedModel) -> dict[str, Any]:
    """A version's statistics, with what it costs in memory where measured (a memory budget): Triton's
    `memory_usage`, the host memory its load added (repository/memory.py)."""
    stats = model.statistics.as_json(model.name, str(model.version))
    if model.memory:
        stats["memory_usage"] = [{"type": "CPU", "id": 0, "byte_size": model.memory}]
    return stats


def _account(model: LoadedModel, started: int, error: BaseException | None = None) -> None:
    """The one record of an inference's outcome in its model's statistics, for every path: a success, or a failure
    under its reason (a cancel as CANCELED, a passed deadline as DEADLINE_EXCEEDED). A success is also admission's
    latency sample. A response-cache hit is recorded by the cache, as
    Triton records it (a success with its own lookup time)."""
    elapsed = time.monotonic_ns() - started
    if error is None:
        model.statistics.record_success(elapsed)
        admission = model.admission
        if admission is not None:
            admission.observe(elapsed, model.scheduler.inflight_count)
    else:
        model.statistics.record_failure(elapsed, error)


def _gone(request: InferenceRequest) -> GeserveError:
    """What a request withdrawn from its model is counted as: the deadline that passed (the timer of `Watched`
    withdrew it), else its caller went away. A caller that goes away just before its deadline went at it: a gRPC
    client cancels at its own deadline, which the server's, taken on arrival from the rounded `grpc-timeout`, trails
    by the transit time."""
    now = time.monotonic()
    deadline = request.deadline
    if deadline is not None and deadline - _CALLER_DEADLINE_LEAD_S <= now:
        return DeadlineExceededError()
    return expiry(request, now) or _CANCELLED


def _as_error(error: BaseException) -> Exception:
    """What a run that raised answers: its exception, or for a BaseException (not a client's fault) an internal one."""
    return error if isinstance(error, Exception) else InternalError(f"execution failed: {error!r}")


def _settle(future: asyncio.Future[InferenceResponse], outcome: InferenceResponse | Exception) -> None:
    if future.done():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _deliver(answer: Answer, outcome: InferenceResponse | Exception, model: str) -> None:
    """Hand a request's outcome to its caller; a caller that raises is logged (a batch's other answers go on)."""
    try:
        answer(outcome)
    except Exception:
        logger.exception("answering an inference of model '%s' failed", model)


def _fail_unfinished(stream: ResponseStream, execution: asyncio.Future[InferenceResponse]) -> None:
    """A request the scheduler failed (timeout, unload, a crashed execution) ends its stream with the error."""
    if execution.cancelled():
        if not stream.cancelled:  # else its reader left (and cancelled it): the model's later sends are dropped
            stream.fail(UnavailableError("the request was cancelled before its model answered"))
        return
    error = execution.exception()
    if error is not None:
        stream.fail(error if isinstance(error, GeserveError) else InternalError(f"execution failed: {error}"))


def _apply_classification(model: LoadedModel, request: InferenceRequest, response: InferenceResponse) -> None:
    wanted = {o.name: o.classification for o in request.outputs or () if o.classification}
    if not wanted:
        return
    batching = model.max_batch_size > 0
    response.outputs = [
        classify(o, wanted[o.name], model.labels.get(o.name), batching) if o.name in wanted else o
        for o in response.outputs
    ]
