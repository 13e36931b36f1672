"""Reading at any world size (fzero.checkpoint.reshard): the reading plan, and the optimizer's
configuration on load (hyperparameters from the engine or the checkpoint)."""
import json
import os
import warnings

import optree
import pytest
import torch

import fzero
from fzero import transforms
from fzero import checkpoint as ck
from fzero.checkpoint import reshard
from helpers import assert_views_equal, ckpt_fresh_engine, ckpt_params, ckpt_steps, global_view, snapshot_dir


@pytest.mark.parametrize("old_n,new_n", [(2, 3), (3, 1), (1, 4), (4, 2)])
def test_each_rank_reads_exactly_its_real_elements(old_n, new_n):
    """Resharding plan only: rank r of the new world reads, over all old files, exactly the
    elements it owns (no padding, nothing twice), each into its own place in the shard."""
    p = ckpt_params()
    glob_vec = torch.cat([x.reshape(-1) for x in optree.tree_leaves(p)])
    old = fzero.make_layout(p, old_n, alignment=8, bucket_numel=40)  # reversed buckets: many segments
    new = fzero.make_layout(p, new_n, alignment=64)
    old_segments = [old.owned(r) for r in range(old_n)]
    files = [{"segments": [[g0, g1] for g0, g1, _ in segs]} for segs in old_segments]
    new_segments = [new.owned(r) for r in range(new_n)]
    for r in range(new_n):
        shard = torch.zeros(new.shard_numel)
        hit = torch.zeros(new.shard_numel, dtype=torch.int32)
        for entry, segs in zip(files, old_segments):
            data = torch.cat([glob_vec[g0:g1] for g0, g1, _ in segs]) if segs else torch.zeros(0)
            for fpos, spos, m in reshard.overlaps(entry["segments"], new_segments[r]):
                shard[spos : spos + m] = data[fpos : fpos + m]
                hit[spos : spos + m] += 1
        assert torch.equal(shard, fzero.tree_shard(p, new, r, dtype=torch.float32))
        real = sum(g1 - g0 for g0, g1, _ in new_segments[r])
        assert int(hit.sum()) == real and int(hit.max()) <= 1
    # each file is hashed by the new rank that reads most of it (page cache), ties to the lowest
    for j, (entry, owner) in enumerate(zip(files, reshard.verifiers(files, new_segments))):
        seen = [sum(m for *_, m in reshard.overlaps(entry["segments"], segs)) for segs in new_segments]
        assert owner == (seen.index(max(seen)) if max(seen) else j % new_n)


def constant_lr_engine(lr=1e-3, weight_decay=0.1, **kw):
    tx = transforms.adamw(lr=lr, weight_decay=weight_decay, **kw)
    return fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(init_scale=16.0))


def test_load_keeps_the_engines_hyperparameters_and_warns_about_each_difference(saved):
    path, engine, params, state, ss = saved  # weight decay 0.1
    tx = transforms.adamw(lr=transforms.linear_warmup(1e-3, 1e-2, 3), weight_decay=0.5, betas=(0.8, 0.999),
                          weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p))
    other = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(init_scale=16.0))
    other.init(ckpt_params(seed=1))
    with pytest.warns(UserWarning) as record:
        _, s2, ss2, _ = ck.load(path, other)
    assert len(record) == 1
    msg = str(record[0].message)
    assert "tx_state/1/inner/weight_decay: checkpoint 0.1, engine 0.5" in msg
    assert "tx_state/0/b1: checkpoint 0.9, engine 0.8" in msg and "b2" not in msg and 'hyperparams="checkpoint"' in msg
    got = transforms.get_hyperparams(s2)
    assert float(got["weight_decay"]) == 0.5 and float(got["b1"]) == 0.8 and float(got["b2"]) == 0.999
    # everything else comes from the checkpoint
    view, saved_view = global_view(other, s2, ss2), global_view(engine, state, ss)
    for name in ("tx_state/1/inner/weight_decay", "tx_state/0/b1"):
        del view[name], saved_view[name]
    assert_views_equal(view, saved_view)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, s3, _, _ = ck.load(path, other, hyperparams="checkpoint")
    assert float(transforms.get_hyperparams(s3)["weight_decay"]) == 0.1 and float(transforms.get_hyperparams(s3)["b1"]) == 0.9
    with pytest.raises(ValueError, match="hyperparams must be one of"):
        ck.load(path, other, hyperparams="saved")


def test_hyperparams_checkpoint_restores_values_set_during_training(tmp_path):
    path = str(tmp_path / "ckpt")
    engine = constant_lr_engine()
    params, state, ss = engine.init(ckpt_params())
    params, state, ss = ckpt_steps(engine, params, state, ss, range(2))
    state = transforms.set_hyperparams(state, lr=2.5e-4)  # e.g. lowered by hand mid-run
    ck.save(path, params, state, ss, engine)

    fresh = constant_lr_engine()
    fresh.init(ckpt_params(seed=1))
    _, s2, _, _ = ck.load(path, fresh, hyperparams="checkpoint")
    assert float(transforms.get_hyperparams(s2)["lr"]) == 2.5e-4
    with pytest.warns(UserWarning, match=r"tx_state/2/lr: checkpoint 0\.00025, engine 0\.001"):
        _, s3, _, _ = ck.load(path, fresh)
    assert float(transforms.get_hyperparams(s3)["lr"]) == 1e-3
    assert int(s3.tx_state[0].count) == int(state.tx_state[0].count) == 1  # step CKPT_BAD_STEP was skipped


def test_no_warning_when_the_hyperparameters_agree(saved):
    path, *_ = saved
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load(path, ckpt_fresh_engine())
    assert [str(w.message) for w in caught] == []



@pytest.mark.parametrize("hyperparams", ["engine", "checkpoint"])
def test_a_scheduled_lr_is_never_stored_and_follows_the_engines_schedule_after_a_load(saved, hyperparams):
    """A scheduled lr is no hyperparameter of the checkpoint: the manifest holds the schedule's
    count and no lr, a load warns about no lr, and the loaded state shows the loading engine's
    schedule at the saved count (``get_hyperparams`` with its transform), with either ``hyperparams``."""
    path, engine, params, state, ss = saved
    with open(os.path.join(snapshot_dir(path), "manifest.json")) as f:
        names = [e["name"] for e in json.load(f)["state"]]
    assert "tx_state/2/count" in names and not [n for n in names if n.endswith("lr")]
    other_schedule = transforms.linear_warmup(2e-3, 2e-2, 3)
    tx = transforms.adamw(lr=other_schedule, weight_decay=0.1,
                          weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p))
    other = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(init_scale=16.0, growth_interval=2))
    other.init(ckpt_params(seed=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, s2, _, _ = ck.load(path, other, hyperparams=hyperparams)
    count = state.tx_state[2].count
    assert int(count) == 2  # 3 steps, one skipped
    assert torch.equal(transforms.get_hyperparams(state.tx_state, engine.tx)["lr"], transforms.linear_warmup(1e-3, 1e-2, 3)(count))
    assert torch.equal(s2.tx_state[2].count, count)
    assert torch.equal(transforms.get_hyperparams(s2.tx_state, other.tx)["lr"], other_schedule(count))


@pytest.mark.parametrize("hyperparams", ["engine", "checkpoint"])
def test_a_loaded_state_keeps_the_fused_adamw_path(saved, hyperparams, monkeypatch):
    """Loaded hyperparameters carry their host values, so the eager step still runs torch's
    fused kernel (no device read for b1, b2, eps)."""
    path, engine, params, state, ss = saved
    calls, kernel = [], torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), kernel(*a, **k))[1])
    fresh = ckpt_fresh_engine()
    p, s, sc, _ = ck.load(path, fresh, hyperparams=hyperparams)
    assert all(transforms.host_value(t) is not None for _, t in transforms.iter_hyperparams(s.tx_state))
    ckpt_steps(fresh, p, s, sc, [7])
    assert calls == [1]
