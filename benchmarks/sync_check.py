"""No host syncs in the step, on a GPU: ``torch.cuda.set_sync_debug_mode("error")`` around
eager fzero steps (FP16 dynamic scaling with an overflow, BF16, accumulation). Any
``.item()``/``bool(tensor)``/blocking copy raises. (On CPU the test suite traps
``Tensor.item``/``__bool__`` instead: tests/test_compile.py.)

    python benchmarks/sync_check.py
"""
import sys

import optree
import torch

import fzero
import transforms


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
