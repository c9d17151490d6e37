"""The event loop batch-scheduled while admission control refuses (devices/loop_batching.py): the thread's real
scheduling policy and time slice as the kernel reports them, switched once refusals come fast and back after a
refusal-free window, and the deadline a caller's timeout gives kept the read delay earlier meanwhile. On a real
asyncio loop; Linux only."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from geserve.devices.loop_batching import ENGAGE_REFUSALS, LOOP_BATCHING, LoopBatching, kernel_tick_s
from geserve.devices.thread_scheduling import SHORTEST_SLICE_S, set_policy, slice_s
from geserve.devices.thread_scheduling import policy as policy_of
from geserve.service.deadlines import DELIVERY_ALLOWANCE_S, caller_deadline

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH is Linux's")


def policy() -> int:
    return policy_of(threading.get_native_id())


def slices_reported() -> bool:
    """Whether the kernel reports a thread's slice (Linux 6.12 and later, x86_64 and aarch64 here)."""
    return slice_s(threading.get_native_id()) > 0


@pytest.fixture(autouse=True)
def normal_afterwards() -> Iterator[None]:
    yield
    # the kernel's default slice too (sched_setscheduler keeps a slice asked for): later tests' servers inherit it
    set_policy(threading.get_native_id(), os.SCHED_OTHER, 0.0)


def test_the_tick_is_the_kernels() -> None:
    assert kernel_tick_s() in (1 / 100, 1 / 250, 1 / 300, 1 / 1000)


def test_a_refusal_batch_schedules_the_loop_until_a_quiet_window_passes() -> None:
    switch = LoopBatching(idle_window_s=0.1, engage_after=1)
    seen: dict[str, object] = {}

    async def run() -> None:
        assert policy() == os.SCHED_OTHER and switch.read_delay_s(time.monotonic()) == 0.0
        switch.refused(time.monotonic())
        seen["during"] = (policy(), switch.batched, switch.read_delay_s(time.monotonic()))
        await asyncio.sleep(0.06)
        last = time.monotonic()
        switch.refused(last)  # a later refusal keeps it batched past the first window
        await asyncio.sleep(0.08)
        seen["renewed"] = policy()
        await asyncio.sleep(0.1)
        # it went back a window after the last refusal at the earliest: a request read just after may still have
        # waited a tick, one read a second later not
        just_after = last + 0.1 + switch.bound_s / 2
        seen["after"] = (policy(), switch.batched, switch.read_delay_s(just_after), switch.read_delay_s(last + 1.0))

    asyncio.run(run())
    assert seen["during"] == (os.SCHED_BATCH, True, switch.bound_s)
    assert seen["renewed"] == os.SCHED_BATCH
    assert seen["after"] == (os.SCHED_OTHER, False, switch.bound_s, 0.0)
    assert switch.bound_s > kernel_tick_s()


def test_only_refusals_that_come_fast_batch_schedule_the_loop() -> None:
    """Refusals now and then (19 spread over a second, each run of them short of 20 within 100 ms) leave the loop
    alone; 20 within 100 ms switch it."""
    switch = LoopBatching(idle_window_s=0.05)
    seen: list[bool] = []

    async def run() -> None:
        start = time.monotonic()
        for index in range(19):
            switch.refused(start + index * 0.06)
        seen.append(switch.batched)
        burst = start + 2.0
        for index in range(ENGAGE_REFUSALS):
            switch.refused(burst + index * 0.004)
        seen.append(switch.batched)
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert seen == [False, True]
    assert ENGAGE_REFUSALS == 20


def test_switched_off_or_off_any_loop_nothing_changes() -> None:
    switch = LoopBatching(idle_window_s=0.05, engage_after=1)
    switch.refused(time.monotonic())  # no running loop: nothing could switch it back
    assert policy() == os.SCHED_OTHER and not switch.batched
    switch.configure(False, short_slice=False)

    async def run() -> None:
        switch.refused(time.monotonic())

    asyncio.run(run())
    assert policy() == os.SCHED_OTHER and not switch.batched


def test_a_callers_deadline_is_kept_the_read_delay_earlier_while_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LOOP_BATCHING, "_idle_window_s", 0.05)
    monkeypatch.setattr(LOOP_BATCHING, "_engage_after", 1)
    monkeypatch.setattr(LOOP_BATCHING, "_settled_at", 0.0)  # restored after: later tests see no read delay
    deadlines: list[float] = []

    async def run() -> None:
        now = time.monotonic()
        deadlines.append(caller_deadline(now, 0.05) - now)
        LOOP_BATCHING.refused(now)
        deadlines.append(caller_deadline(now, 0.05) - now)
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert deadlines[0] == pytest.approx(0.05 - DELIVERY_ALLOWANCE_S)
    assert deadlines[1] == pytest.approx(0.05 - DELIVERY_ALLOWANCE_S - LOOP_BATCHING.bound_s)
    assert not LOOP_BATCHING.batched


def test_the_loop_has_its_short_slice_but_while_batch_scheduled_and_its_threads_do_not_inherit_it() -> None:
    if not slices_reported():
        pytest.skip("the kernel does not report time slices (before Linux 6.12)")
    switch = LoopBatching(idle_window_s=0.05, engage_after=1)
    switch.configure(True, short_slice=True)
    default = slice_s(threading.get_native_id())
    seen: dict[str, object] = {}

    async def run() -> None:
        switch.claim()
        seen["claimed"] = (policy(), slice_s(threading.get_native_id()))
        started = threading.Thread(target=lambda: seen.update(started=slice_s(threading.get_native_id())))
        started.start()
        started.join()
        switch.refused(time.monotonic())
        seen["batched"] = (policy(), slice_s(threading.get_native_id()))
        await asyncio.sleep(0.15)
        seen["back"] = (policy(), slice_s(threading.get_native_id()))

    asyncio.run(run())
    assert default > SHORTEST_SLICE_S
    assert seen == {"claimed": (os.SCHED_OTHER, SHORTEST_SLICE_S), "started": default,
                    "batched": (os.SCHED_BATCH, default), "back": (os.SCHED_OTHER, SHORTEST_SLICE_S)}


def test_without_the_short_slice_claiming_the_loop_changes_nothing() -> None:
    switch = LoopBatching()
    switch.configure(True, short_slice=False)
    before = slice_s(threading.get_native_id())
    switch.claim()
    assert (policy(), slice_s(threading.get_native_id())) == (os.SCHED_OTHER, before)


def test_a_thread_that_does_not_exist_is_not_scheduled_and_nothing_raises() -> None:
    # Past the kernel's largest id (a joined thread's id may live on a moment, or be taken again).
    missing = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    assert set_policy(missing, os.SCHED_BATCH, SHORTEST_SLICE_S) is False
    assert slice_s(missing) == 0.0
