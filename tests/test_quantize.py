"""transforms.quantize: block-wise 8-bit moments, against float64 math."""
import optree
import pytest
import torch

from fzero.transforms import quantize as Q


def spread(n, seed=0, decades=8):
    """``n`` values whose magnitudes span ``decades`` decades (as Adam's moments do), random signs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-decades, 0, n)[torch.randperm(n, generator=g)]


def decoded_values(signed):
    """Every value a block of scale 1 can hold, from the map's formula in float64."""
    if signed:
        c = torch.arange(-127, 128, dtype=torch.float64)
        return (c / 127).square() * c.sign()
    return ((torch.arange(256, dtype=torch.float64) + 1) / 256) ** 4


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(1024,), (3, 100), (7,)])  # whole blocks, a partial last block, under one
def test_codes_are_the_nearest_level_in_the_map_domain_and_scales_the_block_maxima(signed, shape):
    x = spread(torch.Size(shape).numel(), seed=len(shape)).view(shape)
    x = x if signed else x.square()
    q = Q.quantize(x, signed=signed)
    assert q.codes.shape == x.shape and q.codes.dtype == (torch.int8 if signed else torch.uint8)
    blocks = torch.nn.functional.pad(x.reshape(-1).double(), (0, -x.numel() % Q.BLOCK)).view(-1, Q.BLOCK)
    assert torch.equal(q.scale, blocks.abs().amax(1).float())
    y = (blocks / blocks.abs().amax(1, keepdim=True)).reshape(-1)[: x.numel()]
    # the level nearest to y in the map's own domain (|y|^(1/2), y^(1/4)): float64 reference
    levels = decoded_values(signed)
    root = (lambda t: t.abs().sqrt() * t.sign()) if signed else (lambda t: t.sqrt().sqrt())
    want = (root(y)[:, None] - root(levels)[None, :]).abs().argmin(1)
    got = q.codes.reshape(-1).long() + (127 if signed else 0)
    assert (got - want).abs().max() <= 1  # ties between two levels may go either way
    assert (got == want).float().mean() > 0.999


@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_error_is_within_half_a_level(signed):
    x = spread(64 * Q.BLOCK)
    x = x if signed else x.square()
    d = Q.dequantize(Q.quantize(x, signed=signed)).double()
    x = x.double()
    scale = x.view(-1, Q.BLOCK).abs().amax(1, keepdim=True)
    y = (x.view(-1, Q.BLOCK) / scale).abs()
    # error bound from the map's slope: half a level of |y|^(1/p), times d|y|/d(root)
    p, levels = (2, 127) if signed else (4, 256)
    root = y ** (1 / p)
    bound = p * (root + 0.5 / levels) ** (p - 1) * (0.5 / levels) * scale
    if not signed:  # below the lowest level (2^-32 of the block's largest) values decode to it
        bound = torch.maximum(bound, scale * 2.0**-32)
    assert ((d - x).view(-1, Q.BLOCK).abs() <= bound * (1 + 1e-5) + 1e-30).all()
    top = y > 0.1  # the top decade of each block: 2% (signed), 1.3% (non-negative) relative
    rel = ((d - x).abs() / x.abs()).view(-1, Q.BLOCK)[top]
    assert rel.max() < (0.025 if signed else 0.015)


def test_second_moment_map_never_decodes_to_zero_in_a_nonzero_block():
    v = torch.zeros(2 * Q.BLOCK)
    v[3], v[Q.BLOCK + 5] = 1.0, 1e-30  # block 0: one big value and zeros; block 1: a tiny value and zeros
    d = Q.dequantize(Q.quantize(v, signed=False))
    assert (d > 0).all()  # a zero second moment under a non-zero first one would divide by eps
    assert d[4] == 2.0 ** -32 and d[3] == 1.0
    zero = Q.quantize(torch.zeros(Q.BLOCK), signed=False)  # an all-zero block stays exactly 0
    assert torch.equal(Q.dequantize(zero), torch.zeros(Q.BLOCK)) and zero.scale.item() == 0


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_of_dequantize_gives_back_the_same_codes_and_scales(signed):
    x = spread(10 * Q.BLOCK + 17, seed=3)
    q = Q.quantize(x if signed else x.square(), signed=signed)
    again = Q.quantize(Q.dequantize(q), signed=signed)
    assert torch.equal(again.codes, q.codes) and torch.equal(again.scale, q.scale)


def test_compiled_quantize_and_dequantize_equal_eager_bitwise():
    m = spread(8 * Q.BLOCK, seed=4)
    v = m.square()

    def both(m, v):  # one graph for both maps, round trip included
        qm, qv = Q.quantize(m, signed=True), Q.quantize(v, signed=False)
        return qm, qv, Q.dequantize(qm), Q.dequantize(qv)

    for got, want in zip(torch.compile(both, fullgraph=True)(m, v), both(m, v)):
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_zeros_and_numel_blocks():
    z = Q.zeros(torch.empty(3, 100), signed=False)
    assert z.codes.shape == (3, 100) and z.codes.dtype == torch.uint8 and z.scale.shape == (2,)
    assert torch.equal(Q.dequantize(z), torch.zeros(3, 100))
    assert [Q.numel_blocks(n) for n in (0, 1, 256, 257)] == [0, 1, 1, 2]


# The moment's own rules (``Quantized``'s methods): what the update and the checkpoint ask it.


def test_a_quantized_moment_is_a_pytree_of_its_codes_then_its_scale():
    q = Q.quantize(spread(3 * Q.BLOCK), signed=True)
    leaves = optree.tree_leaves(q)  # the tensors states, checkpoints and compiled steps see, in order
    assert len(leaves) == 2 and leaves[0] is q.codes and leaves[1] is q.scale
    assert Q.is_stored(q) and not Q.is_stored(q.codes) and not Q.is_stored((q.codes, q.scale))
    assert q.signed and not Q.quantize(spread(Q.BLOCK).square(), signed=False).signed
    assert q.numel() == 3 * Q.BLOCK and Q.zeros(torch.empty(3, 100), signed=True).numel() == 300


@pytest.mark.parametrize("lo, hi", [(0, 512), (256, 512), (512, 700), (0, 700), (512, 512)])
def test_shard_cuts_codes_and_their_blocks_scales_as_views(lo, hi):
    x = spread(700, seed=5)
    q = Q.quantize(x, signed=True)
    part = q.shard(lo, hi)
    assert torch.equal(part.codes, q.codes[lo:hi])
    assert torch.equal(part.scale, q.scale[lo // Q.BLOCK: -(-hi // Q.BLOCK)])
    # its value is the whole moment's value there, bitwise
    assert torch.equal(part.value(), q.value()[lo:hi])
    # views: storing into the slice writes the moment, and nothing outside the slice
    before = q.value().clone()
    part.store_(torch.full((hi - lo,), 0.5))
    after = q.value()
    assert torch.equal(after[lo:hi], torch.full((hi - lo,), 0.5))
    assert torch.equal(after[:lo], before[:lo]) and torch.equal(after[hi:], before[hi:])


@pytest.mark.parametrize("lo, hi", [(1, 256), (0, 300), (256, 100), (0, 701), (-256, 256)])
def test_shard_off_the_block_edges_raises_naming_the_block(lo, hi):
    q = Q.quantize(spread(700), signed=True)
    with pytest.raises(ValueError, match=rf"shard\({lo}, {hi}\) of 700 elements.*multiple of {Q.BLOCK}"):
        q.shard(lo, hi)


@pytest.mark.parametrize("signed", [True, False])
def test_value_stored_saved_and_loaded_are_the_codec_bitwise(signed):
    x = spread(4 * Q.BLOCK + 9, seed=6)
    x = x if signed else x.square()
    q = Q.quantize(x, signed=signed)
    assert torch.equal(q.value(), Q.dequantize(q)) and q.value().dtype == torch.float32
    y = x.flip(0) * 3
    for got, want in ((q.stored(y), Q.quantize(y, signed=signed)),
                      (q.stored(y, peak=y.clone()), Q.quantize(y, signed=signed, scale=Q.block_scale(y)))):
        assert got.codes.dtype == q.codes.dtype and torch.equal(got.codes, want.codes)
        assert torch.equal(got.scale, want.scale)
    # the checkpoint's leaf: the FP32 value, shaped like the moment; loaded back, the same bits
    saved = q.saved()
    assert saved.dtype == torch.float32 and saved.shape == x.shape and torch.equal(saved, Q.dequantize(q))
    back = Q.zeros(x, signed=signed).loaded(saved)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scale, q.scale)


def test_store_in_place_writes_the_moments_own_tensors():
    q = Q.zeros(torch.empty(2 * Q.BLOCK), signed=False)
    codes, scale = q.codes, q.scale
    v = spread(2 * Q.BLOCK, seed=7).square()
    assert q.store_(v) is q and q.codes is codes and q.scale is scale
    want = Q.quantize(v, signed=False)
    assert torch.equal(codes, want.codes) and torch.equal(scale, want.scale)
