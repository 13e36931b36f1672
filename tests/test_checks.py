"""fzero.checks: the inputs ``init`` refuses, each with a message naming the leaf."""

import pytest
import torch

import fzero
import transforms


def engine():
    return fzero.zero1(transforms.adamw(lr=1e-3), param_dtype=torch.float32)


def test_the_same_tensor_twice_in_the_params_is_refused_naming_both_paths():
    """Tied weights would get two masters and silently train apart."""
    w = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"params leaves 'emb' and 'head' share memory \(tied weights\?\)"):
        engine().init({"emb": w, "head": w})
    with pytest.raises(ValueError, match="share memory"):  # an overlapping view as well
        engine().init({"a": w, "b": w[1:]})
    params, _, _ = engine().init({"a": w, "b": w.clone()})  # equal values, separate memory: fine
    # params that are already views of one flat buffer (what init returns) do not overlap
    engine().init(params)


def test_meta_device_params_are_refused_naming_the_leaf():
    """Before: ``Tensor.item() cannot be called on meta tensors``."""
    with pytest.raises(ValueError, match=r"params leaf 'w' is on the meta device.*to_empty"):
        engine().init({"w": torch.empty(3, 4, device="meta"), "b": torch.zeros(3)})


@pytest.mark.parametrize("value", [True, torch.tensor(False)])
def test_a_bool_hyperparameter_is_refused(value):
    """``set_hyperparams(lr=True)`` was taken as 1.0."""
    state = engine().init({"w": torch.ones(3)})[1]
    with pytest.raises(ValueError, match="set_hyperparams: lr must be .*not a bool"):
        transforms.set_hyperparams(state.tx_state, lr=value)
    with pytest.raises(ValueError, match="adamw: lr must be .*not a bool"):
        transforms.adamw(lr=value)
