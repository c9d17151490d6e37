"""Python models in processes of their own (`isolation: process`), on a real server with the real clients: a native
crash fails only the requests its process held, each answered with an error; the instance restarts and serves again
within 10 s while other models keep serving, with one worker and with the default workers; restarts that fail back
off and answer at once; unload ends the process; request.deadline(), is_cancelled() and large tensors cross the
process boundary. (BLS, decoupled streams, readiness, logs and custom metrics of isolated models: the `isolated`
half of tests/test_python_backend.py and tests/test_python_metrics.py.)"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.python_repo import ISOLATION, geserve_repository
from tests.support.server import RunningServer, geserve
from tests.support.streams import stream_request, summarized

ECHO_MODEL = '''
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUT = IN; LEFT = request.deadline() (-1 without one). With WAIT_MS, waits that long first, polling
    is_cancelled(), and leaves a file `cancelled-<request id>` beside its config when it sees it."""

    def initialize(self, args):
        self.markers = Path(args["model_repository"])

    def execute(self, requests):
        responses = []
        for request in requests:
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT_MS")
            if wait is not None:
                end = time.monotonic() + float(wait.as_numpy()[0]) / 1000
                while time.monotonic() < end:
                    if request.is_cancelled():
                        (self.markers / f"cancelled-{request.request_id()}").touch()
                        break
                    time.sleep(0.01)
            left = request.deadline()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()),
                pb_utils.Tensor("LEFT", np.array([-1.0 if left is None else left])),
            ]))
        return responses
'''
ECHO_CONFIG = f'''name: "echo"
backend: "python"
max_batch_size: 0
input [
  {{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "WAIT_MS" data_type: TYPE_FP32 dims: [ 1 ] optional: true }}
]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }}, {{ name: "LEFT" data_type: TYPE_FP64 dims: [ 1 ] }} ]
{ISOLATION}'''
STREAM_MODEL = '''
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: one response per element of IN, from a thread; a negative element aborts the process instead."""

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().tolist()
            threading.Thread(target=self._send, args=(request.get_response_sender(), values)).start()

    def _send(self, sender, values):
        for value in values:
            if value < 0:
                os.abort()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
STREAM_CONFIG = f'''name: "stream_crash"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
{ISOLATION}'''
INIT_ABORTS = "import os\n\n\nclass TritonPythonModel:\n    def initialize(self, args):\n        os.abort()\n"
RESTART_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = geserve_repository(tmp_path_factory.mktemp("isolation") / "models", ("add_sub", "crash"))
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    (root / "stream_crash" / "1").mkdir(parents=True)
    (root / "stream_crash" / "config.pbtxt").write_text(STREAM_CONFIG)
    (root / "stream_crash" / "1" / "model.py").write_text(STREAM_MODEL)
    (root / "init_aborts" / "1").mkdir(parents=True)
    (root / "init_aborts" / "config.pbtxt").write_text(ECHO_CONFIG.replace('"echo"', '"init_aborts"'))
    (root / "init_aborts" / "1" / "model.py").write_text(INIT_ABORTS)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One worker (a crash in the server's own process would end it), models loaded explicitly."""
    args = ["--model-control-mode=explicit",
            *(f"--load-model={m}" for m in ("add_sub", "crash", "echo", "stream_crash"))]
    with geserve([repo], tmp_path_factory.mktemp("isolation-logs") / "geserve.log", args) as running:
        yield running


# ---- helpers ------------------------------------------------------------------------------------------------------


def crash_input(command: int, client: Any = httpclient) -> Any:
    tensor = client.InferInput("CMD", [1], "INT32")
    tensor.set_data_from_numpy(np.array([command], np.int32))
    return tensor


def pid_of(result: Any) -> int:
    return int(result.as_numpy("PID")[0])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is gone but for its parent
    except FileNotFoundError:
        return False


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition` held."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what} within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - started


class Clients:
    """Four clients calling add_sub in a loop, each on its own connection, counting answers and failures."""

    def __init__(self, server: RunningServer) -> None:
        self._server = server
        self._stop = threading.Event()
        self.answers = [0] * 4
        self.failures: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(index,)) for index in range(4)]

    def __enter__(self) -> Clients:
        for thread in self._threads:
            thread.start()
        wait_until(lambda: all(self.answers), 30, "every client answered once")
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self, index: int) -> None:
        a = np.arange(4, dtype=np.float32) + index
        inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        with httpclient.InferenceServerClient(self._server.url, network_timeout=30) as client:
            while not self._stop.is_set():
                try:
                    result = client.infer("add_sub", inputs)
                    if not np.array_equal(result.as_numpy("OUTPUT0"), a + a):
                        self.failures.append(f"client {index}: wrong answer")
                    self.answers[index] += 1
                except Exception as exc:
                    self.failures.append(f"client {index}: {exc}")


def crash_with_one_behind(client: grpcclient.InferenceServerClient, command: int) -> dict[str, tuple[Any, Any]]:
    """(result, error) of a request sending `command` and of one sent right behind it on the same connection (so to
    the same worker, and queued for the same instance)."""
    answers: dict[str, tuple[Any, Any]] = {}
    done = threading.Event()

    def collect(name: str) -> Callable[[Any, Any], None]:
        def callback(result: Any, error: Any) -> None:
            answers[name] = (result, error)
            if len(answers) == 2:
                done.set()
        return callback

    client.async_infer("crash", [crash_input(command, grpcclient)], callback=collect("crashing"))
    client.async_infer("crash", [crash_input(0, grpcclient)], callback=collect("behind"))
    assert done.wait(60), "both requests answered"
    return answers


def assert_lost_with(answer: tuple[Any, Any], pid: int, signal_words: str) -> None:
    """The crashing request's answer: an error in Triton's words for a dead stub, then what happened."""
    result, error = answer
    assert result is None and isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.INTERNAL"
    assert error.message().startswith("Stub process 'crash_0_0' is not healthy. ")
    assert f"Its process (pid {pid}) {signal_words} while it held the request" in error.message()


def crash_and_recover(server: RunningServer, command: int, signal_words: str) -> None:
    """`command` crashes the crash model's process while four clients call add_sub: the crashing request alone fails,
    with an error; the one right behind it is served by the restarted process; the model is ready and serving again
    within RESTART_WITHIN_S; the clients saw no failure."""
    with Clients(server) as clients, grpcclient.InferenceServerClient(server.grpc_url) as client:
        before = pid_of(client.infer("crash", [crash_input(0, grpcclient)]))
        answers = crash_with_one_behind(client, command)
        crashed_at = time.monotonic()
        assert_lost_with(answers["crashing"], before, signal_words)
        result, error = answers["behind"]
        assert error is None, error  # not held by the process that crashed: it waited for the new one
        after = pid_of(result)
        assert after != before and not alive(before)
        wait_until(lambda: client.is_model_ready("crash"), RESTART_WITHIN_S, "the model ready again")
        assert time.monotonic() - crashed_at < RESTART_WITHIN_S
        assert pid_of(client.infer("crash", [crash_input(1, grpcclient)])) == after
        answered = list(clients.answers)
        wait_until(lambda: all(n > m for n, m in zip(clients.answers, answered, strict=True)), 30,
                   "every client answered again")
    assert clients.failures == []
    assert f"(pid {before}) {signal_words}" in server.log()


# ---- the crash case -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "words"), [(-1, "was killed by SIGABRT"), (-2, "was killed by SIGSEGV"),
                                                (-3, "exited with status 3")])
def test_a_crash_fails_only_the_requests_its_process_held_with_one_worker(
    server: RunningServer, command: int, words: str
) -> None:
    crash_and_recover(server, command, words)
    assert server.process.poll() is None


def test_a_crash_with_the_default_workers(repo: Path, tmp_path: Path) -> None:
    with geserve([repo], tmp_path / "geserve.log", ["--workers=0", "--model-control-mode=explicit",
                                                    "--load-model=add_sub", "--load-model=crash"]) as running:
        assert len(running.children()) == os.cpu_count()  # the default: one worker per core
        crash_and_recover(running, -1, "was killed by SIGABRT")


def test_restarts_that_fail_answer_at_once_then_back_off_until_one_serves(server: RunningServer, repo: Path) -> None:
    poison = repo / "crash" / "init_aborts"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException, match="was killed by SIGABRT"):
            client.infer("crash", [crash_input(-4, grpcclient)])  # and initialize() aborts from now on
        try:
            errors: list[str] = []

            def refused() -> bool:
                try:
                    client.infer("crash", [crash_input(0, grpcclient)])
                except InferenceServerException as exc:
                    errors.append(f"{exc.status()} {exc.message()}")
                    return True
                return False

            wait_until(refused, 30, "a refusal while restarts fail")
            assert errors[-1].startswith("StatusCode.UNAVAILABLE Python model instance 'crash_0_0' is restarting")
            assert "failed to initialize Python model instance 'crash_0_0': its process was killed by SIGABRT" in (
                errors[-1])
            assert not client.is_model_ready("crash")
        finally:
            poison.unlink()
        wait_until(lambda: client.is_model_ready("crash"), 30, "a restart that serves")
        assert pid_of(client.infer("crash", [crash_input(0, grpcclient)])) > 0
    assert "restart 1 failed" in server.log()


def model_processes(server: RunningServer) -> set[int]:
    """The server's isolated-model processes now."""
    return {pid for pid in server.children() if b"isolation.stub" in Path(f"/proc/{pid}/cmdline").read_bytes()}


def test_unloading_while_restarts_fail_ends_them_and_answers_the_waiting(server: RunningServer, repo: Path) -> None:
    poison = repo / "crash" / "init_aborts"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        others = model_processes(server) - {pid_of(client.infer("crash", [crash_input(0, grpcclient)]))}
        try:
            with pytest.raises(InferenceServerException, match="was killed by SIGABRT"):
                client.infer("crash", [crash_input(-4, grpcclient)])
            with pytest.raises(InferenceServerException, match="is restarting"):
                client.infer("crash", [crash_input(0, grpcclient)])
            started = time.monotonic()
            client.unload_model("crash")
            assert time.monotonic() - started < 10
            wait_until(lambda: model_processes(server) == others, 10, "no process of the unloaded model")
        finally:
            poison.unlink()
        client.load_model("crash")
        assert pid_of(client.infer("crash", [crash_input(0, grpcclient)])) not in others


def test_a_model_whose_process_dies_in_initialize_fails_to_load_with_the_reason(server: RunningServer) -> None:
    with httpclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("init_aborts")
        assert "failed to initialize Python model instance 'init_aborts_0': its process was killed by SIGABRT" in (
            caught.value.message())
        assert client.is_server_live() and client.is_model_ready("add_sub")


def test_a_stream_whose_process_dies_ends_with_the_crash_and_the_next_one_is_served(server: RunningServer) -> None:
    messages, final = stream_request(server.grpc_url, "stream_crash", [3, 4, -1], timeout=30)
    assert not final
    assert summarized(messages)[:2] == [({"OUT": [3]}, False), ({"OUT": [4]}, False)]
    assert summarized(messages)[2][0] == "error" and len(messages) == 3
    assert summarized(messages)[2][1].startswith("Stub process 'stream_crash_0' is not healthy. Its process (pid ")
    assert "was killed by SIGABRT" in summarized(messages)[2][1]
    messages, final = stream_request(server.grpc_url, "stream_crash", [5], timeout=30)  # waits for the restart
    assert final and summarized(messages) == [({"OUT": [5]}, False), ({}, True)]


def test_unload_ends_the_process_and_load_starts_a_new_one(server: RunningServer) -> None:
    with httpclient.InferenceServerClient(server.url) as client:
        before = pid_of(client.infer("crash", [crash_input(0)]))
        client.unload_model("crash")
        wait_until(lambda: not alive(before), 10, "the model's process gone")
        client.load_model("crash")
        after = pid_of(client.infer("crash", [crash_input(0)]))
        assert after != before and alive(after)


# ---- what crosses the process boundary ---------------------------------------------------------------------------


def echo_inputs(data: np.ndarray, wait_ms: float | None = None) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    if wait_ms is None:
        return [tensor]
    wait = grpcclient.InferInput("WAIT_MS", [1], "FP32")
    wait.set_data_from_numpy(np.array([wait_ms], np.float32))
    return [tensor, wait]


def test_large_tensors_cross_through_shared_memory_and_come_back_whole(server: RunningServer) -> None:
    rng = np.random.default_rng(7)
    with httpclient.InferenceServerClient(server.url, network_timeout=60) as client:
        for size in (3, 5_000, 4 << 20):  # in the frame, just past the shared-memory threshold (20 KB), 16 MiB
            data = rng.standard_normal(size).astype(np.float32)
            tensor = httpclient.InferInput("IN", [size], "FP32")
            tensor.set_data_from_numpy(data, binary_data=True)
            for _ in range(3):  # blocks the other side let go of are used again
                result = client.infer("echo", [tensor])
                np.testing.assert_array_equal(result.as_numpy("OUT"), data)


def test_the_deadline_crosses(server: RunningServer) -> None:
    data = np.ones(2, np.float32)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        left = float(client.infer("echo", echo_inputs(data), client_timeout=5).as_numpy("LEFT")[0])
        assert 4.0 < left <= 5.0
        assert float(client.infer("echo", echo_inputs(data)).as_numpy("LEFT")[0]) == -1.0


def test_a_cancelled_request_is_seen_cancelled_in_the_models_process(server: RunningServer, repo: Path) -> None:
    answers: list[tuple[Any, Any]] = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        call = client.async_infer("echo", echo_inputs(np.ones(2, np.float32), wait_ms=10_000), request_id="gone",
                                  callback=lambda result, error: answers.append((result, error)))
        time.sleep(0.5)
        call.cancel()
        seen = wait_until(lambda: (repo / "echo" / "cancelled-gone").exists(), 5, "the model saw it cancelled")
        assert seen < 2.0
        wait_until(lambda: bool(answers), 10, "the cancelled call answered")
        assert "CANCELLED" in str(answers[0][1].status())
        assert client.infer("echo", echo_inputs(np.ones(2, np.float32))).as_numpy("OUT").tolist() == [1.0, 1.0]
