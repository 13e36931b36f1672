"""engine.grad_and_value: reduce-scatter started inside backward (fzero/backward.py).

Same results as differentiating the scaled loss and reducing in ``step`` (bitwise), at 1, 2
and 3 ranks, bucketed or not, FP32 or FP16 reduce; the grad function applies the loss scale
itself; the collectives really start before backward ends and are waited only after it; unused
leaves count as zero, a loss no leaf reaches raises; micro-batches before the last communicate
nothing at stage 1 (``no_sync``), and with ``loss / MICRO`` step like the big batch and like DDP's
``no_sync`` with ``torch.optim.AdamW``; errors name what is wrong.
"""

import optree
import pytest
import torch

import fzero
import fzero.comm
from fzero import transforms
from distributed import run_ranks
from helpers import RecordingComm, counting_comm
from fzero.models import mlp

DIMS = (8, 32, 32, 4)
STEPS = 3
SCALE = 8.0


def setup(param_dtype, reduce_dtype=torch.float32, bucket_bytes=None, unused=False, group=None):
    p0 = mlp.init(torch.Generator().manual_seed(0), DIMS)
    if unused:  # a leaf the loss never touches (its own bucket when bucketed: the last leaf)
        p0["unused"] = torch.ones(5)
    loss_scale = fzero.StaticLossScale(SCALE) if param_dtype == torch.float16 else None
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=param_dtype,
                         loss_scale=loss_scale, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes, group=group)
    return engine, *engine.init(p0)


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, DIMS[0], generator=g), torch.randn(6, DIMS[-1], generator=g)


def plain_loss(params, b):
    return mlp.loss({"layers": params["layers"]}, b)


def run(rank, engine, params, state, ss, *, mode, micro=1):
    """STEPS steps; ``mode``: "pytree" (torch.func.grad of the scaled loss, reduced in step),
    "overlap" or "sync"."""
    gv = engine.grad_and_value(plain_loss, overlap=mode == "overlap")
    for step in range(STEPS):
        acc = None
        for m in range(micro):
            b = batch(rank, 10 * step + m)
            if mode == "pytree":
                grads = torch.func.grad(lambda p: fzero.scale_loss(plain_loss(p, b), ss))(params)
            else:
                grads, loss = gv(params, ss, b)
                assert loss.requires_grad is False and torch.equal(loss, plain_loss(params, b))
            acc = grads if micro == 1 else engine.accumulate(acc, grads)
        params, state, ss, info = engine.step(params, acc, state, ss)
        assert not info["found_inf"]
    return fzero.flatten(params, engine.layout), state.master


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bucket_bytes", [None, 256])
def test_one_process_bitwise_equal_to_pytree_grads(param_dtype, bucket_bytes):
    ref = run(0, *setup(param_dtype, bucket_bytes=bucket_bytes), mode="pytree")
    for mode in ("overlap", "sync"):
        out = run(0, *setup(param_dtype, bucket_bytes=bucket_bytes), mode=mode)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), mode


CONFIGS = [  # (param_dtype, reduce_dtype, bucket_bytes, unused)
    (torch.float16, torch.float32, 256, False),
    (torch.float16, torch.float16, 256, True),
    (torch.bfloat16, torch.float32, None, True),
]


def compare_modes(rank, world_size):
    out = []
    for cfg in CONFIGS:
        res = {mode: run(rank, *setup(*cfg), mode=mode) for mode in ("pytree", "overlap", "sync")}
        out.append(res)
    # micro-batches: shards from grad_and_value summed by accumulate == stage-1 accumulation
    acc = {mode: run(rank, *setup(torch.float16, bucket_bytes=256), mode=mode, micro=2) for mode in ("pytree", "overlap")}
    return out, acc


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_bitwise_equal_to_pytree_grads(world_size):
    results = run_ranks(compare_modes, world_size)
    for rank, (out, acc) in enumerate(results):
        for cfg, res in zip(CONFIGS, out):
            for mode in ("overlap", "sync"):
                assert torch.equal(res[mode][0], res["pytree"][0]), (rank, cfg, mode)
                assert torch.equal(res[mode][1], res["pytree"][1]), (rank, cfg, mode)
        # summing reduced shards vs reducing the sum: same to rounding
        torch.testing.assert_close(acc["overlap"][1], acc["pytree"][1], rtol=1e-6, atol=1e-6)
    for rank in range(1, world_size):  # and every rank holds the same params
        for res, res0 in zip(results[rank][0], results[0][0]):
            assert torch.equal(res["overlap"][0], res0["overlap"][0])


def collective_order(rank, world_size):
    """Log reduce-scatter starts, waits, and a point late in backward (the first layer's input
    grad), for one batch (overlap on and off) and for the last of two micro-batches."""
    comm = RecordingComm.of(None)
    events = comm.events
    engine, params, state, ss = setup(torch.float32, bucket_bytes=4 * 100, group=comm)  # one bucket per layer

    def loss(p, b):
        x, y = b
        h = x @ p["layers"][0]["w"] + p["layers"][0]["b"]
        h.register_hook(lambda g: events.append(("late", 0)))  # fires once only layer 0's grads are left
        for layer in p["layers"][1:]:
            h = torch.nn.functional.gelu(h) @ layer["w"] + layer["b"]
        return torch.nn.functional.mse_loss(h, y)

    out = {}
    for overlap in (True, False):
        events.clear()
        engine.grad_and_value(loss, overlap=overlap)(params, ss, batch(rank, 0))
        out[overlap] = [name.replace("reduce_scatter", "start") for name, _ in events]
    gv = engine.grad_and_value(loss)
    events.clear()
    acc, _ = gv.no_sync(None, params, ss, batch(rank, 1))
    out["no_sync"] = [name for name, _ in events if name != "late"]
    events.clear()
    gv.sync(acc, params, ss, batch(rank, 0))
    out["sync"] = [name.replace("reduce_scatter", "start") for name, _ in events]
    return out, len(engine.layout.buckets)


@pytest.mark.multirank
def test_reduce_scatters_start_in_backward_and_wait_after_it():
    (out, n), _ = run_ranks(collective_order, 2)
    assert n >= 3
    # overlap, and the last micro-batch after no_sync: buckets of the later layers start before
    # backward reaches layer 0; nothing waits until backward is done
    assert out["no_sync"] == []
    for ev in (out[True], out["sync"]):
        assert ev.count("start") == n and ev.count("wait") == n
        assert ev.index("start") < ev.index("late") < max(i for i, e in enumerate(ev) if e == "start")
        assert "wait" not in ev[: ev.index("late") + 1]
    # overlap=False: each start is waited for at once, inside backward
    ev = out[False]
    assert [e for e in ev if e != "late"] == ["start", "wait"] * n and ev.index("wait") < ev.index("late")


def test_the_grad_function_applies_the_loss_scale_and_returns_the_loss_unscaled():
    """FP16 with the default dynamic scale (2**16): ``fn`` returns the plain loss and the grads
    still come out scaled, so ``step`` unscales them to the true norm (without the scale they
    would be 2**16 times too small, and clipping would never trigger)."""
    p0 = mlp.init(torch.Generator().manual_seed(0), DIMS)
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float16)
    params, state, ss = engine.init(p0)
    assert ss.scale.item() == 2.0**16
    b = batch(0, 0)
    grads, loss = engine.grad_and_value(mlp.loss)(params, ss, b)
    assert torch.equal(loss, mlp.loss(params, b)) and not loss.requires_grad
    ref = torch.func.grad(lambda p: fzero.scale_loss(mlp.loss(p, b), ss))(params)
    assert torch.equal(grads.grads, fzero.flatten(ref, engine.layout))
    true_norm = torch.linalg.vector_norm(fzero.flatten(torch.func.grad(mlp.loss)(p0, b), engine.layout))
    info = engine.step(params, grads, state, ss)[3]
    torch.testing.assert_close(info["grad_norm"], true_norm, rtol=2e-3, atol=0)
    # the batch where the scaler state belongs (a loss that scaled itself took it last): named
    with pytest.raises(TypeError, match="second argument must be the LossScaleState from init/step, got tuple"):
        engine.grad_and_value(mlp.loss)(params, b)


def test_a_loss_that_no_param_reaches_raises_and_some_unused_leaves_count_as_zero():
    engine, params, state, ss = setup(torch.float32)
    module_weights = optree.tree_map(lambda w: w.requires_grad_(), mlp.init(torch.Generator().manual_seed(1), DIMS))
    no_param = f"none of the {len(engine.layout.shapes)} param leaves reached the loss.*instead of `apply`"
    for fn in (lambda p, b: mlp.loss(module_weights, b), lambda p, b: torch.tensor(1.0)):
        gv = engine.grad_and_value(fn)
        with pytest.raises(ValueError, match=no_param):
            gv(params, ss, batch(0, 0))
        with pytest.raises(ValueError, match=no_param):
            gv.no_sync(None, params, ss, batch(0, 0))
    engine, params, state, ss = setup(torch.float32, unused=True)
    grads, _ = engine.grad_and_value(plain_loss)(params, ss, batch(0, 0))
    ref = torch.func.grad(plain_loss)(params, batch(0, 0))
    assert torch.equal(grads.grads, fzero.flatten(ref, engine.layout)) and not ref["unused"].any()


def test_bad_loss_and_mixed_accumulation_raise():
    engine, params, state, ss = setup(torch.float32)
    with pytest.raises(TypeError, match="0-d floating loss"):
        engine.grad_and_value(lambda p, b: mlp.apply(p, b[0]))(params, ss, batch(0, 0))
    (loss, aux) = engine.grad_and_value(lambda p, b: (mlp.loss(p, b), "aux"), has_aux=True)(params, ss, batch(0, 0))[1]
    assert aux == "aux" and loss.ndim == 0
    # rank 0 of 2 (simulated): a stage-1 sum of unreduced grads cannot take a reduced shard
    p0 = mlp.init(torch.Generator().manual_seed(0), DIMS)
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, simulate=(0, 2))
    params, state, ss = engine.init(p0)
    acc = engine.accumulate(None, torch.func.grad(mlp.loss)(params, batch(0, 0)))
    shard, _ = engine.grad_and_value(mlp.loss)(params, ss, batch(0, 0))
    assert shard.grads.shape == (engine.layout.shard_numel,) != acc.grads.shape
    with pytest.raises(ValueError, match="accumulate either reduced shards or unreduced grads"):
        engine.accumulate(acc, shard)



def unused_on_one_rank(rank, world_size, b_rows):
    """Leaf ``b`` reaches the loss on rank 0 only. Buckets fill in reverse leaf order, so ``b``
    is alone in bucket 0, which backward completes first on rank 0 and last on rank 1."""
    g = torch.Generator().manual_seed(0)
    p0 = {"a": torch.randn(8, 16, generator=g), "b": torch.randn(16, b_rows, generator=g)}

    def loss(p, batch):
        x, y = batch
        h = torch.nn.functional.gelu(x @ p["a"])
        out = h @ p["b"] if rank == 0 else h[:, :b_rows]
        return torch.nn.functional.mse_loss(out, y)

    results = {}
    for mode in ("pytree", "overlap"):
        engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, bucket_bytes=4 * 16 * b_rows)  # b alone in bucket 0
        params, state, ss = engine.init(p0)
        gv = engine.grad_and_value(loss)
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(10 * step + rank)
            xy = torch.randn(6, 8, generator=gen), torch.randn(6, b_rows, generator=gen)
            grads = torch.func.grad(loss)(params, xy) if mode == "pytree" else gv(params, ss, xy)[0]
            params, state, ss, info = engine.step(params, grads, state, ss)
        results[mode] = (fzero.flatten(params, engine.layout), state.master,
                         [b.leaves for b in engine.layout.buckets], [b.shard for b in engine.layout.buckets])
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("b_rows", [8, 12], ids=["equal-buckets", "unequal-buckets"])
def test_a_leaf_unused_on_one_rank_only_reduces_like_zero_grads(b_rows):
    """Each rank starts its buckets in bucket order whatever order its grads complete in, so the
    reduce-scatters meet their peers' (started as completed, equal buckets silently summed the
    wrong grads and unequal ones aborted). The result: the unused leaf's grads count as zero on
    that rank, as with ``torch.func.grad`` and reducing in ``step``."""
    results = run_ranks(unused_on_one_rank, 2, b_rows)
    for res in results:
        leaves, shards = res["overlap"][2:]
        assert leaves == [(1,), (0,)] and (shards[0] == shards[1]) == (b_rows == 8)
        assert torch.equal(res["overlap"][0], res["pytree"][0])
        assert torch.equal(res["overlap"][1], res["pytree"][1])
    assert torch.equal(results[0]["overlap"][0], results[1]["overlap"][0])


MICRO, ROWS = 3, 4  # micro-batches per step, rows per micro-batch
LR, WD = 1e-2, 0.1


def rows(rank, step):
    """This rank's MICRO * ROWS rows of step ``step``."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(MICRO * ROWS, DIMS[0], generator=g), torch.randn(MICRO * ROWS, DIMS[-1], generator=g)


def micro_loss(params, part):
    """A micro-batch's loss divided by MICRO: the whole batch's mean once summed (DDP's habit)."""
    return mlp.loss(params, part) / MICRO


class LossModule(torch.nn.Module):
    """``loss_fn(params, batch)`` as an ``nn.Module`` that holds the params' leaves, for DDP."""

    def __init__(self, params, loss_fn):
        super().__init__()
        leaves, self.spec = optree.tree_flatten(params)
        self.leaves = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in leaves])
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.spec.unflatten(list(self.leaves)), batch)


def ddp_no_sync(rank, p0):
    """The reference: DDP + ``torch.optim.AdamW`` on the same micro-batches, ``loss / MICRO``
    backward under ``no_sync`` for all but the last; the global grad norm of each step and the
    params at the end, flat in ``fzero.flat``'s leaf order."""
    net = LossModule(p0, micro_loss)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(STEPS):
        x, y = rows(rank, step)
        opt.zero_grad()
        for m in range(MICRO):
            part = x[m * ROWS : (m + 1) * ROWS], y[m * ROWS : (m + 1) * ROWS]
            if m < MICRO - 1:
                with ddp.no_sync():  # .grad sums this rank's micro-batches
                    ddp(part).backward()
            else:  # all-reduced: the mean over ranks of the sum
                ddp(part).backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])))
        opt.step()
    return net.spec.unflatten([p.detach() for p in net.leaves]), torch.stack(norms)


def micro_batches_or_one_big_batch(rank, world_size, stage):
    """STEPS steps on the same rows per rank: one batch of MICRO * ROWS rows, or MICRO
    micro-batches of ``micro_loss`` (``no_sync`` then ``sync``); the collectives each grad call
    issues; and DDP's ``no_sync`` on the same micro-batches (``ddp_no_sync``)."""
    calls = []
    comm = counting_comm(calls)
    p0 = mlp.init(torch.Generator().manual_seed(0), DIMS)
    out = {}
    for mode in ("big", "micro"):
        engine = fzero.zero1(transforms.adamw(lr=LR, weight_decay=WD), param_dtype=torch.float32,
                             bucket_bytes=256, stage=stage, group=comm)
        params, state, ss = engine.init(p0)
        gv = engine.grad_and_value(mlp.loss if mode == "big" else micro_loss)
        issued, losses, norms = [], [], []
        for step in range(STEPS):
            x, y = rows(rank, step)
            if mode == "big":
                calls.clear()
                grads, loss = gv(params, ss, (x, y))
                issued.append([name for name, _ in calls])
            else:
                acc, loss = None, 0.0
                for m in range(MICRO):
                    part = x[m * ROWS : (m + 1) * ROWS], y[m * ROWS : (m + 1) * ROWS]
                    calls.clear()
                    if m < MICRO - 1:
                        acc, value = gv.no_sync(acc, params, ss, part)
                    else:
                        grads, value = gv.sync(acc, params, ss, part)
                    issued.append([name for name, _ in calls])
                    loss = loss + value  # each already divided by MICRO
            losses.append(loss)
            params, state, ss, info = engine.step(params, grads, state, ss)
            norms.append(info["grad_norm"])
        out[mode] = {"params": fzero.flatten(params, engine.layout), "master": state.master, "issued": issued,
                     "loss": torch.stack(losses), "norm": torch.stack(norms)}
    out["buckets"] = len(engine.layout.buckets)
    ddp_params, ddp_norms = ddp_no_sync(rank, p0)
    out["ddp"] = {"params": fzero.flatten(ddp_params, engine.layout), "norm": ddp_norms}
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 2])
def test_micro_batches_step_like_one_big_batch_and_ddp_and_stage_1_communicates_only_the_last(stage):
    """The step applies the sum of the micro-batches' grads, each the mean over ranks, as DDP's
    ``no_sync`` does: with each micro-batch's loss divided by MICRO (torch's habit), the grads'
    norm (which clipping reads) and the params after AdamW steps are the big batch's and those
    of DDP + ``torch.optim.AdamW``. At stage 1 the micro-batches before the last issue no
    collective and the last one reduce-scatter per bucket; stage 2 reduces every micro-batch."""
    for r in run_ranks(micro_batches_or_one_big_batch, 2, stage):
        big, micro, ddp, n = r["big"], r["micro"], r["ddp"], r["buckets"]
        assert n > 1
        for key in ("params", "master", "loss", "norm"):
            torch.testing.assert_close(micro[key], big[key], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(micro["norm"], ddp["norm"], rtol=1e-5, atol=0)
        torch.testing.assert_close(micro["params"], ddp["params"], rtol=1e-5, atol=1e-6)
        assert big["issued"] == [["reduce_scatter"] * n] * STEPS
        last = ["reduce_scatter"] * n
        assert micro["issued"] == ([[] if stage == 1 else last] * (MICRO - 1) + [last]) * STEPS


def test_micro_batch_sums_of_another_form_raise():
    """At stage 1 a micro-batch sum is this rank's unreduced FP32 ``[N*S]`` grads: a reduced
    shard (what a grad call returns) is another form, and raises instead of being added."""
    p0 = mlp.init(torch.Generator().manual_seed(0), DIMS)
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, simulate=(0, 2))  # rank 0 of 2
    params, state, ss = engine.init(p0)
    gv = engine.grad_and_value(mlp.loss)
    acc, _ = gv.no_sync(None, params, ss, batch(0, 0))
    assert acc.grads.shape == (engine.layout.padded_numel,) and acc.grads.dtype == torch.float32
    shard, _ = gv(params, ss, batch(0, 1))
    with pytest.raises(ValueError, match=r"at stage 1 micro-batches sum this rank's unreduced grads.*no_sync"):
        gv.sync(shard, params, ss, batch(0, 1))
    with pytest.raises(TypeError, match="acc must be None or the Accumulated from no_sync, got tuple"):
        gv.no_sync((acc.grads, acc.count), params, ss, batch(0, 1))
    grads, _ = gv.sync(acc, params, ss, batch(0, 1))
    assert grads.grads.shape == (engine.layout.shard_numel,) and grads.count.item() == 2
