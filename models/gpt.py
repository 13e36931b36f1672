"""Functional decoder-only transformer (GPT-2 architecture: pre-LN, learned positions).

Params pytree (D = n_embd, V = vocab_size, T = block_size; the blocks' weights stored
[out, in] as ``nn.Linear`` stores them, and applied with ``F.linear``: on a CPU the forward
and backward run faster than ``x @ w + b`` of [in, out] weights, docs/performance.md)::

    {"wte": [V, D], "wpe": [T, D],
     "blocks": [{"ln1": {"g": [D], "b": [D]},
                 "attn": {"qkv_w": [3D, D], "qkv_b": [3D], "proj_w": [D, D], "proj_b": [D]},
                 "ln2": {"g": [D], "b": [D]},
                 "mlp": {"fc_w": [4D, D], "fc_b": [4D], "proj_w": [D, 4D], "proj_b": [D]}},
                ...],
     "ln_f": {"g": [D], "b": [D]},
     "head": [V, D]}             # only when config.tied is False; else wte is the head

``n_head`` cannot be recovered from shapes, so ``apply``/``loss`` take the config as a
third argument; for a ``loss(params, batch)`` callable use
``functools.partial(gpt.loss, config=config)``.
"""

import math
from dataclasses import dataclass

import optree
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int  # maximum context length T
    n_layer: int
    n_head: int
    n_embd: int
    tied: bool = True  # share wte as the output projection
    mlp_ratio: int = 4

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} not divisible by n_head={self.n_head}")

    @classmethod
    def tiny(cls, vocab_size=256):
        """~0.84M params at V=256: CPU tests."""
        return cls(vocab_size, block_size=128, n_layer=4, n_head=4, n_embd=128)

    @classmethod
    def small(cls, vocab_size=256):
        """~10.8M params at V=256 (nanoGPT's character-level Shakespeare model)."""
        return cls(vocab_size, block_size=256, n_layer=6, n_head=6, n_embd=384)

    @classmethod
    def gpt2(cls):
        """GPT-2 small: 124,439,808 params."""
        return cls(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)

    def num_params(self):
        """Exact parameter count of ``init(..., self)``, without allocating anything."""
        D, H = self.n_embd, self.mlp_ratio * self.n_embd
        block = (
            2 * D  # ln1
            + D * 3 * D + 3 * D + D * D + D  # attn
            + 2 * D  # ln2
            + D * H + H + H * D + D  # mlp
        )
        head = 0 if self.tied else self.vocab_size * D
        return (self.vocab_size + self.block_size) * D + self.n_layer * block + 2 * D + head


def init(generator, config, dtype=torch.float32, device=None):
    """GPT-2 init: weights ~ N(0, 0.02), residual-stream projections ~ N(0, 0.02/sqrt(2L)),
    LayerNorm gains 1, biases 0.

    ``generator`` must be a CPU ``torch.Generator``. Values are drawn in fp32 on CPU and
    only then cast/moved, so a given seed gives the same params on every device and dtype.
    """
    D, H, L = config.n_embd, config.mlp_ratio * config.n_embd, config.n_layer
    # Each block adds two projections into the residual stream; scaling them keeps the
    # residual variance at init independent of depth.
    proj_std = 0.02 / math.sqrt(2 * L)

    def normal(*shape, std=0.02):
        return (torch.randn(*shape, generator=generator) * std).to(device, dtype)

    def zeros(n):
        return torch.zeros(n, device=device, dtype=dtype)

    def ln():
        return {"g": torch.ones(D, device=device, dtype=dtype), "b": zeros(D)}

    params = {
        "wte": normal(config.vocab_size, D),
        "wpe": normal(config.block_size, D),
        "blocks": [
            {
                "ln1": ln(),
                "attn": {"qkv_w": normal(3 * D, D), "qkv_b": zeros(3 * D),
                         "proj_w": normal(D, D, std=proj_std), "proj_b": zeros(D)},
                "ln2": ln(),
                "mlp": {"fc_w": normal(H, D), "fc_b": zeros(H),
                        "proj_w": normal(D, H, std=proj_std), "proj_b": zeros(D)},
            }
            for _ in range(L)
        ],
        "ln_f": ln(),
    }
    if not config.tied:
        params["head"] = normal(config.vocab_size, D)
    return params


def muon_labels(params):
    """``transforms.partition``'s labels for the nanoGPT-speedrun split: ``"muon"`` for the
    blocks' weight matrices, ``"adamw"`` for the rest (embeddings, the head, LayerNorms, biases).
    The matrices are stored ``[out, in]`` as ``nn.Linear``'s are, so ``muon(adjust_lr_fn=None)``,
    which scales by ``sqrt(max(1, A/B))`` of the stored ``[A, B]``, gives them Keller Jordan's
    ``sqrt(max(1, out/in))``; ``"match_rms_adamw"`` does not depend on the orientation."""
    def label(path, x):
        return "muon" if path[0] == "blocks" and x.ndim == 2 else "adamw"

    paths, leaves, spec = optree.tree_flatten_with_path(params)
    return spec.unflatten([label(p, x) for p, x in zip(paths, leaves)])


def _layer_norm(p, x):
    # Mean/variance of D half-precision values lose too many bits (and fp16 overflows on
    # large activations), so normalise in fp32 and return to the compute dtype.
    return F.layer_norm(x.float(), x.shape[-1:], p["g"].float(), p["b"].float(), 1e-5).to(x.dtype)


def _attention(p, x, n_head):
    # The heads by view and permute, not einops: under torch.compile dynamo traces einops'
    # pattern parsing on every trace: 0.5 s of the main job's first step (docs/startup.md).
    qkv = F.linear(x, p["qkv_w"], p["qkv_b"])  # [B, T, 3D]
    B, T, _ = qkv.shape
    q, k, v = qkv.view(B, T, 3, n_head, -1).permute(2, 0, 3, 1, 4)  # 3 x [B, H, T, D/H]
    # No upcast needed: SDPA's fused CPU/CUDA kernels keep the softmax max/sum in fp32 for
    # fp16/bf16 inputs (tests check the logits against fp32 to ~1 eps).
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(B, T, -1)  # [B, H, T, D/H] -> [B, T, D]
    return F.linear(y, p["proj_w"], p["proj_b"])


def _mlp(p, x):
    return F.linear(F.gelu(F.linear(x, p["fc_w"], p["fc_b"]), approximate="tanh"), p["proj_w"], p["proj_b"])


def apply(params, tokens, config):
    """tokens: int64 [B, T] with T <= block_size -> logits: fp32 [B, T, V].

    Computes in the params' dtype; LayerNorm statistics are fp32 and the logits are
    upcast to fp32 so the loss is taken in fp32.
    """
    T = tokens.shape[-1]
    if T > params["wpe"].shape[0]:
        raise ValueError(f"sequence length {T} exceeds block_size {params['wpe'].shape[0]}")
    x = F.embedding(tokens, params["wte"]) + params["wpe"][:T]  # [B, T, D]
    for blk in params["blocks"]:
        x = x + _attention(blk["attn"], _layer_norm(blk["ln1"], x), config.n_head)
        x = x + _mlp(blk["mlp"], _layer_norm(blk["ln2"], x))
    x = _layer_norm(params["ln_f"], x)
    head = params["wte"] if config.tied else params["head"]
    return (x @ head.T).float()


def loss(params, batch, config):
    """batch = (tokens int64 [B, T], targets int64 [B, T]) -> mean cross entropy, 0-d fp32.

    Targets equal to -100 are ignored (``F.cross_entropy`` default).
    """
    tokens, targets = batch
    logits = apply(params, tokens, config)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
