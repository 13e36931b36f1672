"""GPU checks of the step: no host syncs, and determinism.

1. ``torch.cuda.set_sync_debug_mode("error")`` around eager fzero steps (FP16 dynamic scaling
   with an overflow, BF16, accumulation): any ``.item()``/``bool(tensor)``/blocking copy raises.
   (On CPU the test suite traps ``Tensor.item``/``__bool__`` instead: tests/test_compile.py.)
2. With ``torch.use_deterministic_algorithms(True)``, two identical runs of steps give bitwise
   identical params and state. (On CPU: tests/test_engine_dist.py.)

    python benchmarks/sync_check.py
"""
import sys

import optree
import torch

import fzero
from fzero import transforms


def main():
    if not torch.cuda.is_available():
        print("sync_check: no CUDA device; the CPU equivalent is tests/test_compile.py")
        return 0
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    params32 = {"w": torch.randn(1000, 300, generator=g), "b": [torch.randn(300, generator=g), torch.randn(1, generator=g)]}
    params32 = optree.tree_map(lambda x: x.to(dev), params32)
    for dtype, scaling in ((torch.float16, fzero.DynamicLossScale(2.0**8)), (torch.bfloat16, None)):
        tx = transforms.chain(transforms.clip_by_global_norm(1.0), transforms.adamw(lr=transforms.warmup_cosine_decay(0, 1e-3, 2, 10)))
        engine = fzero.zero1(tx, param_dtype=dtype, loss_scale=scaling)
        params, state, ss = engine.init(params32)
        grads = [optree.tree_map(lambda p: torch.randn_like(p) * 16, params) for _ in range(3)]
        optree.tree_leaves(grads[1])[0].view(-1)[0] = float("inf")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for gr in grads:
                params, state, ss, info = engine.step(params, gr, state, ss)
            acc = engine.accumulate(engine.accumulate(None, grads[0]), grads[2])
            params, state, ss, info = engine.step(params, acc, state, ss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"sync_check {dtype}: 4 steps + accumulation, no host sync; found_inf per step ok, scale {float(ss.scale)}")

    torch.use_deterministic_algorithms(True)
    runs = []
    for _ in range(2):
        engine = fzero.zero1(transforms.adamw(lr=1e-3), param_dtype=torch.float16)
        params, state, ss = engine.init(params32)
        gen = torch.Generator(device=dev).manual_seed(0)
        for _ in range(5):
            grads = optree.tree_map(lambda p: torch.randn(p.shape, generator=gen, device=dev).half(), params)
            params, state, ss, _ = engine.step(params, grads, state, ss)
        runs.append(optree.tree_leaves((params, state)))
    same = all(torch.equal(a, b) for a, b in zip(*runs))
    print(f"determinism: two runs bitwise identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
