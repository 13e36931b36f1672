"""The optimizers of docs/optimizers.md through fzero's engine: at 2 and 4 ranks (16-element
buckets: shards cut leaves) and on a 2x2 mesh beside another optimizer (``partition``), with a
checkpoint saved on the mesh and loaded by one process, each equals one process fed the ranks'
mean grads; one process's engine equals the transform on the pytree, compiled and eager.
(Each transform's own module tests it against its reference.)"""
from __future__ import annotations

import optree
import pytest
import torch

import fzero
from fzero import transforms
from helpers import (
    assert_engine_equals_transform_compiled_or_not, assert_sharded_runs_equal_one_process, matrices, mean_grads_run,
    odd_params, resumed_rank_run, SHARDED_STEPS, sharded_rank_run, tree_assert_close,
)

SCHEDULE = transforms.warmup_cosine_decay(0.0, 3e-3, 2, 6)  # lr 0 at the first step: only the state moves


def clipped(tx):
    return transforms.chain(transforms.clip_by_global_norm(1.0), tx)


def lion():
    return clipped(transforms.lion(SCHEDULE, weight_decay=0.3, weight_decay_mask=matrices))


def ademamix():
    return clipped(transforms.ademamix(SCHEDULE, betas=(0.9, 0.99, 0.95), weight_decay=0.3, weight_decay_mask=matrices))


def lamb():
    return clipped(transforms.lamb(SCHEDULE, betas=(0.9, 0.99), weight_decay=0.3, weight_decay_mask=matrices))


def schedule_free():
    return clipped(transforms.schedule_free_adamw(1e-2, 2, (0.9, 0.99), weight_decay=0.3, weight_decay_mask=matrices))


def adafactor():
    return clipped(transforms.adafactor(SCHEDULE, weight_decay=0.3))


def split(matrices_tx, rest_tx):
    """``matrices_tx`` on the matrices, ``rest_tx`` on the other leaves, clipped."""
    labels = lambda p: optree.tree_map(lambda x: "matrices" if x.ndim > 1 else "rest", p)  # noqa: E731
    return clipped(transforms.partition({"matrices": matrices_tx, "rest": rest_tx}, labels))


def lion_beside_adamw():
    return split(transforms.lion(SCHEDULE, weight_decay=0.3), transforms.adamw(1e-2))


def ademamix_beside_lion():
    return split(transforms.ademamix(SCHEDULE, weight_decay=0.3), transforms.lion(1e-3))


def lamb_beside_ademamix():
    """LAMB's norms then come from a group's compacted elements."""
    return split(transforms.lamb(SCHEDULE, weight_decay=0.3), transforms.ademamix(1e-3))


def schedule_free_beside_lamb():
    return split(transforms.schedule_free_adamw(1e-2, weight_decay=0.3), transforms.lamb(1e-3))


def adafactor_beside_lion():
    """Adafactor on the matrices only: every element of its group factored."""
    return split(transforms.adafactor(SCHEDULE, weight_decay=0.3), transforms.lion(1e-3))


def lamb_beside_adafactor():
    """Adafactor on the vectors only: none factored."""
    return split(transforms.lamb(SCHEDULE, weight_decay=0.3), transforms.adafactor(1e-2))


TRANSFORMS = [lion, ademamix, lamb, schedule_free, adafactor]


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("make_tx", TRANSFORMS, ids=lambda f: f.__name__)
def test_through_the_engine_ranks_equal_one_process_on_the_mean_grads(make_tx, world_size):
    assert_sharded_runs_equal_one_process(make_tx, world_size)


@pytest.mark.parametrize("make_tx", TRANSFORMS, ids=lambda f: f.__name__)
def test_one_rank_engine_equals_the_transform_and_compiled_equals_eager(make_tx):
    assert_engine_equals_transform_compiled_or_not(make_tx)


@pytest.mark.multirank
@pytest.mark.parametrize("make_tx", [lion_beside_adamw, ademamix_beside_lion, lamb_beside_ademamix, schedule_free_beside_lamb,
                                     adafactor, adafactor_beside_lion, lamb_beside_adafactor], ids=lambda f: f.__name__)
def test_on_a_mesh_with_partition_and_a_checkpoint_loaded_at_one_rank_it_trains_as_one_process(make_tx, tmp_path):
    assert_sharded_runs_equal_one_process(make_tx, 4, tmp_path)


@pytest.mark.multirank
def test_adafactors_statistics_saved_by_the_first_of_two_ranks_load_whole_on_each_of_three(tmp_path):
    """The matrices' statistics every rank holds alike are stored once, in the first rank's file;
    every rank of another world size reads them from it, the last of 3 ranks too, whose elements
    all lie in the other file. Equals one process fed the 2, then the 3 ranks' mean grads."""
    from distributed import run_ranks
    path = str(tmp_path / "ckpt")
    run_ranks(sharded_rank_run, 2, adafactor, path)  # saved after step 3
    got = run_ranks(resumed_rank_run, 3, adafactor, path)
    engine = fzero.zero1(adafactor(), param_dtype=torch.float32, loss_scale=None)
    start = (engine, *mean_grads_run(adafactor, 2, (engine, *engine.init(odd_params())), range(3), carry=True))
    want = mean_grads_run(adafactor, 3, start, range(3, SHARDED_STEPS))
    for r in got:
        tree_assert_close(r["params"], want, rtol=1e-6, atol=1e-7)
