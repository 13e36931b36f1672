"""fzero.module: an ``nn.Module``'s params, buffers and pure ``apply``; its buffers across ranks;
the trained values back into the net. Against DDP + ``torch.optim.AdamW`` + ``torch.autocast``."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fzero
from fzero import transforms
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


class TinyLM(nn.Module):
    """What a transformer fine-tune brings: token embeddings tied to the output layer, a frozen
    first block, and the blocks under activation checkpointing (non-reentrant, what DDP
    supports). Predicts the first token from the mean of the last block's states; no biases and
    no dropout, as ``Encoder``."""

    def __init__(self, vocab: int = 8, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                                               bias=False) for _ in range(3))
        self.blocks[0].requires_grad_(False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(h.mean(1))


def data(kind: str, step: int, n: int = BATCH):
    g = torch.Generator().manual_seed(step)
    if kind == "lm":
        ids = torch.randint(8, (n, 5), generator=g)
        return ids, ids[:, 0]
    x = torch.randn(n, 1, 8, 8, generator=g) if kind.startswith("cnn") else torch.randn(n, 5, 6, generator=g)
    return x, x.flatten(1)[:, :4].argmax(1)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"cnn": cnn, "cnn-plain": lambda: cnn(affine=False), "encoder": Encoder, "lm": TinyLM}[kind]()


def cross_entropy(fm):
    """The loss of ``fm``'s net on ``(x, y)``, with its new buffers as the aux value."""
    def loss_fn(params, buffers, x, y):
        out, buffers = fm.apply(params, buffers, x)
        return F.cross_entropy(out.float(), y), buffers

    return loss_fn


def train_fzero(net, kind, rank, world):
    """STEPS of fzero (BF16 params, AdamW) on this rank's rows; ``net`` then holds the result."""
    fm = fzero.module.functional(net)
    engine = fzero.zero1(transforms.adamw(lr=LR, weight_decay=WD), param_dtype=BF16)
    params, state, ss = engine.init(fm.params)
    buffers = fm.buffers
    grad_fn = engine.grad_and_value(cross_entropy(fm), has_aux=True)
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    torch.manual_seed(100 + rank)  # dropout: each rank its own stream, the same in both runs
    losses = []
    for step in range(STEPS):
        x, y = data(kind, step)
        buffers = fzero.module.broadcast_buffers(engine, buffers)
        grads, (loss, buffers) = grad_fn(params, ss, buffers, x[lo:hi], y[lo:hi])
        params, state, ss, _ = engine.step(params, grads, state, ss)
        losses.append(loss)
    fm.load_into(params, fzero.module.broadcast_buffers(engine, buffers), engine=engine, state=state)
    return torch.stack(losses)


def train_ddp(net, kind, rank, world, autocast: bool):
    """The same with DDP + torch.optim.AdamW (FP32 params), under ``torch.autocast(bfloat16)``."""
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
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
@pytest.mark.parametrize("kind", ["cnn-plain", "cnn", "encoder", "lm"])
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


# ---------------------------------------------------------------------------- apply
class Probe(nn.Module):
    """Records the dtypes its forward sees; holds a plain floating buffer and BatchNorm's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("offset", torch.full((3,), 0.5))
        self.seen = {}

    def forward(self, x, extra=None, ids=None):
        self.seen = {"x": x.dtype, "extra": extra["y"].dtype if extra else None, "ids": None if ids is None else ids.dtype,
                     "offset": self.offset.dtype}
        return self.bn(self.lin(x) + self.offset)


def test_apply_equals_the_net_and_leaves_its_inputs_alone():
    net = build("cnn")
    ref = copy.deepcopy(net)
    fm = fzero.module.functional(net)
    before = {k: v.clone() for k, v in fm.buffers.items()}
    x, _ = data("cnn", 0)
    torch.manual_seed(1)
    out, new = fm.apply(fm.params, fm.buffers, x)
    torch.manual_seed(1)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)  # the same dropout mask too
    for k, v in ref.named_buffers():  # the forward's in-place updates come back...
        assert torch.equal(new[k], v), k
        assert torch.equal(fm.buffers[k], before[k]), k  # ...not in place (fm.buffers: the net's own memory)
    assert int(new["1.num_batches_tracked"]) == 1 and not torch.equal(new["1.running_mean"], before["1.running_mean"])


def test_apply_casts_floating_inputs_to_the_params_dtype():
    net = Probe()
    fm = fzero.module.functional(net)
    params = {k: v.to(BF16) for k, v in fm.params.items()}
    x64, ids = torch.randn(4, 3, dtype=torch.float64), torch.arange(4)
    out, _ = fm.apply(params, fm.buffers, x64, extra={"y": torch.randn(2)}, ids=ids)
    assert net.seen == {"x": BF16, "extra": BF16, "ids": torch.int64, "offset": BF16} and out.dtype == BF16
    assert x64.dtype == torch.float64
    with pytest.raises(RuntimeError, match="dtype"):  # without the cast: FP32 input, BF16 weight
        fzero.module.functional(net, cast_inputs=False).apply(params, fm.buffers, x64.float())


def test_buffer_policy_batchnorm_stats_fp32_as_autocast_others_in_the_params_dtype():
    net = build("cnn-plain")
    ref = copy.deepcopy(net)
    with torch.no_grad():  # what fzero computes with: the BF16 params
        for p in ref.parameters():
            p.copy_(p.to(BF16))
    fm = fzero.module.functional(net)
    x, _ = data("cnn", 0)
    torch.manual_seed(1)
    out, new = fm.apply({k: v.to(BF16) for k, v in fm.params.items()}, fm.buffers, x)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=BF16):
        want = ref(x)
    assert new["1.running_mean"].dtype == torch.float32 and new["1.num_batches_tracked"].dtype == torch.int64
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for k, v in ref.named_buffers():
        assert torch.equal(new[k], v), k  # FP32 running stats, bit for bit autocast's
    probe = fzero.module.functional(Probe())
    _, new = probe.apply({k: v.to(BF16) for k, v in probe.params.items()}, probe.buffers, torch.randn(4, 3))
    assert {k: v.dtype for k, v in new.items()} == {"offset": BF16, "bn.running_mean": torch.float32,
                                                     "bn.running_var": torch.float32, "bn.num_batches_tracked": torch.int64}
    # BatchNorm's weight enters in FP32 (exact upcast), its grad comes back in the params' dtype
    grads = torch.func.grad(lambda p: probe.apply(p, probe.buffers, torch.randn(4, 3))[0].float().sum())(
        {k: v.to(BF16) for k, v in probe.params.items()})
    assert all(g.dtype == BF16 for g in grads.values())


# ---------------------------------------------------------------------------- params: ties, errors
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_tied_param_is_one_leaf_used_in_both_places_and_written_under_both_names():
    torch.manual_seed(0)
    net = Tied()
    ref = copy.deepcopy(net)
    fm = fzero.module.functional(net)
    assert list(fm.params) == ["embed.weight"]
    ids = torch.tensor([0, 3, 1])
    grads = torch.func.grad(lambda p: fm.apply(p, fm.buffers, ids)[0].square().sum())(fm.params)
    ref(ids).square().sum().backward()
    torch.testing.assert_close(grads["embed.weight"], ref.embed.weight.grad)  # the sum over both uses
    engine = fzero.zero1(transforms.adamw(lr=0.1), param_dtype=BF16)
    params, state, _ = engine.init(fm.params)
    sd = fm.state_dict(params, fm.buffers, engine=engine, state=state)
    assert list(sd) == list(ref.state_dict()) == ["embed.weight", "head.weight"]
    assert torch.equal(sd["embed.weight"], sd["head.weight"])


def test_two_parameters_over_one_memory_or_none_at_all_are_refused():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    net[1].weight = nn.Parameter(net[0].weight.detach())  # another Parameter, the same memory
    with pytest.raises(ValueError, match=r"'0.weight' and '1.weight' are two Parameters over one memory"):
        fzero.module.functional(net)
    with pytest.raises(ValueError, match="Sequential has no parameters"):
        fzero.module.functional(nn.Sequential(nn.ReLU()))


def test_apply_and_state_dict_name_what_is_wrong():
    fm = fzero.module.functional(build("cnn"))
    with pytest.raises(ValueError, match=r"params do not match the net's: missing \['9.bias'\], unknown \['bias'\]"):
        fm.apply({**{k: v for k, v in fm.params.items() if k != "9.bias"}, "bias": fm.params["9.bias"]}, fm.buffers, None)
    with pytest.raises(TypeError, match="share one floating dtype"):
        fm.apply({**fm.params, "9.bias": fm.params["9.bias"].to(BF16)}, fm.buffers, None)
    with pytest.raises(TypeError, match="buffers must be a dict"):
        fm.apply(fm.params, list(fm.buffers.values()), None)
    engine = fzero.zero1(transforms.adamw(), param_dtype=BF16)
    with pytest.raises(ValueError, match="engine= and state= together"):
        fm.state_dict(fm.params, fm.buffers, engine=engine)


# ---------------------------------------------------------------------------- back into the net
@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_load_into_writes_the_fp32_master_and_the_buffers_and_the_net_saves(tmp_path, master):
    net = build("cnn")
    fm = fzero.module.functional(net)
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=BF16, master=master)
    params, state, ss = engine.init(fm.params)
    buffers = fm.buffers
    grad_fn = engine.grad_and_value(cross_entropy(fm), has_aux=True)
    for step in range(3):
        grads, (_, buffers) = grad_fn(params, ss, buffers, *data("cnn", step))
        params, state, ss, _ = engine.step(params, grads, state, ss)
    master_values = fzero.checkpoint.full_master(params, state, engine)
    assert fm.load_into(params, buffers, engine=engine, state=state) is net
    for k, p in net.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), master_values[k]), k  # not the BF16 params
        assert torch.equal(p.detach().to(BF16), params[k]) and not torch.equal(p.detach(), params[k].float()), k
    for k, b in net.named_buffers():
        assert torch.equal(b, buffers[k].to(b.dtype)), k
    torch.save(net.state_dict(), tmp_path / "net.pt")
    fresh = build("cnn")
    fresh.load_state_dict(torch.load(tmp_path / "net.pt"))
    x, _ = data("cnn", 99)
    torch.testing.assert_close(fresh.eval()(x), net.eval()(x), rtol=0, atol=0)
    without = fm.state_dict(params, buffers)  # no engine: the params as given, in the net's dtype
    assert all(torch.equal(without[k], params[k].float()) for k in params)


# ---------------------------------------------------------------------------- buffers across ranks
def test_broadcast_buffers_at_one_rank_returns_them():
    buffers = {"a": torch.ones(2), "n": torch.tensor(3)}
    out = fzero.module.broadcast_buffers(fzero.zero1(transforms.adamw()), buffers)
    assert out.keys() == buffers.keys() and all(out[k] is buffers[k] for k in buffers)
    out = fzero.module.broadcast_buffers(fzero.comm.SimulatedComm(1, 4), buffers)  # every rank holds the same
    assert out.keys() == buffers.keys() and all(torch.equal(out[k], buffers[k]) for k in buffers)


def rank_buffers(rank):
    return {"mean": torch.full((3,), float(rank)), "count": torch.tensor(10 + rank), "var": torch.full((2, 2), rank + 0.5),
            "half": torch.full((2,), float(rank), dtype=BF16)}


def broadcast_on(rank, world, replicas):
    mine = rank_buffers(rank)
    given = {k: v.clone() for k, v in mine.items()}
    if replicas is None:  # the engine's communicator: the flat group
        out, counts = fzero.module.broadcast_buffers(fzero.zero1(transforms.adamw()), mine), None
    else:
        comm = RecordingHybridComm.of_mesh(init_device_mesh("cpu", (replicas, world // replicas),
                                                            mesh_dim_names=("replicate", "shard")))
        out, counts = fzero.module.broadcast_buffers(comm, mine), comm.counts()
    assert all(torch.equal(mine[k], given[k]) for k in mine)  # the inputs are not modified
    return {"out": out, "counts": counts}


@pytest.mark.multirank
@pytest.mark.parametrize("world, replicas", [(2, None), (4, 2)])
def test_broadcast_buffers_gives_every_rank_rank_0s(world, replicas):
    want = rank_buffers(0)
    for r in run_ranks(broadcast_on, world, replicas):
        assert list(r["out"]) == list(want)
        for k, v in want.items():
            assert r["out"][k].dtype == v.dtype and torch.equal(r["out"][k], v), k
        if replicas:  # one broadcast per dtype (float32, int64, bfloat16) in each group
            assert r["counts"] == {("broadcast", "shard"): [3, 4 * 7 + 8 + 4], ("broadcast", "replicate"): [3, 4 * 7 + 8 + 4]}


# ---------------------------------------------------------------------------- torch habits
class Checkpointed(nn.Module):
    """An input layer, a body run under ``torch.utils.checkpoint`` (``reentrant``: None runs it
    plainly) and a head; ``freeze`` turns off the input layer's ``requires_grad``."""

    def __init__(self, reentrant=None, freeze=False):
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)
        self.a.requires_grad_(not freeze)

    def forward(self, x):
        h = self.a(x)
        if self.reentrant is None:
            return self.head(self.body(h))
        return self.head(torch.utils.checkpoint.checkpoint(self.body, h, use_reentrant=self.reentrant))


def regression(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)


def train_checkpointed(net, dtype, steps=4):
    """``steps`` of fzero AdamW on ``net``: ``(grad norms, fm, params, state, engine)``."""
    fm = fzero.module.functional(net)
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=WD), param_dtype=dtype, loss_scale=None)
    params, state, ss = engine.init(fm.params)
    grad_fn = engine.grad_and_value(lambda p, x, y: F.mse_loss(fm.apply(p, fm.buffers, x)[0].float(), y))
    norms = []
    for step in range(steps):
        grads, _ = grad_fn(params, ss, *regression(step))
        params, state, ss, info = engine.step(params, grads, state, ss)
        norms.append(info["grad_norm"])
    return torch.stack(norms), fm, params, state, engine


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_grads_of_the_net_without_it(dtype, reentrant):
    """The recomputation inside backward sees the params ``apply`` was given (not the net's own
    weights): the same grads, bit for bit, as the same net without checkpointing."""
    torch.manual_seed(0)
    plain = Checkpointed()
    ckpt = copy.deepcopy(plain)
    ckpt.reentrant = reentrant
    want, *_ = train_checkpointed(plain, dtype)
    got, *_ = train_checkpointed(ckpt, dtype)
    assert torch.equal(got, want), (got, want)


def test_frozen_params_are_not_trained_and_hold_no_state_as_torch_optim():
    torch.manual_seed(0)
    net = Checkpointed(freeze=True)
    ref = copy.deepcopy(net)
    frozen = {k: v.clone() for k, v in net.a.state_dict().items()}
    _, fm, params, state, engine = train_checkpointed(net, torch.float32)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=WD)
    for step in range(4):
        x, y = regression(step)
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    assert sorted(fm.params) == ["body.0.bias", "body.0.weight", "body.2.bias", "body.2.weight", "head.bias", "head.weight"]
    assert sorted(fm.frozen) == ["a.bias", "a.weight"]
    assert engine.layout.numel == sum(p.numel() for p in ref.parameters() if p.requires_grad)  # no state for them
    fm.load_into(params, fm.buffers, engine=engine, state=state)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert all(torch.equal(net.a.state_dict()[k], v) for k, v in frozen.items())  # not moved, bit for bit
    lin = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="every parameter of Linear has requires_grad=False"):
        fzero.module.functional(lin)
    assert list(fzero.module.functional(lin.requires_grad_(True)).params) == ["weight", "bias"]  # a later try works


def test_the_net_refuses_its_own_forward_and_state_dicts_while_fzero_trains_it():
    """After the first ``apply`` the net's own weights are stale: ``net(x)``, ``net.state_dict()``
    and ``net.load_state_dict()`` raise naming fzero's way; after ``load_into`` they work again."""
    torch.manual_seed(0)
    net = Checkpointed()
    x, _ = regression(0)
    before = net(x)  # before training: the net's own weights are the ones fzero starts from
    _, fm, params, state, engine = train_checkpointed(net, BF16, steps=2)
    with pytest.raises(RuntimeError, match=r"Checkpointed.forward while fzero trains the net.*fm.apply\(params, buffers"):
        net(x)
    with pytest.raises(RuntimeError, match=r"state_dict\(\) while fzero trains.*fm.state_dict\(params, buffers, engine"):
        net.state_dict()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) while fzero trains.*engine.load_params\(state"):
        net.load_state_dict(Checkpointed().state_dict())
    fm.load_into(params, fm.buffers, engine=engine, state=state)
    fresh = Checkpointed()
    fresh.load_state_dict(fzero.checkpoint.full_master(params, state, engine))
    trained = net(x)  # the FP32 master's weights now
    assert torch.equal(trained, fresh(x)) and not torch.equal(trained, before)
    net.load_state_dict(net.state_dict())


def test_backward_through_apply_outside_grad_and_value_names_it():
    torch.manual_seed(0)
    net = Checkpointed()
    fm = fzero.module.functional(net)
    engine = fzero.zero1(transforms.adamw(), param_dtype=BF16)
    params, _, _ = engine.init(fm.params)
    x, y = regression(0)
    out, _ = fm.apply(params, fm.buffers, x)
    with pytest.raises(RuntimeError, match=r"backward through fm.apply's output.*engine.grad_and_value"):
        F.mse_loss(out.float(), y).backward()
    with torch.no_grad():  # evaluation: the output as it is
        assert not fm.apply(params, fm.buffers, x)[0].requires_grad
    net.eval()
    assert not fm.apply(params, fm.buffers, x)[0].requires_grad


class SharedAcrossCheckpoint(nn.Module):
    """One layer used inside a reentrant checkpoint and again outside it: its grad comes from two
    backward passes (the checkpoint's own and the outer one)."""

    def __init__(self):
        super().__init__()
        self.a, self.shared, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), self.a(x), use_reentrant=True)
        return self.head(self.shared(h))


@pytest.mark.parametrize("bucket_bytes", [None, 64])
def test_a_param_in_a_reentrant_checkpoint_and_outside_gets_both_parts_or_a_clear_error(bucket_bytes):
    torch.manual_seed(0)
    net = SharedAcrossCheckpoint()
    ref = copy.deepcopy(net)
    x, y = regression(0)
    F.mse_loss(ref(x), y).backward()
    fm = fzero.module.functional(net)
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float32, loss_scale=None, bucket_bytes=bucket_bytes)
    params, _, ss = engine.init(fm.params)
    grad_fn = engine.grad_and_value(lambda p, x, y: F.mse_loss(fm.apply(p, fm.buffers, x)[0], y))
    if bucket_bytes is None:  # one bucket: it starts after the last part of every grad
        grads, _ = grad_fn(params, ss, x, y)
        for k, g in fzero.unflatten(grads.grads, engine.layout).items():
            torch.testing.assert_close(g, ref.get_parameter(k).grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
        return
    with pytest.raises(RuntimeError, match=r"param leaf 'shared.(weight|bias)' got a second part of its grad.*use_reentrant=False"):
        grad_fn(params, ss, x, y)
