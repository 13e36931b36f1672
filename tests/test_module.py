"""fzero.module: an ``nn.Module``'s params, buffers and pure ``apply``; its buffers across ranks;
the trained values back into the net. Against DDP + ``torch.optim.AdamW`` + ``torch.autocast``."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fzero
import transforms
from distributed import run_ranks
from helpers import RecordingHybridComm

CLASSES, STEPS, BATCH, LR, WD = 4, 8, 16, 1e-3, 0.01
BF16 = torch.bfloat16


def cnn(affine: bool = True) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, affine=affine), nn.ReLU(),
                         nn.Dropout(0.2), nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False),
                         nn.BatchNorm2d(8, affine=affine), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, CLASSES))


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` between a linear embedding and a classifier of the mean token.
    Dropout 0: under ``torch.func.grad`` (which ``engine.grad_and_value`` uses) torch draws the
    dropout mask of a non-contiguous activation -- the attention block's output -- in another
    element order than eager DDP does from the same generator state, so the two runs would drop
    different elements (the CNN's contiguous activations get the same masks). No biases in the
    layers: the attention's key bias has a zero grad in exact arithmetic (softmax ignores a shift
    of a query's scores), so its grad is rounding noise that Adam turns into full steps, in
    different directions in any two runs that round differently."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x, padding_mask=None):
        return self.head(self.encoder(self.embed(x), src_key_padding_mask=padding_mask).mean(1))


def data(kind: str, step: int, n: int = BATCH):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 1, 8, 8, generator=g) if kind.startswith("cnn") else torch.randn(n, 5, 6, generator=g)
    return x, x.flatten(1)[:, :4].argmax(1)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"cnn": cnn, "cnn-plain": lambda: cnn(affine=False), "encoder": Encoder}[kind]()


def train_fzero(net, kind, rank, world):
    """STEPS of fzero (BF16 params, AdamW) on this rank's rows; ``net`` then holds the result."""
    fm = fzero.module.functional(net)
    engine = fzero.zero1(transforms.adamw(lr=LR, weight_decay=WD), param_dtype=BF16)
    params, state, ss = engine.init(fm.params)
    buffers = fm.buffers

    def loss_fn(params, buffers, x, y, ss):
        out, buffers = fm.apply(params, buffers, x)
        loss = F.cross_entropy(out.float(), y)
        return fzero.scale_loss(loss, ss), (loss.detach(), buffers)

    grad_fn = engine.grad_and_value(loss_fn, has_aux=True)
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    torch.manual_seed(100 + rank)  # dropout: each rank its own stream, the same in both runs
    losses = []
    for step in range(STEPS):
        x, y = data(kind, step)
        buffers = fzero.module.broadcast_buffers(engine, buffers)
        grads, (_, (loss, buffers)) = grad_fn(params, buffers, x[lo:hi], y[lo:hi], ss)
        params, state, ss, _ = engine.step(params, grads, state, ss)
        losses.append(loss)
    fm.load_into(params, fzero.module.broadcast_buffers(engine, buffers), engine=engine, state=state)
    return torch.stack(losses)


def train_ddp(net, kind, rank, world, autocast: bool):
    """The same with DDP + torch.optim.AdamW (FP32 params), under ``torch.autocast(bfloat16)``."""
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    torch.manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        x, y = data(kind, step)
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            out = model(x[lo:hi])
        loss = F.cross_entropy(out.float(), y[lo:hi])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def fzero_and_ddp(rank, world, kind):
    """fzero, DDP + autocast and DDP in FP32 from one initial net; their losses, state dicts, and
    the trained nets' outputs in eval mode on fresh inputs."""
    runs = {"fzero": build(kind)}
    runs["autocast"], runs["fp32"] = copy.deepcopy(runs["fzero"]), copy.deepcopy(runs["fzero"])
    out = {"losses": {"fzero": train_fzero(runs["fzero"], kind, rank, world),
                      "autocast": train_ddp(runs["autocast"], kind, rank, world, True),
                      "fp32": train_ddp(runs["fp32"], kind, rank, world, False)}}
    x, _ = data(kind, 10**6, 32)
    with torch.no_grad():
        out["eval"] = {name: net.eval()(x) for name, net in runs.items()}
    out["state"] = {name: net.state_dict() for name, net in runs.items()}
    return out


def distance(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["cnn-plain", "cnn", "encoder"])
def test_two_ranks_bf16_equal_ddp_with_autocast(kind):
    out = run_ranks(fzero_and_ddp, 2, kind)
    r0 = out[0]
    for r in out:  # every rank's net is rank 0's, buffers included (DDP's: its own last forward)
        for k, v in r["state"]["fzero"].items():
            assert torch.equal(v, r0["state"]["fzero"][k]), k
    mine, ref, fp32 = r0["state"]["fzero"], r0["state"]["autocast"], r0["state"]["fp32"]
    assert mine.keys() == ref.keys() and all(v.dtype == ref[k].dtype for k, v in mine.items())
    for k, v in mine.items():
        assert v.is_floating_point() or torch.equal(v, ref[k]), k  # BatchNorm's batch counter
    if kind == "cnn-plain":
        # BatchNorm without affine params: the runs do the same arithmetic (BF16 convs and
        # linear, BatchNorm on BF16 input with FP32 statistics, the same dropout masks); only
        # AdamW's FP32 update is written differently (a few ulp).
        torch.testing.assert_close(r0["losses"]["fzero"], r0["losses"]["autocast"], rtol=0, atol=0)
        for k, v in mine.items():
            torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(r0["eval"]["fzero"], r0["eval"]["autocast"], rtol=1e-5, atol=1e-6)
        return
    # With BatchNorm's or LayerNorm's weight and bias, autocast computes with their FP32 values
    # and FP32 grads, fzero with the BF16 params and grads: the runs differ by BF16 rounding in
    # a few places, as autocast's run differs from a full FP32 run by BF16 rounding in others.
    # Of the same order, not the same size: fzero's may be at most twice as far from autocast's
    # (measured: 0.4x-1.6x). A wrong buffer, dropout mask or update is 10x-100x farther.
    def far(a, b):
        return float((a - b).abs().max())

    losses, evals = r0["losses"], r0["eval"]
    for what, got, floor in (("losses", far(losses["fzero"], losses["autocast"]), far(losses["fp32"], losses["autocast"])),
                             ("eval", far(evals["fzero"], evals["autocast"]), far(evals["fp32"], evals["autocast"])),
                             ("params and buffers", distance(mine, ref), distance(fp32, ref))):
        assert got <= 2 * floor, f"{what}: {got:.3g} from DDP + autocast, FP32 DDP: {floor:.3g}"
