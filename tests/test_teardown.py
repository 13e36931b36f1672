"""fzero.shutdown on gloo ranks: the backend's threads end while the interpreter is alive."""
import os

import optree
import pytest
import torch
import torch.distributed as dist

import fzero
from fzero import transforms
from distributed import run_ranks
from helpers import odd_params


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to gloo (its workers and socket loop)."""
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)


def shutdown_after_training(rank, world_size, destroy_only):
    p0 = odd_params()
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float16, bucket_bytes=40)
    params, state, ss = engine.init(p0)
    loss = lambda p: sum((x.float() ** 2).sum() for x in optree.tree_leaves(p))
    grad_fn = engine.grad_and_value(loss)
    for step in range(2):  # both grad paths: torch.func and the overlapped one
        scaled = lambda p: fzero.scale_loss(loss(p), ss)
        grads = torch.func.grad(scaled)(params) if step == 0 else grad_fn(params, ss)[0]
        params, state, ss, info = engine.step(params, grads, state, ss)
    before = gloo_threads()
    if destroy_only:  # what a script without fzero.shutdown does: the engine is still alive
        dist.destroy_process_group()
    else:
        fzero.shutdown()
    return {"before": before, "after": gloo_threads(), "initialized": dist.is_initialized()}


@pytest.mark.multirank
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
@pytest.mark.parametrize("destroy_only", [False, True])
def test_shutdown_joins_the_gloo_threads_while_the_engine_is_alive(destroy_only):
    for r in run_ranks(shutdown_after_training, 2, destroy_only):
        assert "pt_gloo_runloop" in r["before"] and "gloo_tcp_loop" in r["before"], r
        assert r["after"] == [] and not r["initialized"], r  # the backend is gone, not leaked
