"""benchmarks/leafwise.py times both paths of the compiled step from a grads pytree: each engine
it builds must run the path it is named for, and its third engine the one the engine picks."""
import pytest
import torch

import fzero.cpu.leafwise
from fzero.cpu import native
from helpers import odd_params
from common import leaf_by_leaf
from leafwise import PATHS, engine_on


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_engine_runs_the_path_it_is_named_for(dtype, monkeypatch):
    p0 = odd_params()  # 55 elements: below every size bound, so the engine's own choice is the step's graph
    for path, told in PATHS.items():
        assert leaf_by_leaf(engine_on(path, dtype, p0)[0]) == told
    assert not leaf_by_leaf(engine_on(None, dtype, p0)[0])
    monkeypatch.setattr(fzero.cpu.leafwise, "NATIVE_MIN_NUMEL", 55)
    assert leaf_by_leaf(engine_on(None, dtype, p0)[0]) == native.available(torch.device("cpu"))
