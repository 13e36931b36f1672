"""The test tiers, and the fixtures several test files share.

Every test belongs to one tier (pytest markers, declared in pyproject.toml):

* ``unit``: one process, no process group: every test not marked otherwise;
* ``multirank``: starts gloo ranks (``distributed.run_ranks``) or a Python process that joins
  a process group;
* ``e2e``: runs a script as its users do (``examples/``, ``benchmarks/``), under torchrun for
  ranks.

``slow`` marks the longest tests of any tier; ``device``, the device tier (tests/test_device.py:
the checks of the CUDA paths, run on the CPU here and on CUDA by ``make test-gpu``). The edit-test loop runs the fast tier,
``pytest -m "unit and not slow"`` (``make test-fast``); ``make test`` runs every tier.

A test that starts ranks or the main job without its tier's marker fails (``FZERO_TEST_TIER``,
read by ``distributed.run_ranks`` and ``helpers.run_script``), so the fast tier stays fast.
"""
from __future__ import annotations

import pytest
import torch

import fzero.checkpoint
from helpers import ckpt_engine, ckpt_trained, ready_engine

TIERS = ("unit", "multirank", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS[1:]):
            item.add_marker(pytest.mark.unit)
    # The end-to-end, then the multi-rank tests first (a stable sort: file order within a tier):
    # pytest-xdist's workers then end the run on short unit tests that fill each other's gaps,
    # not with one worker idle while the other finishes a minute-long compiled run.
    items.sort(key=lambda item: -TIERS.index(tier_of(item)))


def tier_of(item) -> str:
    """``e2e`` over ``multirank`` over ``unit``: the most a test may start."""
    return next(t for t in reversed(TIERS) if item.get_closest_marker(t))


@pytest.fixture(autouse=True)
def _tier(request, monkeypatch):
    monkeypatch.setenv("FZERO_TEST_TIER", tier_of(request.node))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with dynamo's caches empty. Each engine's ``step`` is the same code
    object, so the compiled steps of earlier tests in the same process would count toward
    dynamo's limit of 8 compilations per code object (past it, dynamo runs the function eagerly),
    and a test's compile count would depend on which tests ran before it. Inductor's cache of
    compiled kernels is on disk and stays warm."""
    torch._dynamo.reset()


@pytest.fixture
def ready():
    """``(engine, params, state, scaler_state, grads)``: an FP16 AdamW engine on one process,
    init-ed, with grads for a step (``helpers.ready_engine``)."""
    return ready_engine()


@pytest.fixture
def saved(tmp_path):
    """``(path, engine, params, state, scaler_state)``: a 1-rank checkpoint after 3 steps, with
    ``extra``, and the engine and state it came from."""
    path = str(tmp_path / "ckpt")
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 3)
    fzero.checkpoint.save(path, params, state, ss, engine, extra={"epoch": 1, "seen": [1, 2]})
    return path, engine, params, state, ss
