"""Admission control's deadline budget (scheduling/admission.py) on its own, without a server: which request a model
that batches can still answer in time, from its measured service time and the requests it holds."""

from __future__ import annotations

import time

import pytest

from geserve.errors import OverloadedError
from geserve.scheduling.admission import Admission, AdmissionSettings
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest

BATCH = 8
PER_ROW_MS = 2.0  # a full batch of 8 runs 16 ms


def admission(instances: int = 1) -> Admission:
    settings = AdmissionSettings(min_limit=1_000, priority_levels=0, default_level=0, queue_budget_ns=0,
                                 parallelism=instances, batch=BATCH)
    gate = Admission("m", settings, ModelStatistics())
    gate.service_ns = gate.full_service_ns = PER_ROW_MS * 1e6 / instances  # the instances together
    return gate


def admitted(gate: Admission, held: int, deadline_ms: float) -> bool:
    request = InferenceRequest("m", "", [])
    request.deadline = time.monotonic() + deadline_ms / 1e3
    try:
        gate.admit(request, held)
    except OverloadedError:
        return False
    return True


@pytest.mark.parametrize("held", [8, 12, 15])
def test_a_request_that_joins_the_next_batch_waits_for_the_running_one_only(held: int) -> None:
    """8 running and up to 7 queued: it runs in the next batch, whatever is queued with it. The running batch is
    charged at half (its expected rest, 8 ms), then its own batch's 16 ms: 24 ms."""
    assert admitted(admission(), held, deadline_ms=25)
    assert not admitted(admission(), held, deadline_ms=23)


@pytest.mark.parametrize("held", [16, 23])
def test_a_request_behind_a_full_queued_batch_waits_for_it_too(held: int) -> None:
    """Half the running batch, the full batch queued ahead, its own: 8 + 16 + 16 ms."""
    assert not admitted(admission(), held, deadline_ms=39)
    assert admitted(admission(), held, deadline_ms=41)


def test_instances_run_their_batches_together() -> None:
    """Two instances take 16 requests a round, each round the time of one batch (16 ms)."""
    assert admitted(admission(instances=2), 31, deadline_ms=25)
    assert not admitted(admission(instances=2), 32, deadline_ms=39)
    assert admitted(admission(instances=2), 32, deadline_ms=41)


def test_an_idle_model_charges_one_requests_time() -> None:
    assert admitted(admission(), 0, deadline_ms=2.5)
    assert not admitted(admission(), 0, deadline_ms=1.5)
