"""benchmarks/step.py's ideal mixed-precision step, the row fzero's compiled step is held against
beside fused AdamW: it must be AdamW (torch.optim.AdamW's, with the weight decay) and must write
the params, or the row would time less work than a step does."""
import pytest
import torch

import step as bench  # benchmarks/step.py: pyproject.toml puts benchmarks/ on pytest's sys.path
from helpers import torch_adamw


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_ideal_step_is_torch_adamw_and_casts_the_params(dtype, compiled):
    n, steps = 1000, 3
    gen = torch.Generator().manual_seed(0)
    master0 = torch.randn(n, generator=gen) * 2
    grads = [(torch.randn(n, generator=gen) * 1e-3).to(dtype) for _ in range(steps)]
    master, m, v = master0.clone(), torch.zeros(n), torch.zeros(n)
    params = torch.full((n,), float("nan"), dtype=dtype)
    hyper = bench.IDEAL_HYPER
    update = torch.compile(bench.ideal_update, fullgraph=True) if compiled else bench.ideal_update
    count = torch.zeros((), dtype=torch.int32)
    for g in grads:
        count = update(g, master, m, v, params, count, *[torch.tensor(x, dtype=torch.float64) for x in hyper.values()])
    want = torch_adamw({"p": master0}, [{"p": g.float()} for g in grads], lr=hyper["lr"],
                       betas=(hyper["b1"], hyper["b2"]), eps=hyper["eps"], weight_decay=hyper["wd"])["p"]
    assert count.item() == steps
    # The weight decay alone moves a param by lr * wd * |p| a step, 3e-6 |p| over the steps:
    # above this bound; the two orders of arithmetic differ by a few FP32 roundings (3e-7 |p|).
    torch.testing.assert_close(master, want, rtol=1e-6, atol=1e-7)
    assert not torch.equal(master, master0)
    assert torch.equal(params, master.to(dtype))
