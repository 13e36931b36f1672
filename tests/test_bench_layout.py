"""benchmarks/layout.py measures ``models.gpt`` against the same model with its matrices stored
[in, out]: that model must be ``models.gpt``, its loss and grads the same up to the transposition."""
import optree
import torch

from fzero.models import gpt
from layout import loss_in_out, transposed


def test_the_in_out_model_is_models_gpt():
    cfg = gpt.GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32)
    params = gpt.init(torch.Generator().manual_seed(0), cfg)
    batch = tuple(torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    turned = transposed(params)
    assert turned["blocks"][0]["mlp"]["fc_w"].shape == (cfg.n_embd, 4 * cfg.n_embd)  # [in, out]
    torch.testing.assert_close(loss_in_out(turned, batch, cfg), gpt.loss(params, batch, cfg))
    paths, want, _ = optree.tree_flatten_with_path(transposed(torch.func.grad(gpt.loss)(params, batch, cfg)))
    got = optree.tree_leaves(torch.func.grad(loss_in_out)(turned, batch, cfg))
    for path, g, w in zip(paths, got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{path}: {m}")
