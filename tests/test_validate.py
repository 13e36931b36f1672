"""transforms.validate: the one check of the numbers that transforms, schedules and loss-scale
policies take at construction."""
import math
import re

import numpy as np
import pytest
import torch

from fzero import transforms
from fzero.scaler import DynamicLossScale, StaticLossScale
from fzero.transforms.hyperparams import HYPERPARAM_RULES
from fzero.transforms.validate import FINITE, check_count, check_number

INF, NAN = float("inf"), float("nan")
FP32_MAX = torch.finfo(torch.float32).max
POSITIVE_FP32 = (lambda v: 0 < v < math.inf, "a finite number > 0 in FP32")


@pytest.mark.parametrize(
    "value, want",
    [(3, 3.0), (0.25, 0.25), (np.float32(0.5), 0.5), (torch.tensor(0.125), 0.125),
     (torch.tensor([2.0], dtype=torch.float64), 2.0), (torch.tensor(7), 7.0)],
)
def test_a_number_or_a_one_element_tensor_is_read_as_a_float(value, want):
    got = check_number("f", "x", value)
    assert type(got) is float and got == want


@pytest.mark.parametrize("value", [True, False, torch.tensor(True), torch.tensor([False])])
def test_a_bool_is_not_a_number(value):
    message = f"f: x must be a real number or a 1-element tensor, not a bool, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        check_number("f", "x", value)


@pytest.mark.parametrize("value", ["0.1", None, [0.1], torch.ones(2), torch.ones(0), 1j])
def test_what_is_not_a_real_number_is_refused_naming_it(value):
    message = f"f: x must be a real number or a 1-element tensor, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        check_number("f", "x", value)


@pytest.mark.parametrize(
    "value, rule, shown",
    [
        (INF, FINITE, "inf"),
        (-INF, FINITE, "-inf"),
        (NAN, FINITE, "nan"),
        (-1, HYPERPARAM_RULES["lr"], "-1"),  # a Python number as given
        (torch.tensor(-0.5), HYPERPARAM_RULES["lr"], "-0.5"),  # a tensor as the float read from it
        (NAN, HYPERPARAM_RULES["b1"], "nan"),
        (1.0, HYPERPARAM_RULES["b2"], "1.0"),
        (0.0, HYPERPARAM_RULES["max_norm"], "0.0"),
    ],
)
def test_a_value_outside_the_rule_is_refused_saying_what_it_must_be(value, rule, shown):
    with pytest.raises(ValueError, match=re.escape(f"f: x must be {rule[1]}, got {shown}") + "$"):
        check_number("f", "x", value, rule)


@pytest.mark.parametrize("value", [1e39, 1e-50, 2e-46])
def test_dtype_judges_the_value_rounded_to_it(value):
    # finite and > 0 as a Python float, but inf or 0 in FP32
    assert check_number("f", "x", value, POSITIVE_FP32) == value
    with pytest.raises(ValueError, match=re.escape(f"f: x must be a finite number > 0 in FP32, got {value!r}")):
        check_number("f", "x", value, POSITIVE_FP32, dtype=torch.float32)


def test_dtype_keeps_the_value_as_given():
    assert check_number("f", "x", FP32_MAX, POSITIVE_FP32, dtype=torch.float32) == FP32_MAX
    assert check_number("f", "x", 0.1, POSITIVE_FP32, dtype=torch.float32) == 0.1  # not 0.1 rounded to FP32


@pytest.mark.parametrize("value, minimum", [(0, 0), (5, 1), (torch.tensor(3), 1), (np.int64(2), 2), (torch.tensor([4]), 0)])
def test_an_integer_count_is_read_as_an_int(value, minimum):
    got = check_count("f", "n", value, minimum=minimum)
    assert type(got) is int and got == int(value)


@pytest.mark.parametrize(
    "value, minimum",
    [(-1, 0), (0, 1), (True, 0), (False, 0), (torch.tensor(True), 0), (2.0, 0), (2.5, 0), ("3", 0),
     (torch.tensor(2.0), 0), (None, 0)],
)
def test_a_count_must_be_an_integer_at_least_the_minimum(value, minimum):
    with pytest.raises(ValueError, match=re.escape(f"f: n must be an integer >= {minimum}, got {value!r}") + "$"):
        check_count("f", "n", value, minimum=minimum)


# Every caller checks with the same rule: a bool is refused everywhere (the loss-scale policies and
# the schedules took True as 1.0), naming the caller and the argument.
@pytest.mark.parametrize(
    "make, where, name",
    [
        (lambda b: DynamicLossScale(init_scale=b), "DynamicLossScale", "init_scale"),
        (lambda b: DynamicLossScale(min_scale=b, init_scale=1.0), "DynamicLossScale", "min_scale"),
        (lambda b: DynamicLossScale(growth_factor=b), "DynamicLossScale", "growth_factor"),
        (lambda b: DynamicLossScale(backoff_factor=b), "DynamicLossScale", "backoff_factor"),
        (lambda b: DynamicLossScale(growth_interval=b), "DynamicLossScale", "growth_interval"),
        (lambda b: StaticLossScale(b), "StaticLossScale", "scale"),
        (lambda b: transforms.constant(b), "constant", "value"),
        (lambda b: transforms.linear(b, 0.0, 3), "linear", "init_value"),
        (lambda b: transforms.linear(0.0, 1.0, b), "linear", "transition_steps"),
        (lambda b: transforms.cosine_decay(1.0, b), "cosine_decay", "decay_steps"),
        (lambda b: transforms.warmup_cosine_decay(0.0, b, 1, 10), "warmup_cosine_decay", "peak_value"),
        (lambda b: transforms.adamw(lr=b), "adamw", "lr"),
        (lambda b: transforms.adamw(betas=(0.9, b)), "adamw", "betas[1]"),
        (lambda b: transforms.clip_by_global_norm(b), "clip_by_global_norm", "max_norm"),
    ],
)
@pytest.mark.parametrize("flag", [True, torch.tensor(True)])
def test_every_caller_refuses_a_bool(make, where, name, flag):
    with pytest.raises(ValueError, match=re.escape(f"{where}: {name} must be ") + ".*" + re.escape(f", got {flag!r}")):
        make(flag)


@pytest.mark.parametrize(
    "make, where, name",
    [
        (lambda: StaticLossScale("8"), "StaticLossScale", "scale"),
        (lambda: DynamicLossScale(backoff_factor="0.5"), "DynamicLossScale", "backoff_factor"),
        (lambda: transforms.constant("0.5"), "constant", "value"),
        (lambda: transforms.adamw(lr="1e-3"), "adamw", "lr"),
    ],
)
def test_every_caller_refuses_a_string(make, where, name):
    """``float("0.5")`` parses text: the policies kept the string and failed inside the step."""
    with pytest.raises(ValueError, match=re.escape(f"{where}: {name} must be a real number or a 1-element tensor, got '")):
        make()


def test_every_caller_reads_a_one_element_tensor():
    assert StaticLossScale(torch.tensor(8.0)).init().scale.item() == 8.0
    assert DynamicLossScale(init_scale=torch.tensor(4.0), growth_interval=torch.tensor(3)).init().scale.item() == 4.0
    assert float(transforms.constant(torch.tensor(0.5))(0)) == 0.5
    assert float(transforms.linear(torch.tensor(1.0), 0.0, torch.tensor(2))(1)) == 0.5
    state = transforms.sgd(lr=torch.tensor(0.1), momentum=torch.tensor(0.5)).init(torch.zeros(2))
    assert transforms.get_hyperparams(state)["momentum"].item() == 0.5
