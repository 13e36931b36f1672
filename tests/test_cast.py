"""fzero.cast: the saturating cast of the FP32 master to the param dtype, and the copy of a step's
results into the inputs' own buffers (``donate``)."""
import pytest
import torch

from fzero.cast import cast_params, write_into


def test_write_into_copies_every_new_tensor_into_the_old_one():
    old = {"a": torch.zeros(3), "b": (torch.zeros(2), torch.ones(1))}
    same = old["b"][1]
    new = {"a": torch.arange(3.0), "b": (torch.full((2,), 5.0), same)}
    out = write_into(old, new)
    assert out is old and torch.equal(old["a"], torch.arange(3.0)) and torch.equal(old["b"][0], torch.full((2,), 5.0))


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_cast_params_saturating_in_scratch_gives_the_same_bits(param_dtype):
    """With ``scratch`` the saturation runs in FP32 before the cast (the eager fused step's
    order): the same bits as casting first, on random values, values around the dtype's largest
    (below, at, between it and the next power, beyond), FP32's largest, ties, subnormals, zeros,
    inf and NaN; the master is left alone and only ``scratch`` is written."""
    top = torch.finfo(param_dtype).max
    ulp = top - torch.nextafter(torch.tensor(top, dtype=param_dtype), torch.tensor(0.0, dtype=param_dtype)).item()
    edges = [top, top + ulp / 4, top + ulp / 2, top + ulp * 0.75, 2 * top, 3.4e38, 1e-42, 0.0, 1.0 + 2**-11, 1.0 + 2**-8,
             float("inf"), float("nan")]
    edges = torch.tensor(edges + [-x for x in edges], dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    master = torch.cat([edges, torch.randn(10_000, generator=gen) * torch.logspace(-20, 20, 10_000)])
    kept = master.clone()
    want = cast_params(master, param_dtype)
    scratch, out = torch.full_like(master, 7.0), torch.empty(master.numel(), dtype=param_dtype)
    got = cast_params(master, param_dtype, out=out, scratch=scratch)
    assert got is out and torch.equal(master.view(torch.int32), kept.view(torch.int32))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # NaN's bits too
    nan = master.isnan()
    assert (got.float().abs() <= top)[~nan].all() and got[nan].isnan().all()  # saturated, NaN kept
