"""fzero.lineage: params edited behind the engine's back, params of another step, a donated
state used twice; ``Engine.load_params``, the supported way to set weights after ``init``."""

import copy
import os
import re

import optree
import pytest
import torch
from torch import nn

import fzero
from fzero import lineage, transforms
from fzero.checkpoint import CheckpointError
from fzero.lineage import ParamsEditedError
from fzero.cast import cast_params
from distributed import run_ranks
from helpers import grads_like, master_tree, tree_equal
from fzero.models import mlp

MODES = ["fp32", "remainder"]


def engine_and_init(master="fp32", **kw):
    p0 = mlp.init(torch.Generator().manual_seed(0), (8, 16, 4))
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=torch.bfloat16, master=master, **kw)
    return engine, p0, *engine.init(p0)


def bf16_grads(p0, seed):
    return optree.tree_map(lambda g: g.to(torch.bfloat16), grads_like(p0, seed))


@pytest.mark.parametrize("master", MODES)
@pytest.mark.parametrize("edit", ["copy_", "zero_", "flat buffer"])
def test_a_write_into_the_param_views_raises_in_both_master_modes(master, edit):
    """Both modes refuse, where the FP32 master silently undid the write and the remainder mixed
    it into the master (a zeroed leaf became NaN)."""
    engine, p0, params, state, ss = engine_and_init(master)
    params, state, ss, _ = engine.step(params, bf16_grads(p0, 1), state, ss)
    with torch.no_grad():
        if edit == "copy_":
            params["layers"][0]["w"].copy_(torch.ones_like(params["layers"][0]["w"]))
        elif edit == "zero_":
            params["layers"][1]["b"].zero_()
        else:
            engine.flat_params(params)[:3] = 1.0
    before = master_tree(engine, state) if master == "fp32" else state.master.clone()
    with pytest.raises(ParamsEditedError, match=r"engine.step: the params were written in place.*load_params"):
        engine.step(params, bf16_grads(p0, 2), state, ss)
    with pytest.raises(ParamsEditedError, match="checkpoint.save"):
        engine.with_fp32_master(params, state, where="checkpoint.save")
    after = master_tree(engine, state) if master == "fp32" else state.master
    assert tree_equal(before, after)  # nothing was written


@pytest.mark.parametrize("donate", [False, True])
def test_load_params_sets_the_master_exactly_and_keeps_the_moments_in_both_modes(donate):
    """``load_params`` = the master ``init`` would build from the new values, the params its
    cast, Adam's moments and count kept; the two master modes stay bitwise equal after it."""
    new_values = mlp.init(torch.Generator().manual_seed(7), (8, 16, 4))
    out = {}
    for master in MODES:
        engine, p0, params, state, ss = engine_and_init(master, donate=donate)
        for i in range(3):
            params, state, ss, _ = engine.step(params, bf16_grads(p0, i), state, ss)
        moments = copy.deepcopy(state.tx_state)
        params, state = engine.load_params(state, new_values)
        fresh_params, fresh_state, _ = engine.init(new_values)
        assert tree_equal(params, fresh_params)
        assert torch.equal(engine.with_fp32_master(params, state).master,
                           engine.with_fp32_master(fresh_params, fresh_state).master)
        assert tree_equal(state.tx_state, moments)
        for i in range(3, 6):  # steps after it are accepted: the new params are the engine's own
            params, state, ss, _ = engine.step(params, bf16_grads(p0, i), state, ss)
        out[master] = (fzero.flatten(params, engine.layout), engine.with_fp32_master(params, state).master)
    assert torch.equal(out["fp32"][0], out["remainder"][0]) and torch.equal(out["fp32"][1], out["remainder"][1])


def test_params_of_another_step_raise_with_the_remainder_master():
    """With the remainder the master is rebuilt from the params: init's params with the state of
    five steps later gave a wrong master (0.049 off). The FP32 master does not read them."""
    for master in MODES:
        engine, p0, params0, state, ss = engine_and_init(master)
        params = params0
        for i in range(5):
            params, state, ss, _ = engine.step(params, bf16_grads(p0, i), state, ss)
        if master == "remainder":
            with pytest.raises(ValueError, match="checkpoint.save: these params were not written together with this state"):
                engine.with_fp32_master(params0, state, where="checkpoint.save")
            with pytest.raises(ValueError, match="engine.step: these params were not written together"):
                engine.step(params0, bf16_grads(p0, 5), state, ss)
        else:  # the new params come from the master alone
            a = engine.step(params0, bf16_grads(p0, 5), state, ss)
            b = engine.step(params, bf16_grads(p0, 5), state, ss)
            assert tree_equal(a[:2], b[:2])


def test_a_donated_state_used_twice_raises():
    engine, p0, params, state, ss = engine_and_init(donate=True)
    new_params, new_state, new_ss, _ = engine.step(params, bf16_grads(p0, 0), state, ss)
    count = int(new_state.tx_state[0].count)
    with pytest.raises(ValueError, match="donated to an earlier step"):
        engine.step(params, bf16_grads(p0, 1), state, ss)
    assert int(new_state.tx_state[0].count) == count  # nothing counted again
    engine.step(new_params, bf16_grads(p0, 1), new_state, new_ss)  # the returned state steps on


def test_a_clone_or_deepcopy_of_the_state_is_not_refused():
    """Unmarked tensors (a clone) are not checked; a deepcopy keeps the marks, so it pairs with
    the same params: saving or stepping from a kept copy works."""
    engine, p0, params, state, ss = engine_and_init("remainder")
    params, state, ss, _ = engine.step(params, bf16_grads(p0, 0), state, ss)
    for kept in (optree.tree_map(torch.clone, state), copy.deepcopy(state)):
        ref = engine.with_fp32_master(params, state).master
        assert torch.equal(engine.with_fp32_master(params, kept).master, ref)


# ---------------------------------------------------------------- a state a donating step consumed
def donated_net():
    """A donating engine on a small net's params (``fzero.module`` reads them too), one step
    apart: ``(engine, fm, tx, (p0, s0, ss0), (p1, s1, ss1))``; the step to ``s1`` consumed ``s0``."""
    torch.manual_seed(0)
    fm = fzero.module.functional(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    tx = transforms.chain(transforms.clip_by_global_norm(1.0),
                          transforms.adamw(lr=transforms.linear_warmup(0.0, 1e-2, 4), weight_decay=0.1))
    engine = fzero.zero1(tx, param_dtype=torch.bfloat16, donate=True)
    p0, s0, ss0 = engine.init(fm.params)
    p1, s1, ss1, _ = engine.step(p0, bf16_grads(fm.params, 0), s0, ss0)
    return engine, fm, tx, (p0, s0, ss0), (p1, s1, ss1)


# Every public reader of a state: the name its error gives, and the call on (engine, fm, tx,
# params, state, scaler_state, a directory).
READERS = {
    "engine.step": ("engine.step", lambda e, fm, tx, p, s, ss, d: e.step(p, bf16_grads(fm.params, 1), s, ss)),
    "engine.load_params": ("engine.load_params", lambda e, fm, tx, p, s, ss, d: e.load_params(s, fm.params)),
    "engine.with_fp32_master": ("engine.with_fp32_master", lambda e, fm, tx, p, s, ss, d: e.with_fp32_master(p, s)),
    "checkpoint.save": ("checkpoint.save", lambda e, fm, tx, p, s, ss, d: fzero.checkpoint.save(d / "ckpt", p, s, ss, e)),
    "checkpoint.full_master": ("checkpoint.full_master",
                               lambda e, fm, tx, p, s, ss, d: fzero.checkpoint.full_master(p, s, e)),
    "checkpoint.export_full": ("checkpoint.export_full", lambda e, fm, tx, p, s, ss, d: fzero.checkpoint.export_full(
        d / "master.safetensors", s, e, moments=True)),
    "module.state_dict": ("fzero.module state_dict/load_into",
                          lambda e, fm, tx, p, s, ss, d: fm.state_dict(p, fm.buffers, engine=e, state=s)),
    "transforms.get_hyperparams": ("get_hyperparams", lambda e, fm, tx, p, s, ss, d: transforms.get_hyperparams(s, tx)),
    "transforms.iter_hyperparams": ("iter_hyperparams",
                                    lambda e, fm, tx, p, s, ss, d: list(transforms.iter_hyperparams(s))),
    "transforms.set_hyperparams": ("set_hyperparams",
                                   lambda e, fm, tx, p, s, ss, d: transforms.set_hyperparams(s, weight_decay=0.2)),
    "fzero.nonfinite_leaves": ("fzero.nonfinite_leaves", lambda e, fm, tx, p, s, ss, d: fzero.nonfinite_leaves(s)),
}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_state_a_donating_step_consumed(reader, tmp_path):
    """With ``donate=True`` a state kept from an earlier step holds the later step's values: an
    export of it wrote the latest master, ``load_params`` took the live moments. Every reader
    raises, naming itself, ``donate`` and the copy to keep instead; the state the step returned
    reads."""
    where, read = READERS[reader]
    engine, fm, tx, (p0, s0, ss0), (p1, s1, ss1) = donated_net()
    message = rf"{re.escape(where)}: this state was donated to an earlier step \(donate=True\).*copy\.deepcopy"
    with pytest.raises((ValueError, CheckpointError), match=message):
        read(engine, fm, tx, p0, s0, ss0, tmp_path)
    assert not (tmp_path / "master.safetensors").exists() and not (tmp_path / "ckpt").exists()  # nothing written
    read(engine, fm, tx, p1, s1, ss1, tmp_path)


def test_load_params_with_donate_consumes_the_given_state_whose_moments_go_on():
    """The state ``load_params`` returns shares the given one's moments, which a donating step
    then writes: the given state is refused from then on, as a step's is."""
    engine, fm, tx, _, (p1, s1, ss1) = donated_net()
    p2, s2 = engine.load_params(s1, fm.params)
    with pytest.raises(ValueError, match=r"engine.step: this state was donated"):
        engine.step(p1, bf16_grads(fm.params, 1), s1, ss1)
    engine.step(p2, bf16_grads(fm.params, 1), s2, ss1)


def test_a_deepcopy_kept_before_the_next_step_exports_its_own_master(tmp_path):
    """What the error advises for a best-so-far state: ``copy.deepcopy((params, state))`` before
    the next donating step exports the master of its own step, not the latest."""
    safetensors = pytest.importorskip("safetensors.torch")
    engine, fm, tx, _, (params, state, ss) = donated_net()
    kept_params, kept = copy.deepcopy((params, state))
    want = fzero.checkpoint.full_master(kept_params, kept, engine)
    for i in range(1, 3):
        params, state, ss, _ = engine.step(params, bf16_grads(fm.params, i), state, ss)
    fzero.checkpoint.export_full(tmp_path / "best.safetensors", kept, engine)
    got = safetensors.load_file(tmp_path / "best.safetensors")
    latest = fzero.checkpoint.full_master(params, state, engine)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(got["0.weight"], latest["0.weight"])


# ---------------------------------------------------------------- writes no version counter sees
@pytest.mark.parametrize(("param_dtype", "master"), [(torch.bfloat16, "fp32"), (torch.bfloat16, "remainder"),
                                                    (torch.float16, "fp32"), (torch.float32, "fp32"),
                                                    (torch.float32, "params")])
@pytest.mark.parametrize("donate", [False, True])
def test_the_params_are_the_master_cast_after_every_step_in_every_storage_mode(param_dtype, master, donate):
    """What the value check relies on: after ``init``, every step (the skipped one too),
    ``load_params`` with values beyond FP16's and BF16's range, the params are the master cast to
    ``param_dtype`` bit for bit, in every storage mode, so an unedited run never raises."""
    p0 = mlp.init(torch.Generator().manual_seed(0), (8, 16, 4))
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=param_dtype, master=master,
                         donate=donate, loss_scale=None)

    def check(params, state):
        full = lineage.checked_fp32_master(params, state, engine, where="test")
        assert torch.equal(full.master, engine.with_fp32_master(params, state).master)
        cast = fzero.unflatten(cast_params(full.master, param_dtype), engine.layout)
        assert all(torch.equal(a, b) or torch.isnan(a).all() and torch.isnan(b).all()
                   for a, b in zip(optree.tree_leaves(params), optree.tree_leaves(cast)))

    params, state, ss = engine.init(p0)
    check(params, state)
    skipped = []
    for i in range(4):
        grads = optree.tree_map(lambda g: g.to(param_dtype), grads_like(p0, i))
        if i == 2:
            grads["layers"][0]["w"][0, 0] = float("inf")
        params, state, ss, info = engine.step(params, grads, state, ss)
        skipped.append(bool(info["found_inf"]))
        check(params, state)
    assert skipped == [False, False, True, False]
    values = optree.tree_map(torch.clone, p0)
    values["layers"][0]["w"][0, :3] = torch.tensor([1e5, -7e4, 3.3e38])  # FP16 saturates, BF16 (remainder) too
    params, state = engine.load_params(state, values)
    check(params, state)
    params, state, ss, _ = engine.step(params, optree.tree_map(lambda g: g.to(param_dtype), grads_like(p0, 5)), state, ss)
    check(params, state)


def edited_fp16():
    """An FP16 engine after one step: ``(engine, p0, params, state, ss)``."""
    p0 = mlp.init(torch.Generator().manual_seed(0), (8, 16, 4))
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float16, loss_scale=None)
    params, state, ss = engine.init(p0)
    params, state, ss, _ = engine.step(params, optree.tree_map(lambda g: g.half(), grads_like(p0, 0)), state, ss)
    return engine, p0, params, state, ss


def edit_first_weight(params, how):
    """The params the user holds after writing -3.0 into leaf ``layers/0/w`` (``[8, 16]``) where no
    version counter sees it: through ``.data``, through a NumPy view (its first 2 rows), or into
    a clone of the params."""
    if how == ".data":
        params["layers"][0]["w"].data.fill_(-3.0)
    elif how == "numpy":
        params["layers"][0]["w"].numpy()[:2] = -3.0
    else:
        params = optree.tree_map(torch.clone, params)
        params["layers"][0]["w"].fill_(-3.0)
    return params


@pytest.mark.parametrize("edit", [".data", "numpy", "clone"])
def test_a_write_no_version_counter_sees_is_caught_at_export(edit, tmp_path):
    """A write through ``.data``, a NumPy view, or into cloned params was undone by the next step
    (``load_params`` is the way that keeps it). Where the params are read with the state --
    ``full_master`` (and ``fzero.module``'s state_dict), an export of the state with the params
    the engine returned -- it raises, naming the leaf, how many elements differ, and
    ``load_params``; nothing is written. ``load_params`` with the same values is accepted."""
    engine, p0, params, state, ss = edited_fp16()
    edited = edit_first_weight(params, edit)
    count = {".data": 128, "numpy": 32, "clone": 128}[edit]
    message = rf"the params differ from the master.*'layers/0/w' \({count} of 128 elements\).*engine.load_params"
    with pytest.raises(CheckpointError, match="checkpoint.full_master: " + message):
        fzero.checkpoint.full_master(edited, state, engine)
    with pytest.raises(CheckpointError, match="checkpoint.save: " + message):
        fzero.checkpoint.save(tmp_path / "ckpt", edited, state, ss, engine)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("step-*"))
    if edit != "clone":  # the engine's own buffer was written: found from the state alone
        with pytest.raises(CheckpointError, match="checkpoint.export_full: " + message):
            fzero.checkpoint.export_full(tmp_path / "master.safetensors", state, engine)
    else:  # the engine's own params still go with the state
        fzero.checkpoint.export_full(tmp_path / "master.safetensors", state, engine)
        (tmp_path / "master.safetensors").unlink()
    assert not (tmp_path / "master.safetensors").exists()

    params, state = engine.load_params(state, edited)  # the supported way: the written values train on
    assert float(fzero.checkpoint.full_master(params, state, engine)["layers"][0]["w"][0, 0]) == -3.0


def test_a_forward_that_clamps_weight_data_is_caught_at_an_export_after_it():
    """A forward that clamps ``weight.data`` in place (autograd's ``.data``, which no version
    counter sees) is undone by every step; an export (or save) after a forward -- a last
    evaluation -- raises naming the leaf."""
    engine, p0, params, state, ss = edited_fp16()

    def forward(p, x):
        p["layers"][0]["w"].data.clamp_(-0.05, 0.05)
        return mlp.apply(p, x)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).half()
    for _ in range(2):
        leaves = optree.tree_map(lambda t: t.detach().requires_grad_(), params)
        forward(leaves, x).float().square().mean().backward()
        params, state, ss, _ = engine.step(params, optree.tree_map(lambda t: t.grad, leaves), state, ss)
    assert params["layers"][0]["w"].abs().max() > 0.05  # the step undid the clamp
    with torch.no_grad():
        forward(params, x)  # the last evaluation
    with pytest.raises(CheckpointError, match=r"checkpoint.full_master: the params differ.*'layers/0/w' \(\d+ of 128"):
        fzero.checkpoint.full_master(params, state, engine)


def test_what_the_value_check_sees_with_the_remainder_and_params_masters():
    """With ``master="remainder"`` the FP32 master is rebuilt from the params, so a write is
    seen only where it makes the master NaN (a zeroed leaf: the elements with a negative
    remainder); another value is joined with the old remainder, within half a BF16 ulp of it.
    With ``master="params"`` the params are the master: a write is a write into the master."""
    engine, p0, params, state, ss = engine_and_init("remainder")
    params, state, ss, _ = engine.step(params, bf16_grads(p0, 0), state, ss)
    at = engine.layout.offsets[engine.layout.paths.index("layers/0/b")]
    negative = int((state.master[at : at + 16] < 0).sum())  # the int16 remainders below that leaf
    assert negative > 0
    params["layers"][0]["b"].data.zero_()
    with pytest.raises(CheckpointError, match=rf"'layers/0/b' \({negative} of 16 elements\)"):
        fzero.checkpoint.full_master(params, state, engine)
    params["layers"][0]["b"].data.fill_(-3.0)
    got = fzero.checkpoint.full_master(params, state, engine)["layers"][0]["b"]
    assert ((got + 3.0).abs() <= 2.0 ** -7).all() and not (got == -3.0).all()  # half a BF16 ulp at 3 is 2^-7

    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, master="params")
    params, state, ss = engine.init(p0)
    params["layers"][0]["b"].data.fill_(-3.0)
    assert (fzero.checkpoint.full_master(params, state, engine)["layers"][0]["b"] == -3.0).all()


def edit_one_shard(rank, world_size, tmp):
    """Both ranks write leaf ``layers/1/b`` through ``.data``; it lies in rank 1's shard only.
    Returns each rank's error from ``full_master`` and from ``export_full`` of the state."""
    p0 = mlp.init(torch.Generator().manual_seed(0), (8, 16, 4))
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.bfloat16)
    params, state, ss = engine.init(p0)
    params, state, ss, _ = engine.step(params, bf16_grads(p0, rank), state, ss)
    assert engine.layout.owned(1)[0][0] < engine.layout.global_offsets[engine.layout.paths.index("layers/1/b")]
    params["layers"][1]["b"].data.fill_(-3.0)
    errors = []
    for read in (lambda: fzero.checkpoint.full_master(params, state, engine),
                 lambda: fzero.checkpoint.export_full(os.path.join(tmp, "m.safetensors"), state, engine)):
        with pytest.raises(CheckpointError) as e:
            read()
        errors.append(str(e.value))
    return errors, os.path.exists(os.path.join(tmp, "m.safetensors"))


@pytest.mark.multirank
def test_a_write_seen_on_one_rank_raises_on_every_rank(tmp_path):
    """Each rank compares its own shard; the one that finds the write tells the others, and every
    rank raises the same error naming it (none is left waiting in the all-gather)."""
    (errors, written), (errors_1, _) = run_ranks(edit_one_shard, 2, str(tmp_path))
    assert errors == errors_1 and not written
    for error, where in zip(errors, ("checkpoint.full_master", "checkpoint.export_full")):
        assert re.search(rf"^.*: rank 1: ParamsEditedError: {where}: the params differ .* \(rank 1's shard\) in "
                         r"'layers/1/b' \(4 of 4 elements\)", error), error
        assert "rank 0" not in error
