"""The gradient forms of ``fzero.grads``: ``Segments`` read chunk by chunk, and their norms."""
import math

import optree
import pytest
import torch

import fzero
from fzero import transforms
from fzero.flat import flatten
from fzero.update import sum_of_squares

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
    assert fzero.grads.Segments.of(shard, True).fp32(4, 9, shard.device).data_ptr() == shard[4:].data_ptr()
    assert fzero.grads.Segments.of(shard, False).fp32(4, 9, shard.device).data_ptr() != shard[4:].data_ptr()


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
    got = sum_of_squares(fzero.grads.Segments.of(g, False), bounded=bounded)
    want = g.double().square().sum()
    assert got.dtype == torch.float64 and math.isfinite(got)
    torch.testing.assert_close(got, want, rtol=1e-6 if bounded else 1e-14, atol=0)
    for bad in (float("inf"), float("nan")):
        g[5] = bad
        assert not math.isfinite(sum_of_squares(fzero.grads.Segments.of(g, False), bounded=bounded))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_of_squares_of_bf16_and_fp32_grads_spans_their_whole_range(compiled, dtype):
    # BF16 and FP32 reach 3.4e38, whose square FP32 cannot hold, and go down to 1e-40: each
    # row is scaled by the inverse of its mean magnitude before its FP32 sum (compiled), and a
    # row of tiny values by 2^100, so neither end is lost; 3.38e38 is in the top octave, 1e-40
    # subnormal, 2^-100 in a row of zeros has a mean below 2^-100
    f = (lambda g: sum_of_squares(fzero.grads.Segments.of(g, False), bounded=False, compiled=compiled))
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
