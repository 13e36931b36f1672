"""fzero.plan: what an engine has (``Kernels``) and the plan each step chooses from it
(``choose``): for each configuration, the update's variant (with the fallbacks the fused ones
carry), where it casts the params, how they are gathered, the norm's kernel and the grads' form."""
import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
import fzero.plan
from fzero.cast import IntoBuffer, IntoLeaves, IntoMaster
from helpers import plan_summary as summary, step_plan

# (configuration, (update, cast, gather, norm, grads as Segments)): docs/design.md's table
ROWS = [
    (dict(), ("FusedChunks(256) > Chunks(256)", "NewTensor", "GatherNew(new)", "NativeNorm", True)),
    (dict(native=True), ("Native > FusedChunks(256) > Chunks(256)", "NewTensor", "GatherNew(new)", "NativeNorm", True)),
    (dict(flat_in=False, donate=True), ("FusedChunks(256) > Chunks(256)", "IntoBuffer", "NoGather", "NativeNorm", True)),
    (dict(flat_in=False, donate=True, native=True),
     ("Native > FusedChunks(256) > Chunks(256)", "IntoBuffer", "NoGather", "NativeNorm", True)),
    (dict(flat_in=False, donate=True, views=False),
     ("FusedChunks(256) > Chunks(256)", "NewTensor", "GatherNew(write)", "NativeNorm", True)),
    (dict(world_size=2, donate=True, chunk=128),
     ("FusedChunks(128) > Chunks(128)", "NewTensor", "GatherInto", "NativeNorm", True)),
    (dict(world_size=2, flat_in=False, fused=False, chunk=128),
     ("Chunks(128)", "NewTensor", "GatherNew(new)", "NativeNorm", False)),
    (dict(chunk=None), ("Fused > Whole", "NewTensor", "GatherNew(new)", "NativeNorm", True)),
    (dict(chunk=4096), ("FusedChunks(4096) > Whole", "NewTensor", "GatherNew(new)", "NativeNorm", True)),
    (dict(gpu=True), ("Fused > Whole", "NewTensor", "GatherNew(new)", "RowNorm", True)),
    (dict(gpu=True, fused=False, donate=True), ("Whole", "NewTensor", "GatherNew(write)", "RowNorm", False)),
    (dict(fused=False, low_precision=True, numel=2**20), ("CompiledChunks(256)", "NewTensor", "GatherNew(new)", "NativeNorm", False)),
    (dict(low_precision=True, numel=2**20),
     ("FusedChunks(256) > CompiledChunks(256)", "NewTensor", "GatherNew(new)", "NativeNorm", True)),
    (dict(fused=False, low_precision=True), ("Chunks(256)", "NewTensor", "GatherNew(new)", "NativeNorm", False)),
    (dict(needs_context=True, numel=2**20), ("CompiledWhole", "NewTensor", "GatherNew(new)", "NativeNorm", True)),
    (dict(needs_context=True), ("Whole", "NewTensor", "GatherNew(new)", "NativeNorm", True)),
    (dict(master="params", param_dtype=torch.float32, flat_in=False, donate=True),
     ("FusedChunks(256) > Chunks(256)", "IntoMaster", "NoGather", "NativeNorm", True)),
    (dict(master="remainder", param_dtype=torch.bfloat16, flat_in=False, donate=True, native=True),
     ("Native > FusedChunks(256) > Chunks(256)", "IntoBuffer", "NoGather", "NativeNorm", True)),
    (dict(compiled=True), ("Whole(traced)", "NewTensor", "GatherNew(new)", "RowNorm(traced)", False)),
    (dict(compiled=True, native=True), ("Whole(traced)", "NewTensor", "GatherNew(new)", "RowNorm(traced)", False)),
    (dict(compiled=True, native=True, donate=True), ("Native > Whole(traced)", "IntoBuffer", "NoGather", "RowNorm(traced)", False)),
    (dict(compiled=True, flat_in=False, donate=True), ("Whole(traced)", "NewTensor", "GatherNew(new)", "RowNorm(traced)", False)),
    (dict(compiled=True, flat_in=False, donate=True, param_dtype=torch.float32),
     ("Whole(traced)", "NewTensor", "GatherNew(write)", "RowNorm(traced)", False)),
    (dict(compiled=True, flat_in=False, leaves=True), ("CompiledLeaves", "NewTensor", "GatherNew(new)", "RowNorm(traced)", True)),
    (dict(compiled=True, flat_in=False, leaves=True, donate=True),
     ("CompiledLeaves", "IntoLeaves", "NoGather", "RowNorm(traced)", True)),
    (dict(compiled=True, flat_in=False, leaves=True, donate=True, native=True),
     ("CompiledLeaves", "IntoLeaves", "NoGather", "RowNorm(traced)", True)),
    (dict(compiled=True, flat_in=False, leaves=True, donate=True, native=True, native_leaves=True),
     ("Native > CompiledLeaves", "IntoLeaves", "NoGather", "NativeNorm(traced)", True)),
    (dict(compiled=True, flat_in=False, leaves=True, donate=True, native=True, native_leaves=True, master="params",
          param_dtype=torch.float32), ("Native > CompiledLeaves", "IntoMaster", "NoGather", "NativeNorm(traced)", True)),
    (dict(compiled=True, world_size=2, donate=True), ("Whole(traced)", "NewTensor", "GatherInto", "RowNorm(traced)", False)),
    (dict(compiled=True, world_size=2, flat_in=False, donate=True, leaves=True),
     ("Whole(traced)", "NewTensor", "GatherNew(new)", "RowNorm(traced)", False)),
    # overlap_gather: eager steps on ranks leave the gather in flight; compiled ones gather in the graph
    (dict(world_size=2, overlap_gather=True), ("FusedChunks(256) > Whole", "NewTensor", "GatherLaunched(new)",
                                               "NativeNorm", True)),
    (dict(world_size=2, donate=True, overlap_gather=True),
     ("FusedChunks(256) > Whole", "NewTensor", "GatherLaunched(into)", "NativeNorm", True)),
    (dict(world_size=2, flat_in=False, donate=True, overlap_gather=True),
     ("FusedChunks(256) > Whole", "NewTensor", "GatherLaunched(into)", "NativeNorm", True)),
    (dict(compiled=True, world_size=2, donate=True, overlap_gather=True),
     ("Whole(traced)", "NewTensor", "GatherInto", "RowNorm(traced)", False)),
    (dict(overlap_gather=True), ("FusedChunks(256) > Chunks(256)", "NewTensor", "GatherNew(new)", "NativeNorm", True)),
]


@pytest.mark.parametrize("config,want", ROWS, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "default"
                                                   for c, _ in ROWS])
def test_each_configuration_gets_its_plan(config, want):
    assert summary(step_plan(**config)[0]) == want


def test_the_variants_cast_where_the_plan_casts_and_the_buffer_is_the_params_own():
    """Every variant of a plan casts into the plan's one target; the params' own buffer is found
    once (flat: the params; a donated pytree: the buffer its leaves are views of; leaf by leaf,
    traced, the ``[padded, 1]`` view of the first leaf's memory with the leaves and offsets)."""
    plan, params = step_plan(flat_in=False, donate=True, native=True)
    v = plan.update
    while v is not None:
        assert v.target is plan.cast
        v = getattr(v, "fallback", None)
    assert isinstance(plan.cast, IntoBuffer) and plan.cast.buffer.numel() == 384
    assert plan.cast.buffer.untyped_storage().data_ptr() == params["w"].untyped_storage().data_ptr()
    assert plan.params.buffer is plan.cast.buffer
    plan, params = step_plan(flat_in=True, world_size=2, donate=True)
    assert plan.params.buffer is params and plan.gather.buffer is params
    plan, params = step_plan(compiled=True, flat_in=False, leaves=True, donate=True)
    assert isinstance(plan.cast, IntoLeaves) and plan.cast.buffer.shape == (384, 1) and plan.params.buffer is plan.cast.buffer
    assert plan.update.into is plan.cast and plan.cast.offsets == list(fzero.make_layout(params, 1).offsets)
    plan, _ = step_plan(compiled=True, flat_in=False, leaves=True, donate=True, native=True, native_leaves=True,
                        master="params", param_dtype=torch.float32)
    assert isinstance(plan.cast, IntoMaster) and plan.update.check is plan.cast.leaves is plan.update.fallback.into
    # the door looks the buffer up once, eagerly, whatever the plan then does with it: a pure
    # pytree step finds it too; separate tensors have none; traced, storages cannot be read
    plan, params = step_plan(flat_in=False)
    assert plan.params.buffer.untyped_storage().data_ptr() == params["w"].untyped_storage().data_ptr()
    assert plan.params.buffer.shape == (384,) and plan.params.leaves == optree.tree_leaves(params)
    assert step_plan(flat_in=False, views=False)[0].params.buffer is None
    assert step_plan(compiled=True, flat_in=False, donate=True)[0].params.buffer is None


def test_the_plan_is_the_same_under_a_dispatch_mode():
    """A ``TorchDispatchMode`` (a counter, a debugging mode) does not change the path: the eager
    step of BF16 moments on a large CPU shard compiles its chunks with or without one."""
    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    config = dict(fused=False, low_precision=True, numel=2**20)
    with Passthrough():
        under = summary(step_plan(**config)[0])
    assert under == summary(step_plan(**config)[0]) == ROWS[11][1]


def test_tracing_is_asked_of_torch_compile():
    assert not fzero.plan.tracing()
    traced = torch.compile(lambda x: (x + 1, fzero.plan.tracing()), fullgraph=True, backend="eager")(torch.zeros(1))
    assert traced[1] is True
