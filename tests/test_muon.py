"""transforms.muon against torch.optim.Muon, and the Newton–Schulz iteration against the SVD."""
import importlib
import math

import optree
import pytest
import torch

import fzero
from fzero import transforms
from helpers import grads_like, run_tx, torch_optimizer, tree_assert_close

muon_module = importlib.import_module("fzero.transforms.muon")  # ``transforms.muon`` is the function
needs_torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")


def matrices(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"wide": torch.randn(8, 24, generator=g), "tall": torch.randn(40, 12, generator=g) * 0.1,
            "square": [torch.randn(16, 16, generator=g)]}


@needs_torch_muon
@pytest.mark.parametrize("kw", [
    dict(lr=0.02),
    dict(lr=0.01, momentum=0.9, nesterov=False, weight_decay=0.1, adjust_lr_fn="original"),
    dict(lr=3e-3, weight_decay=0.05, adjust_lr_fn="match_rms_adamw", ns_steps=3),
])
def test_muon_matches_torch_over_50_steps(kw):
    """The momentum and the Newton–Schulz iteration are torch's ops in torch's order and dtypes;
    only the last line differs: torch multiplies W by 1 - lr*wd and then adds -lr*r*O, fzero adds
    -lr*(r*O + wd*W) (optax's composition). That is an FP32 rounding (6e-8 relative) per step,
    which the grads, fixed in advance, do not feed back: after 50 steps at most 50 roundings, 3e-6."""
    params = matrices()
    seq = [grads_like(params, i) for i in range(50)]
    got, _ = run_tx(transforms.muon(**{"weight_decay": 0.0, **kw}), params, seq)
    want = torch_optimizer(torch.optim.Muon, params, seq, **{"weight_decay": 0.0, **kw})
    tree_assert_close(got, want, rtol=4e-6, atol=1e-6)
    # and it moved: 50 steps of lr * O are far beyond the tolerance
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(params)))


@needs_torch_muon
def test_newton_schulz_is_torchs_bit_for_bit():
    from torch.optim._muon import _zeropower_via_newtonschulz
    for shape in ((8, 24), (40, 12), (16, 16)):
        m = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
        want = _zeropower_via_newtonschulz(m, muon_module.NS_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(transforms.newton_schulz(m, steps=5), want)


@pytest.mark.parametrize("shape", [(8, 24), (40, 12), (32, 32)])
def test_newton_schulz_orthogonalizes(shape):
    """O ~ U V^T of m = U S V^T: every singular value of O within [0.5, 1.5] (Keller Jordan's
    quintic trades exactness for speed), O's singular vectors m's (cosine with U V^T > 0.9).
    m's singular values span 1e-2..1: 5 steps lift ratios to the norm down to about 1e-3 (the
    slope at zero is 3.4445 per step); a smaller one stays small."""
    g = torch.Generator().manual_seed(1)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=g, dtype=torch.float64))
    m = u @ torch.diag(torch.logspace(-2, 0, k, dtype=torch.float64)) @ v.T  # singular values over 2 decades
    o = transforms.newton_schulz(m).double()
    assert o.shape == m.shape and transforms.newton_schulz(m).dtype == torch.bfloat16
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.5 and s.max() < 1.5, s
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    polar = u @ vh
    assert (o * polar).sum() / (o.norm() * polar.norm()) > 0.9


def test_muon_lr_schedule_and_hyperparams():
    params = matrices()
    seq = [grads_like(params, i) for i in range(3)]
    sched = transforms.linear_warmup(0.0, 0.02, 2)
    got, state = run_tx(transforms.muon(lr=sched), params, seq)
    ref, _ = run_tx(transforms.muon(lr=0.0), params, seq[:1])  # the first step at lr 0 moves nothing
    tree_assert_close(ref, params, rtol=0, atol=0)
    hp = transforms.get_hyperparams(state, transforms.muon(lr=sched))
    assert float(hp["lr"]) == 0.02 and float(hp["momentum"]) == 0.95 and float(hp["weight_decay"]) == 0.0


@pytest.mark.parametrize("emulate", [True, False])
def test_muon_compiled_matches_eager(emulate):
    """With inductor rounding every BF16 intermediate as eager does (``emulate_precision_casts``)
    the compiled update is eager's bit for bit. By default inductor keeps the BF16 intermediates
    of Newton–Schulz (the norm, the scaled matrix, the polynomial's terms) in FP32: a slightly
    different, more precise iteration, whose steps agree with eager's to 5% of their size."""
    if emulate and not hasattr(torch._inductor.config, "emulate_precision_casts"):
        pytest.skip("inductor's emulate_precision_casts is torch >= 2.5")
    torch._dynamo.reset()  # the compile reads the inductor config
    params = {"tall": matrices()["tall"]}  # one matrix: compiling is most of this test's time
    seq = [grads_like(params, i) for i in range(3)]
    tx = transforms.muon(lr=0.02, weight_decay=0.1)
    with torch._inductor.config.patch(emulate_precision_casts=emulate):
        update = torch.compile(tx.update, fullgraph=True)
        state, p = tx.init(params), params
        for grads in seq:
            u, state = update(grads, state, p)
            p = transforms.apply_updates(p, u)
    torch._dynamo.reset()
    want, _ = run_tx(tx, params, seq)
    for a, b, p0 in zip(optree.tree_leaves(p), optree.tree_leaves(want), optree.tree_leaves(params)):
        if emulate:
            assert torch.equal(a, b)
        else:
            assert (a - b).abs().max() <= 0.05 * (b - p0).abs().max()


@pytest.mark.parametrize("kw,match", [
    (dict(momentum=-0.1), "momentum"),
    (dict(ns_steps=0), "ns_steps"),
    (dict(ns_steps=100), "ns_steps"),
    (dict(adjust_lr_fn="spectral"), "adjust_lr_fn"),
    (dict(lr=float("nan")), "lr"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
])
def test_muon_refuses_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        transforms.muon(**kw)


def test_muon_refuses_a_leaf_that_is_not_a_matrix_naming_it():
    with pytest.raises(ValueError, match=r"'layers/1/b'.*\(7,\).*partition"):
        transforms.muon().init({"layers": [torch.zeros(3, 4), {"b": torch.zeros(7)}]})


def test_muon_under_the_engine_names_a_leaf_that_is_not_a_matrix():
    engine = fzero.zero1(transforms.muon(), param_dtype=torch.float32)
    with pytest.raises(ValueError, match="leaf 'b' has shape \\(7,\\)"):
        engine.init({"w": torch.zeros(4, 4), "b": torch.zeros(7)})


def test_muon_under_the_engine_names_a_matrix_with_no_elements_at_init():
    """A zero-size matrix labelled ``muon`` (an empty embedding table) is refused at ``init``,
    naming it, before any collective: not a ``torch.cat`` error at the first step."""
    tx = transforms.partition({"muon": transforms.muon(), "adamw": transforms.adamw()},
                              {"w": "muon", "z": "muon", "b": "adamw"})
    engine = fzero.zero1(tx, param_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"leaf 'z' has shape \(0, 4\), no elements: Muon has no matrix"):
        engine.init({"w": torch.zeros(4, 4), "z": torch.zeros(0, 4), "b": torch.zeros(7)})


def test_adjusted_ratio_is_torchs():
    assert muon_module.adjusted_ratio((40, 10), None) == math.sqrt(4.0)
    assert muon_module.adjusted_ratio((10, 40), "original") == 1.0
    assert muon_module.adjusted_ratio((10, 40), "match_rms_adamw") == 0.2 * math.sqrt(40)
