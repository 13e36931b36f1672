"""The gradient forms (``fzero.grad_forms``) and path (``fzero.grads``): ``Segments`` read chunk by
chunk, and their norms; micro-batches summed as DDP sums them (``loss / ACCUM`` steps like one
batch and like torch)."""
import math

import optree
import pytest
import torch

import fzero
from fzero import transforms
from fzero.flat import flatten
from fzero.grad_forms import Segments
from fzero.models import mlp
from fzero.norm import sum_of_squares

from helpers import odd_params


def engine_path(bucket_bytes):
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16, alignment=8, bucket_bytes=bucket_bytes)
    engine.init(odd_params())
    return engine.grad_path


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bucket_bytes", [None, 40])  # buckets fill in reverse leaf order: offsets out of order
def test_segments_read_like_the_laid_out_grads(dtype, bucket_bytes):
    path = engine_path(bucket_bytes)
    grads = optree.tree_map(lambda p: (torch.randn(p.shape) * 100).to(torch.float16), odd_params())
    flat = flatten(grads, path.layout, dtype=torch.float32)  # zero padding between leaves
    S = path.layout.padded_numel
    for g in (path.segments(grads), path.segments(flatten(grads, path.layout))):
        assert list(g.starts) == sorted(g.starts) and g.numel == S
        for lo, hi in [(0, S), (0, 1), (3, 17), (S - 5, S), (10, 11)] + [(a, min(S, a + 13)) for a in range(0, S, 13)]:
            chunk = g.fp32(lo, hi, torch.device("cpu"))
            assert chunk.dtype == torch.float32 and torch.equal(chunk, flat[lo:hi])
    # a reduced shard, owned and FP32, is read in place; one that is not owned, copied
    shard = flat.clone()
    assert Segments.of(shard, True).fp32(4, 9, shard.device).data_ptr() == shard[4:].data_ptr()
    assert Segments.of(shard, False).fp32(4, 9, shard.device).data_ptr() != shard[4:].data_ptr()


def test_pieces_cut_at_block_multiples_whatever_the_parts():
    path = engine_path(None)
    grads = optree.tree_map(lambda p: torch.randn(p.shape).half(), odd_params())
    as_leaves, as_flat = path.segments(grads), path.segments(flatten(grads, path.layout))
    for block in (1, 4, 7, 64):
        a, b = as_leaves.pieces(block), as_flat.pieces(block)
        assert [x.numel() for x in a] == [x.numel() for x in b] and all(torch.equal(x, y) for x, y in zip(a, b))
        pos = [s for p, s in zip(as_leaves.parts, as_leaves.starts) for s in range(s, s + p.numel())]
        assert sum(x.numel() for x in a) == len(pos) == path.layout.numel
        assert max(x.numel() for x in a) <= block


@pytest.mark.parametrize("bounded", [True, False])
def test_sum_of_squares_of_the_largest_fp16_sums_is_finite_and_exact_enough(bounded):
    # FP16 grads summed over 2**20 ranks x micro-batches: FP32 accumulation must not overflow
    g = torch.full((3 * 2**18 + 64,), 65504.0 * 2**20)
    g[::7] *= -0.5
    got = sum_of_squares(Segments.of(g, False), bounded=bounded)
    want = g.double().square().sum()
    assert got.dtype == torch.float64 and math.isfinite(got)
    torch.testing.assert_close(got, want, rtol=1e-6 if bounded else 1e-14, atol=0)
    for bad in (float("inf"), float("nan")):
        g[5] = bad
        assert not math.isfinite(sum_of_squares(Segments.of(g, False), bounded=bounded))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_of_squares_of_bf16_and_fp32_grads_spans_their_whole_range(compiled, dtype):
    # BF16 and FP32 reach 3.4e38, whose square FP32 cannot hold, and go down to 1e-40: each
    # row is scaled by the inverse of its mean magnitude before its FP32 sum (compiled), and a
    # row of tiny values by 2^100, so neither end is lost; 3.38e38 is in the top octave, 1e-40
    # subnormal, 2^-100 in a row of zeros has a mean below 2^-100
    f = (lambda g: sum_of_squares(Segments.of(g, False), bounded=False, compiled=compiled))
    f = torch.compile(f) if compiled else f
    # every input 905 elements (3 full rows and a tail): one compiled graph
    for vals in ([3.38e38, -3.38e38, 1.0], [1e-40, -2e-40], [1e-30, 5.0, -3.0], [0.0], [1.5e38, 2.0],
                 [2.0**-100, 0.0, 0.0], [3.38e38, 1e-40, 0.0]):
        g = torch.tensor((vals * 900)[:900] + [7.0] * 5).to(dtype)
        got, want = f(g), g.double().square().sum()
        assert got.dtype == torch.float64 and math.isfinite(got)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for bad in (float("inf"), float("-inf"), float("nan")):  # as the float64 sum: inf or NaN
        g = torch.ones(905, dtype=dtype)
        g[300] = bad
        got = float(f(g))
        assert math.isnan(got) if math.isnan(bad) else got == math.inf, (bad, got)


ACCUM, ROWS, DIMS = 2, 5, (8, 32, 32, 4)  # micro-batches per step, rows per micro-batch, the MLP
OPTIMIZERS = {  # the fzero transform and the torch.optim one with the same hyperparameters
    "adamw": (lambda: transforms.adamw(lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "sgd": (lambda: transforms.sgd(lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
}


def torch_accumulated_step(p0, micro_batches, make_optimizer, max_norm):
    """torch's loop, the reference: ``(loss / ACCUM).backward()`` per micro-batch (``.grad`` sums
    them, as under DDP's ``no_sync`` on one rank), ``clip_grad_norm_``, one optimizer step.
    Returns ``(grads, norm before clipping, params after the step)``, pytrees like ``p0``."""
    leaves, spec = optree.tree_flatten(p0)
    ps = [torch.nn.Parameter(p.clone()) for p in leaves]
    optimizer = make_optimizer(ps)
    for b in micro_batches:
        (mlp.loss(spec.unflatten(ps), b) / ACCUM).backward()
    grads = spec.unflatten([p.grad.clone() for p in ps])
    norm = torch.nn.utils.clip_grad_norm_(ps, max_norm)
    optimizer.step()
    return grads, norm, spec.unflatten([p.detach() for p in ps])


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_micro_batches_of_loss_over_accum_step_like_one_batch_and_like_torch(optimizer, stage):
    """The step applies the sum of the micro-batches' grads (DDP's semantics), so torch's habit,
    each micro-batch's loss divided by ACCUM, gives the grads of the whole batch's mean loss: the
    same grads, norm (which clipping reads) and step as one batch, and as torch's loop -- through
    ``no_sync``/``sync`` and through ``engine.accumulate``. A mean over micro-batches would halve
    the grads and the norm, and the SGD step."""
    p0 = mlp.init(torch.Generator().manual_seed(0), DIMS)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ACCUM * ROWS, DIMS[0], generator=g), torch.randn(ACCUM * ROWS, DIMS[-1], generator=g)
    micro = [(x[m * ROWS : (m + 1) * ROWS], y[m * ROWS : (m + 1) * ROWS]) for m in range(ACCUM)]
    # clipping on, at 3/4 of the batch's grad norm: the threshold means what it means in torch
    max_norm = 0.75 * float(transforms.global_norm(torch.func.grad(mlp.loss)(p0, (x, y))))
    make_tx, make_optimizer = OPTIMIZERS[optimizer]
    want_grads, want_norm, want_params = torch_accumulated_step(p0, micro, make_optimizer, max_norm)
    part_loss = lambda p, b: mlp.loss(p, b) / ACCUM  # noqa: E731

    for route in ("one batch", "no_sync", "accumulate"):
        tx = transforms.chain(transforms.clip_by_global_norm(max_norm), make_tx())
        engine = fzero.zero1(tx, param_dtype=torch.float32, loss_scale=None, stage=stage)
        params, state, ss = engine.init(p0)
        if route == "one batch":
            grads, _ = engine.grad_and_value(mlp.loss)(params, ss, (x, y))
        elif route == "no_sync":
            gv = engine.grad_and_value(part_loss)
            acc, _ = gv.no_sync(None, params, ss, micro[0])
            grads, _ = gv.sync(acc, params, ss, micro[1])
        else:  # torch.func's grads, summed
            grads = None
            for b in micro:
                grads = engine.accumulate(grads, torch.func.grad(part_loss)(params, b))
        assert grads.count.item() == (1 if route == "one batch" else ACCUM), route  # reported, not divided by
        # one rank: the reduced shard is the whole flat grads
        torch.testing.assert_close(grads.grads, flatten(want_grads, engine.layout), rtol=1e-5, atol=1e-7)
        params, state, ss, info = engine.step(params, grads, state, ss)
        torch.testing.assert_close(info["grad_norm"], want_norm, rtol=1e-5, atol=0)
        for got, want in zip(optree.tree_leaves(params), optree.tree_leaves(want_params)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
