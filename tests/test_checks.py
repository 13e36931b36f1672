"""fzero.checks: the inputs ``init`` and ``step`` refuse, each with a message naming the leaf."""

import pytest
import torch

import fzero
from fzero import transforms
from helpers import odd_params


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


# ---------------------------------------------------------------- step inputs
def test_grads_wrong_dtype_names_leaf(ready):
    engine, params, state, ss, grads = ready
    grads["w"] = grads["w"].float()
    with pytest.raises(TypeError, match="grads leaf 'w' has dtype torch.float32, expected torch.float16"):
        engine.step(params, grads, state, ss)


def test_grads_requiring_grad_names_leaf(ready):
    engine, params, state, ss, grads = ready
    grads["one"] = grads["one"].requires_grad_()
    with pytest.raises(ValueError, match="grads leaf 'one' requires grad"):
        engine.step(params, grads, state, ss)


def test_params_not_from_the_engine_are_rejected(ready):
    engine, params, state, ss, grads = ready
    params["w"] = params["w"].float()
    with pytest.raises(TypeError, match="params leaf 'w' has dtype torch.float32"):
        engine.step(params, grads, state, ss)


def test_non_contiguous_grads_are_accepted(ready):
    engine, params, state, ss, grads = ready
    grads["w"] = grads["w"].t().contiguous().t()  # same values, transposed strides
    assert not grads["w"].is_contiguous()
    _, new_state, _, info = engine.step(params, grads, state, ss)
    _, ref_state, _, _ = engine.step(params, {**grads, "w": grads["w"].contiguous()}, state, ss)
    assert torch.equal(new_state.master, ref_state.master)


def test_grads_structure_mismatch_names_leaf(ready):
    engine, params, state, ss, grads = ready
    grads["extra"] = torch.zeros(2)
    with pytest.raises(ValueError, match="'extra'"):
        engine.step(params, grads, state, ss)


def test_grads_wrong_shape_names_leaf(ready):
    engine, params, state, ss, grads = ready
    grads["blocks"][0]["g"] = torch.zeros(12)
    with pytest.raises(ValueError, match=r"'blocks/0/g' has shape \(12,\), expected \(13,\)"):
        engine.step(params, grads, state, ss)


def test_grads_not_floating_names_leaf(ready):
    engine, params, state, ss, grads = ready
    grads["one"] = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="'one' has dtype torch.int64"):
        engine.step(params, grads, state, ss)


def test_bad_param_dtype_and_bad_params():
    with pytest.raises(TypeError, match="param_dtype"):
        fzero.zero1(transforms.adamw(), param_dtype=torch.float64)
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)
    with pytest.raises(TypeError, match="'b'.*torch.int32"):
        engine.init({"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(ValueError, match="no tensor leaves"):
        engine.init({})
    with pytest.raises(RuntimeError, match="before engine.init"):
        engine.step({}, {}, None, None)


def test_another_engines_state_or_a_non_state_is_rejected_by_name(ready):
    engine, params, state, ss, grads = ready
    other = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)  # another model: another layout
    _, other_state, other_ss = other.init({"x": torch.zeros(300)})
    with pytest.raises(ValueError, match=r"state.master is shape \(320,\).*another engine"):
        engine.step(params, grads, other_state, ss)
    sgd = fzero.zero1(transforms.sgd(lr=0.1, momentum=0.9), param_dtype=torch.float16)  # same model, another transform
    _, sgd_state, _ = sgd.init(odd_params())
    with pytest.raises(ValueError, match="state.tx_state is .*TraceState.*this engine's transform built .*ScaleByAdamState"):
        engine.step(params, grads, sgd_state, ss)
    with pytest.raises(TypeError, match="state must be the ZeroState.*got dict"):
        engine.step(params, grads, {"master": state.master}, ss)
    with pytest.raises(TypeError, match="scaler_state must be the LossScaleState.*got ZeroState"):
        engine.step(params, grads, state, state)


def test_grads_on_another_device_names_leaf(ready):
    engine, params, state, ss, grads = ready
    grads["blocks"][1]["g"] = grads["blocks"][1]["g"].to("meta")
    with pytest.raises(ValueError, match="grads leaf 'blocks/1/g' is on meta, the params are on cpu"):
        engine.step(params, grads, state, ss)


@pytest.mark.parametrize("options,message", [
    (dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float16),
     "reduce_dtype must be torch.float32 or the param_dtype torch.bfloat16, got torch.float16"),
    (dict(param_dtype=torch.bfloat16, wire_dtype=torch.float16),
     "wire_dtype must be None, the param_dtype torch.bfloat16 or the reduce_dtype torch.float32, got torch.float16"),
    (dict(param_dtype=torch.float16, reduce_dtype=torch.float16, wire_dtype=torch.float32),
     "wire_dtype must be None, the param_dtype torch.float16 or the reduce_dtype torch.float16, got torch.float32"),
])
def test_reduce_and_wire_dtypes_other_than_the_params_or_the_sums_are_refused(options, message):
    with pytest.raises(TypeError, match=f"^{message}$"):
        fzero.zero1(transforms.adamw(lr=1e-3), **options)
    fzero.zero1(transforms.adamw(lr=1e-3), **{**options, "wire_dtype": None, "reduce_dtype": torch.float32})
