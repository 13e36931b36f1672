import math
from functools import partial

import pytest
import torch
from optree import tree_leaves, tree_map

from fzero.models import gpt
from fzero.models.gpt import GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
LOW = [torch.float16, torch.bfloat16]


def _init(cfg=CFG, dtype=torch.float32, seed=0):
    return gpt.init(torch.Generator().manual_seed(seed), cfg, dtype=dtype)


def _batch(cfg=CFG, B=2, T=32, seed=1):
    tok = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return tok[:, :-1], tok[:, 1:]


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _flat(tree):
    return torch.cat([t.float().flatten() for t in tree_leaves(tree)])


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_forward_shape_and_dtype(dtype):
    params = _init(dtype=dtype)
    assert all(t.dtype == dtype for t in tree_leaves(params))
    tokens, targets = _batch(T=20)  # shorter than block_size
    logits = gpt.apply(params, tokens, CFG)
    assert logits.shape == (2, 20, CFG.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    loss = gpt.loss(params, (tokens, targets), CFG)
    assert loss.shape == () and loss.dtype == torch.float32


def test_param_tree_and_num_params():
    for tied in (True, False):
        cfg = GPTConfig.tiny(vocab_size=256) if tied else GPTConfig(256, 128, 4, 4, 128, tied=False)
        params = _init(cfg)
        assert ("head" in params) != tied and len(params["blocks"]) == cfg.n_layer
        assert sum(t.numel() for t in tree_leaves(params)) == cfg.num_params()
    blk = params["blocks"][0]
    assert {k: tuple(v.shape) for k, v in blk["attn"].items()} == {
        "qkv_w": (384, 128), "qkv_b": (384,), "proj_w": (128, 128), "proj_b": (128,)}
    assert {k: tuple(v.shape) for k, v in blk["mlp"].items()} == {
        "fc_w": (512, 128), "fc_b": (512,), "proj_w": (128, 512), "proj_b": (128,)}
    assert params["head"].shape == params["wte"].shape == (256, 128)
    tied, untied = GPTConfig.gpt2(), GPTConfig(50257, 1024, 12, 12, 768, tied=False)
    assert untied.num_params() - tied.num_params() == 50257 * 768


def test_preset_param_counts():
    assert GPTConfig.tiny().num_params() == 842_496
    assert GPTConfig.small().num_params() == 10_844_160
    assert GPTConfig.gpt2().num_params() == 124_439_808  # the published 124M


def test_init_statistics_and_dtype_independence():
    cfg = GPTConfig.tiny()
    params = _init(cfg)
    blocks = params["blocks"]
    std = lambda key, name: torch.cat([b[key][name].flatten() for b in blocks]).std().item()
    assert std("attn", "qkv_w") == pytest.approx(0.02, rel=0.02)
    assert std("mlp", "fc_w") == pytest.approx(0.02, rel=0.02)
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert std("attn", "proj_w") == pytest.approx(resid, rel=0.02)
    assert std("mlp", "proj_w") == pytest.approx(resid, rel=0.02)
    assert all(torch.equal(b[ln]["g"], torch.ones(cfg.n_embd)) and not b[ln]["b"].any()
               for b in blocks for ln in ("ln1", "ln2"))
    for a, b in zip(tree_leaves(_init(cfg, torch.bfloat16)), tree_leaves(params)):
        assert torch.equal(a, b.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_matches_fp32(dtype):
    tokens, targets = _batch()
    ref = gpt.apply(_init(), tokens, CFG)
    # Measured relative error ~0.65 eps for both fp16 and bf16.
    assert _rel_err(gpt.apply(_init(dtype=dtype), tokens, CFG), ref) < 2 * torch.finfo(dtype).eps


def test_causal():
    params, (tokens, _) = _init(), _batch()
    t = 10
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % CFG.vocab_size
    a, b = gpt.apply(params, tokens, CFG), gpt.apply(params, changed, CFG)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).gt(1e-4).all()  # every later position sees it


def test_initial_loss_is_log_vocab():
    cfg = GPTConfig.tiny(vocab_size=256)
    loss = gpt.loss(_init(cfg), _batch(cfg, B=4, T=64), cfg)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.3


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_grad_and_value(dtype):
    batch = _batch()
    loss_fn = partial(gpt.loss, config=CFG)
    params = _init(dtype=dtype)
    grads, value = torch.func.grad_and_value(loss_fn)(params, batch)
    assert value.dtype == torch.float32 and torch.isfinite(value)
    for g, p in zip(tree_leaves(grads), tree_leaves(params)):
        assert g.shape == p.shape and g.dtype == dtype and torch.isfinite(g).all()
    ref_grads, ref_value = torch.func.grad_and_value(loss_fn)(_init(), batch)
    # Measured relative error ~0.75 eps for both fp16 and bf16 (0 for fp32).
    assert _rel_err(_flat(grads), _flat(ref_grads)) < 2 * torch.finfo(dtype).eps
    assert abs(value.item() - ref_value.item()) < 2 * torch.finfo(dtype).eps * ref_value.item()


def test_sgd_memorises_fixed_batch():
    batch = _batch(T=16)
    params = _init()
    step = torch.func.grad_and_value(partial(gpt.loss, config=CFG))
    losses = []
    for _ in range(30):
        grads, value = step(params, batch)
        losses.append(value.item())
        params = tree_map(lambda p, g: p - 0.1 * g, params, grads)
    assert losses[-1] < 0.5 * losses[0]  # measured 4.19 -> 0.56


def test_rejects_sequence_longer_than_block_size():
    tokens, _ = _batch(T=CFG.block_size + 1)
    with pytest.raises(ValueError, match="block_size"):
        gpt.apply(_init(), tokens, CFG)
