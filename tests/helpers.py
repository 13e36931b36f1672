"""Helpers shared by the test modules: reference pytrees, reference optimizers, comparisons."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import unittest.mock
from pathlib import Path

import numpy as np
import optree
import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch._inductor.utils
import torch.utils._python_dispatch

import fzero
import fzero.comm
import fzero.params_form
import fzero.plan
import fzero.update
from fzero import transforms
from fzero import checkpoint as ck
from fzero.checkpoint import commit, lock
from distributed import require_tier

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TRAIN = EXAMPLES / "train.py"


def load_train_module():
    """examples/train.py as the module ``train`` (pyproject.toml puts examples/ on pytest's
    sys.path; spawned ranks inherit it)."""
    return importlib.import_module("train")


def run_script(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)`` of an example or a benchmark, as its users run it: a
    test of the e2e tier (tests/conftest.py)."""
    require_tier("e2e", "runs a script")
    return subprocess.run(cmd, **kwargs)


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The directory ``name``, made by ``make(directory)`` once per test session and shared by
    every pytest-xdist worker (a session- or module-scoped fixture alone is made once per worker
    that runs a test using it): the first caller makes it while it holds an exclusive ``flock``,
    the others wait on that lock -- as long as ``make`` runs, which bounds its own subprocesses'
    time; the kernel drops the lock however the maker ends -- and reuse it. After a ``make`` that
    raised, the next caller makes it afresh. Callers only read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above the worker's own
    path, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # dropped when the file closes
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            done.touch()
    return path


def counting_comm(calls: list) -> fzero.comm.Comm:
    """The default group's ``Comm`` whose tensor collectives append ``(name, bytes of the
    input)`` to ``calls`` when they are issued eagerly (traced, a count would run once, at
    compile time), through the public table of collectives."""
    def counting(name, fn):
        def call(x, *args):
            if not torch.compiler.is_compiling():
                calls.append((name, x.numel() * x.element_size()))
            return fn(x, *args)
        return call

    return fzero.comm.Comm.of(None, collectives=fzero.comm.FUNCTIONAL.wrapped(counting))


def odd_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g),
        "blocks": [{"g": torch.randn(13, generator=g)}, {"g": torch.randn(3, 1, 2, generator=g)}],
        "one": torch.randn(1, generator=g),
    }


def ready_engine():
    """An AdamW engine on ``odd_params`` in FP16, initialized: ``(engine, params, state,
    scaler_state, grads)`` with FP16 grads like the params."""
    p0 = odd_params()
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)
    params, state, ss = engine.init(p0)
    return engine, params, state, ss, optree.tree_map(lambda g: g.half(), grads_like(p0, 0))


def grads_like(params, seed, scale=1.0):
    g = torch.Generator().manual_seed(1000 + seed)
    return optree.tree_map(lambda p: torch.randn(p.shape, generator=g) * scale, params)


def grads_seq(p0, dtype, scale, n=5, bad_step=2):
    """``n`` grads pytrees like ``p0`` (``odd_params``) times ``scale`` in ``dtype``, the one at
    ``bad_step`` with an inf in leaf ``w``."""
    seq = []
    for i in range(n):
        g = optree.tree_map(lambda x: (x * scale).to(dtype), grads_like(p0, i))
        if i == bad_step:
            g["w"][1, 1] = float("inf")
        seq.append(g)
    return seq


def master_tx():
    """The transform the master-storage tests train with: clipping, AdamW with decay on matrices."""
    return transforms.chain(transforms.clip_by_global_norm(0.5),
                            transforms.adamw(lr=1e-2, weight_decay=0.1,
                                             weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p)))


def train_with_master(master, param_dtype, *, steps, bad_step, compiled=False, donate=False, rank=0, engine_kw=None):
    """``steps`` steps of ``master_tx`` on ``odd_params`` in ``param_dtype`` with ``zero1(master=
    master)``, the grads of step ``s`` those of seed ``10 * s + rank`` times 3, one of them inf at
    ``bad_step`` (a skipped step): ``(engine, params, state, history, scaler_state)``, ``history``
    the flat params and ``found_inf`` after each step."""
    engine = fzero.zero1(master_tx(), param_dtype=param_dtype, master=master, donate=donate, **(engine_kw or {}))
    params, state, ss = engine.init(odd_params())
    step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
    history = []
    for s in range(steps):
        grads = optree.tree_map(lambda x: (x * 3).to(param_dtype), grads_like(odd_params(), 10 * s + rank))
        if s == bad_step:
            grads["w"][0, 0] = float("inf")
        params, state, ss, info = step(params, grads, state, ss)
        history.append((fzero.flatten(params, engine.layout).clone(), info["found_inf"].clone()))
    return engine, params, state, history, ss


def mean_grads(grads_of_rank, world_size):
    """The mean over ranks ``0..world_size-1`` of ``grads_of_rank(r)`` (pytrees), in float64,
    then FP32: what one process is fed to stand for the ranks' reduce-scatter."""
    return optree.tree_map(lambda *gs: torch.stack(gs).double().mean(0).float(),
                           *[grads_of_rank(r) for r in range(world_size)])


# A transform through fzero's engine against one process fed the mean grads: the checks every
# transform's test module runs (``make_tx`` a module-level factory, so that ranks can import it).
SHARDED_STEPS = 6


def sharded_engine(make_tx, mesh=None):
    """``make_tx()``'s engine for the sharded runs: FP32, 16-element buckets and no alignment
    (shards cut leaves, the matrix mid-row)."""
    return fzero.zero1(make_tx(), param_dtype=torch.float32, loss_scale=None, bucket_bytes=64, alignment=1, mesh=mesh)


def sharded_rank_run(rank, world_size, make_tx, path=None):
    """SHARDED_STEPS steps of ``make_tx()`` through ``sharded_engine`` on ``odd_params``, rank
    ``r``'s grads ``grads_like(p0, 10 * step + r)``: on a 2x2 mesh (``replicate``, ``shard``) when
    ``world_size`` is 4 and ``path`` is given, where a checkpoint is saved after step 3. Returns
    ``{"params": ...}``."""
    mesh = None
    if path is not None and world_size == 4:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    p0 = odd_params()
    engine = sharded_engine(make_tx, mesh)
    params, state, ss = engine.init(p0)
    for step in range(SHARDED_STEPS):
        params, state, ss, _ = engine.step(params, grads_like(p0, 10 * step + rank), state, ss)
        if path is not None and step == 2:
            fzero.checkpoint.save(path, params, state, ss, engine, extra={"step": 3})
    return {"params": params}


def resumed_rank_run(rank, world_size, make_tx, path):
    """``sharded_rank_run``'s steps from step 3 on, from the checkpoint at ``path`` (saved after step
    3, at another world size). Returns ``{"params": ...}``."""
    p0 = odd_params()
    engine = sharded_engine(make_tx)
    engine.init(p0)  # the layout the load needs
    params, state, ss, extra = fzero.checkpoint.load(path, engine)
    assert extra == {"step": 3}
    for step in range(3, SHARDED_STEPS):
        params, state, ss, _ = engine.step(params, grads_like(p0, 10 * step + rank), state, ss)
    return {"params": params}


def mean_grads_run(make_tx, world_size, start=None, steps=range(SHARDED_STEPS), *, carry=False):
    """``sharded_rank_run``'s steps in one process fed the ranks' mean grads: the final params
    (from ``start = (engine, params, state, scaler_state)``, else from ``init``); ``carry``:
    ``(params, state, scaler_state)``."""
    p0 = odd_params()
    if start is None:
        engine = fzero.zero1(make_tx(), param_dtype=torch.float32, loss_scale=None)
        start = (engine, *engine.init(p0))
    engine, params, state, ss = start
    for step in steps:
        params, state, ss, _ = engine.step(params, mean_grads(lambda r: grads_like(p0, 10 * step + r), world_size),
                                           state, ss)
    return (params, state, ss) if carry else params


def assert_sharded_runs_equal_one_process(make_tx, world_size, tmp_path=None):
    """``sharded_rank_run`` on ``world_size`` gloo ranks equals ``mean_grads_run`` (rtol 1e-6);
    with ``tmp_path`` (4 ranks, a 2x2 mesh) so does the mesh's checkpoint loaded by one process
    and run on from step 3."""
    from distributed import run_ranks
    path = None if tmp_path is None else str(tmp_path / "ckpt")
    got = [r["params"] for r in run_ranks(sharded_rank_run, world_size, make_tx, path)]
    want = mean_grads_run(make_tx, world_size)
    if path is not None:
        engine = fzero.zero1(make_tx(), param_dtype=torch.float32, loss_scale=None)
        engine.init(odd_params())  # the layout the load needs
        params, state, ss, extra = fzero.checkpoint.load(path, engine)
        assert extra == {"step": 3}
        got.append(mean_grads_run(make_tx, world_size, (engine, params, state, ss), range(3, SHARDED_STEPS)))
    for params in got:
        tree_assert_close(params, want, rtol=1e-6, atol=1e-7)


def assert_engine_equals_transform_compiled_or_not(make_tx, n=SHARDED_STEPS):
    """One process: the engine's step, eager and ``torch.compile``d, equals the transform run on
    the pytree (``run_tx``) over ``n`` grads like ``odd_params`` (rtol 1e-6)."""
    p0 = odd_params()
    grads = [grads_like(p0, s) for s in range(n)]
    want, _ = run_tx(make_tx(), p0, grads)
    for compiled in (False, True):
        engine = fzero.zero1(make_tx(), param_dtype=torch.float32, loss_scale=None)
        params, state, ss = engine.init(p0)
        step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
        for g in grads:
            params, state, ss, _ = step(params, g, state, ss)
        tree_assert_close(params, want, rtol=1e-6, atol=1e-7)


def matrices(p):
    """A weight-decay mask: the leaves with more than one dimension."""
    return optree.tree_map(lambda x: x.ndim > 1, p)


def optax_run(make_optax, params, grads, lr):
    """``make_optax(optax, lr)``'s optimizer (optax run live, JAX on the CPU) on ``params`` and
    ``grads`` (pytrees of FP32 tensors): ``(params, state)`` as numpy, the state as optax keeps
    it. ``lr``: a float or one of fzero's schedules (given to optax as a function of its count).
    Skipped without JAX and optax (``pip install -e '.[reference]'``)."""
    jnp = pytest.importorskip("jax.numpy", reason="optax's reference needs JAX (pip install jax optax)")
    optax = pytest.importorskip("optax", reason="the reference is optax's (pip install optax)")
    to_j = lambda t: optree.tree_map(lambda x: jnp.asarray(x.numpy()), t)  # noqa: E731
    if callable(lr):
        schedule = lr
        lr = lambda count: float(schedule(torch.tensor(int(count), dtype=torch.int32)))  # noqa: E731
    opt = make_optax(optax, lr)
    p = to_j(params)
    state = opt.init(p)
    for g in grads:
        updates, state = opt.update(to_j(g), state, p)
        p = optax.apply_updates(p, updates)
    return optree.tree_map(np.asarray, p), optree.tree_map(np.asarray, state)


def torch_adamw(params, grads_list, **kw):
    return torch_optimizer(torch.optim.AdamW, params, grads_list, **kw)


def torch_optimizer(optimizer, params, grads_list, **kw):
    """``params`` (a pytree) after one ``optimizer(**kw)`` step per grads pytree of ``grads_list``."""
    leaves, spec = optree.tree_flatten(params)
    ps = [torch.nn.Parameter(p.clone()) for p in leaves]
    opt = optimizer(ps, **kw)
    for grads in grads_list:
        for p, g in zip(ps, spec.flatten_up_to(grads)):
            p.grad = g.clone()
        opt.step()
    return spec.unflatten([p.detach() for p in ps])


def tree_assert_close(a, b, **kw):
    """Leaf by leaf ``torch.testing.assert_close``; ``b``'s leaves may be numpy arrays (a
    reference's output) or float64 tensors (compared in float64)."""
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True):
        y = y if isinstance(y, torch.Tensor) else torch.tensor(y)
        torch.testing.assert_close(x.double() if y.dtype == torch.float64 else x, y, **kw)


def assert_compiled_state_close(got, want):
    """A transform state from a compiled update against the eager one's: float leaves to rounding
    (rtol 1e-5, atol 1e-7); 8-bit codes at most one level apart, and that rarely (under 1%)."""
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        if a.dtype in (torch.int8, torch.uint8):
            diff = (a.int() - b.int()).abs()
            assert diff.max() <= 1 and diff.float().mean() < 0.01
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def compiled_buffers(fn, *args) -> tuple[object, list[tuple[int, str]]]:
    """``fn(*args)`` (a first call of a ``torch.compile``d function) and the 1-d buffers that
    inductor's generated code allocates for it, as ``(numel, dtype name)``: what a compiled step
    holds besides its inputs and outputs' own buffers."""
    out, codes = torch._inductor.utils.run_and_get_code(fn, *args)
    assert codes, "inductor generated no code (was fn compiled, and compiled afresh?)"
    found = re.findall(r"empty_strided\w*\(\((\d+), \), \(1, \), torch\.(\w+)\)", "\n".join(codes))
    return out, [(int(n), dtype) for n, dtype in found]


def tree_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def master_tree(engine, state):
    """The FP32 master as a pytree (world size 1: the shard is the whole buffer)."""
    return fzero.unflatten(state.master, engine.layout)


def run_tx(tx, params, seq):
    state = tx.init(params)
    p = params
    for grads in seq:
        updates, state = tx.update(grads, state, p)
        p = transforms.apply_updates(p, updates)
    return p, state


def reference(policy, found):
    """The loss-scale rule ``fzero.scaler`` documents, in plain Python."""
    scale, good, hyst = policy.init_scale, 0, policy.hysteresis
    out = []
    for inf in found:
        if inf:
            good = 0
            hyst = max(hyst - 1, 0)
            if hyst == 0:
                scale = max(scale * policy.backoff_factor, policy.min_scale)
        else:
            good += 1
            if good == policy.growth_interval:
                good, hyst = 0, policy.hysteresis
                scale = min(scale * policy.growth_factor, policy.max_scale)
        out.append((scale, good, hyst))
    return out


# the collective a table entry issues, where its name says more (fzero.comm.Collectives)
COLLECTIVE_OF = {"reduce_scatter_donated": "reduce_scatter", "all_gather_into": "all_gather"}


@dataclasses.dataclass(frozen=True)
class RecordingComm(fzero.comm.Comm):
    """A real communicator (``RecordingComm.of(group)``, then ``zero1(group=...)``) that logs
    every collective it runs across ranks as ``(name, bytes)``: ``"reduce_scatter"`` (input
    bytes), ``"all_gather"`` (output bytes), ``"all_reduce"``, and ``"wait"`` (0) for each wait
    on an in-flight collective."""

    events: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def _log(self, name: str, x: torch.Tensor) -> None:
        if self.world_size > 1:
            self.events.append((name, x.numel() * x.element_size()))

    def reduce_scatter_bucket(self, x, i, layout, *, wait=True, donated=False, dtype=None):
        self._log("reduce_scatter", x)
        return super().reduce_scatter_bucket(x, i, layout, wait=wait, donated=donated, dtype=dtype)

    def all_gather_bucket(self, x, i, layout):
        y = super().all_gather_bucket(x, i, layout)
        self._log("all_gather", y)
        return y

    def all_gather_bucket_into(self, out, x, i, layout):
        y = super().all_gather_bucket_into(out, x, i, layout)
        self._log("all_gather", y)
        return y

    def all_reduce_sum(self, x, what="the grad norm and found_inf"):
        self._log("all_reduce", x)
        return super().all_reduce_sum(x, what)

    def wait(self, x, what="collective"):
        if isinstance(x, funcol.AsyncCollectiveTensor):
            self.events.append(("wait", 0))
        return super().wait(x, what)

    def counts(self) -> dict[str, list[int]]:
        """``{name: [calls, bytes]}`` of the collectives logged so far."""
        out = {"reduce_scatter": [0, 0], "all_gather": [0, 0], "all_reduce": [0, 0]}
        for name, nbytes in self.events:
            if name in out:
                out[name][0] += 1
                out[name][1] += nbytes
        return out


@dataclasses.dataclass(frozen=True)
class RecordingHybridComm(fzero.comm.HybridComm):
    """A real hybrid communicator (``RecordingHybridComm.of_mesh(mesh)``, then
    ``zero1(group=...)``) that logs every tensor collective it issues as ``(name, group,
    bytes)``: name ``"reduce_scatter"``/``"all_gather"``/``"all_reduce"``/``"broadcast"``,
    group ``"shard"`` or ``"replicate"``, bytes of the input tensor."""

    events: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of_mesh(cls, mesh, *, collectives=fzero.comm.FUNCTIONAL):
        comm = super().of_mesh(mesh, collectives=collectives)

        def logged(name, fn):
            def call(x, *args):  # the group's name is the last argument of every collective
                group = "shard" if args[-1] == comm.group else "replicate"
                comm.events.append((COLLECTIVE_OF.get(name, name), group, x.numel() * x.element_size()))
                return fn(x, *args)
            return call

        return dataclasses.replace(comm, collectives=collectives.wrapped(logged))

    def counts(self) -> dict[tuple[str, str], list[int]]:
        """``{(name, group): [calls, bytes]}`` of the collectives logged so far."""
        out: dict[tuple[str, str], list[int]] = {}
        for name, group, nbytes in self.events:
            c = out.setdefault((name, group), [0, 0])
            c[0] += 1
            c[1] += nbytes
        return out


WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


class NewTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of every tensor an aten op creates (views excluded): what a
    step allocates."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rets = func._schema.returns
        # not a view, not in place, not a collective's wait (it returns the tensor it waited for)
        if not (rets and all(r.alias_info is not None for r in rets)) and func is not WAIT_TENSOR:
            self.numels += [t.numel() for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@contextlib.contextmanager
def forbid_host_syncs():
    """Make every Tensor -> Python conversion raise while the block runs."""
    names = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def trap(name):
        def f(self, *a, **k):
            raise AssertionError(f"host sync: Tensor.{name} called inside the step")
        return f

    for n in names:
        setattr(torch.Tensor, n, trap(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


# ------------------------------------------------------------------------ checkpoints (tests/test_checkpoint*.py)
# A model with odd leaf sizes, its engine and training (the ``saved`` fixture of conftest.py
# saves it), and views of a checkpoint's state and files.

CKPT_BAD_STEP = 1  # every rank sees an inf at this step: skipped, and the loss scale backs off


def ckpt_params(seed=0, z_shape=(17, 23)):
    """Odd sizes: P = 55 + 391 = 446, so shards split leaves at every world size."""
    p = odd_params(seed)
    p["z"] = torch.randn(*z_shape, generator=torch.Generator().manual_seed(100 + seed))
    return p


def ckpt_engine(moments=None, **kw):
    """The checkpoint tests' engine: adamw with a schedule and a weight-decay mask (a bool [S]
    leaf), its moments stored as ``moments`` (``mu_dtype`` and ``nu_dtype``), FP16 params with a
    dynamic loss scale; ``kw`` goes to ``zero1``."""
    tx = transforms.adamw(
        lr=transforms.linear_warmup(1e-3, 1e-2, 3),
        weight_decay=0.1,
        weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p),  # a bool [S] leaf
        mu_dtype=moments, nu_dtype=moments,
    )
    scale = fzero.DynamicLossScale(init_scale=16.0, growth_interval=2)
    return fzero.zero1(tx, param_dtype=torch.float16, loss_scale=scale, **kw)


def ckpt_steps(engine, params, state, ss, steps):
    """Grads that do not depend on the rank or world size, so every world size trains alike (on
    the state's device)."""
    p0 = ckpt_params()
    for step in steps:
        grads = optree.tree_map(lambda g: (g.to(ss.scale.device) * ss.scale).to(torch.float16), grads_like(p0, step))
        if step == CKPT_BAD_STEP:
            grads["w"][0, 0] = float("inf")
        params, state, ss, _ = engine.step(params, grads, state, ss)
    return params, state, ss


def ckpt_trained(engine, steps, seed=0):
    """``engine.init(ckpt_params(seed))``, then ``steps`` steps of ``ckpt_steps``."""
    params, state, ss = engine.init(ckpt_params(seed))
    return ckpt_steps(engine, params, state, ss, range(steps))


def ckpt_fresh_engine(**kw):
    """A ``ckpt_engine`` init-ed with other params than ``saved``'s: what a load must overwrite."""
    engine = ckpt_engine(**kw)
    engine.init(ckpt_params(seed=1))
    return engine


def ckpt_paths_shapes():
    """The leaf paths and shapes of ``ckpt_params``, in tree order."""
    layout = fzero.make_layout(ckpt_params(), 1)
    return list(layout.paths), list(layout.shapes)


def global_view(engine, state, ss):
    """Every state leaf as the global [P] vector (real elements, tree order) or 0-d value."""
    names, leaves, _ = transforms.tree.leaf_paths(state)
    out = {}
    for name, leaf in zip(names, leaves):
        if leaf.ndim == 0:
            out[name] = leaf.clone()
            continue
        flat = engine.comm.all_gather(leaf.float() if leaf.dtype == torch.bool else leaf, engine.layout)
        full = torch.cat([x.reshape(-1) for x in optree.tree_leaves(fzero.unflatten(flat, engine.layout))])
        out[name] = full.bool() if leaf.dtype == torch.bool else full.clone()
    for name, v in zip(type(ss)._fields, ss):
        out["scaler/" + name] = v.clone()
    return out


def assert_views_equal(a, b):
    """Two ``global_view``s are bitwise equal, leaf by leaf."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def snapshot_dir(path):
    """The snapshot directory the checkpoint at ``path`` points to."""
    with open(os.path.join(path, commit.POINTER)) as f:
        return os.path.join(path, json.load(f)["snapshot"])


def ckpt_entries(path):
    """``path``'s listing, with each snapshot name shown as ``snapshot-*``."""
    return sorted(re.sub(r"^snapshot-[0-9a-f]{32}$", "snapshot-*", name) for name in os.listdir(path))


CKPT_ONE = sorted([commit.POINTER, commit.MARKER, lock.LOCK, "snapshot-*"])  # after the first save


CKPT_COMMITTED = sorted(CKPT_ONE + ["snapshot-*"])  # after two saves or more


def unwritable_dir(tmp_path) -> str:
    """A directory in which this process cannot create anything: ``tmp_path/ro`` made read-only,
    or, for root (whom file modes do not stop), ``/sys`` (sysfs refuses every ``mkdir``)."""
    if os.geteuid() == 0:
        return "/sys"
    ro = os.path.join(tmp_path, "ro")
    os.mkdir(ro, 0o555)
    return ro


def flip_byte(file, from_end=5):
    """Invert the byte ``from_end`` bytes before the end of ``file`` (in a shard: tensor data)."""
    with open(file, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def file_contents(path):
    """Every file under ``path`` (hidden ones too) and its bytes."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            with open(file, "rb") as f:
                out[os.path.relpath(file, path)] = f.read()
    return out


def edit_manifest(path, edit):
    """Rewrite the current manifest's text with ``edit(text)`` and put its sha256 in the pointer,
    so that only the validation of its values can catch the change."""
    file = os.path.join(snapshot_dir(path), "manifest.json")
    with open(file) as f:
        text = edit(f.read())
    with open(file, "w") as f:
        f.write(text)
    pointer = os.path.join(path, commit.POINTER)
    with open(pointer) as f:
        p = json.load(f)
    p["manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    with open(pointer, "w") as f:
        json.dump(p, f)


def tagged(params, state, ss, tag):
    """``(params, state, ss)`` with every part saying ``tag``: params, master and moments filled
    with it (the params the master's cast, as a save checks: a small integer is exact in any
    dtype), both counts equal to it, weight decay ``tag / 100``, loss scale ``tag + 1``."""
    adam, decay, sched = state.tx_state
    count = torch.tensor(tag, dtype=torch.int32)
    adam = adam._replace(count=count, mu=torch.full_like(adam.mu, tag), nu=torch.full_like(adam.nu, tag))
    decay = decay._replace(inner=decay.inner._replace(weight_decay=torch.tensor(tag / 100, dtype=torch.float64)))
    state = fzero.ZeroState(torch.full_like(state.master, tag), (adam, decay, sched._replace(count=count)))
    return optree.tree_map(lambda p: torch.full_like(p, tag), params), state, ss._replace(scale=torch.tensor(tag + 1.0))


def mixed_parts(engine, state, ss, extra):
    """The parts of a loaded checkpoint that do not say ``extra["tag"]`` (empty: consistent)."""
    tag = extra["tag"]
    real = torch.zeros(engine.layout.shard_numel, dtype=torch.bool)  # padding is not stored: zero
    for g0, g1, pos in engine.layout.owned(engine.comm.rank):
        real[pos : pos + g1 - g0] = True
    adam, decay, sched = state.tx_state
    checks = {
        "master": bool((state.master[real] == tag).all()),
        "mu": bool((adam.mu[real] == tag).all()),
        "nu": bool((adam.nu[real] == tag).all()),
        "count": int(adam.count) == tag,
        "schedule count": int(sched.count) == tag,
        "weight_decay": float(decay.inner.weight_decay) == tag / 100,
        "loss scale": float(ss.scale) == tag + 1,
    }
    return [name for name, ok in checks.items() if not ok]


# ---------------------------------------------------------------- step plans (fzero.plan)
PLAN_SHAPES = {"w": (40, 8), "b": (8,)}  # 328 elements, 384 laid out


def step_plan(*, world_size=1, flat_in=True, donate=False, compiled=False, gpu=False, fused=True, native=False,
              native_leaves=False, leaves=False, needs_context=False, low_precision=False, master="fp32",
              chunk=256, numel=None, param_dtype=torch.float16, views=True, overlap_gather=False):
    """The plan ``choose`` gives an engine of this configuration on params laid out from
    ``PLAN_SHAPES`` (``flat_in``: the flat buffer; else a pytree of views of it, or with ``views=False``
    of separate tensors); ``gpu``: state and grads on a GPU (a device that is only named)."""
    tree = {k: torch.zeros(s, dtype=param_dtype) for k, s in PLAN_SHAPES.items()}
    layout = fzero.make_layout(tree, world_size)
    buffer = torch.zeros(layout.padded_numel, dtype=param_dtype)
    params = buffer if flat_in else fzero.unflatten(buffer, layout) if views else tree
    device = torch.device("cuda" if gpu else "cpu")
    k = fzero.plan.Kernels(param_dtype=param_dtype, donate=donate, world_size=world_size,
                numel=layout.shard_numel if numel is None else numel, state_device=device,
                chunk=None if gpu else chunk, fused=fused, needs_context=needs_context, low_precision=low_precision,
                master_in_params=master == "params", reads_params=master != "fp32",
                compiled=fzero.update.CompiledUpdate("whole", "into"), native=native, native_leaves=native_leaves,
                native_norm=not gpu, leaves="leaf update" if leaves else None, overlap_gather=overlap_gather)
    leaves = None if flat_in else optree.tree_leaves(params)  # as the grads' door returns them
    form = fzero.params_form.ParamsForm.of(params, leaves, layout, traced=compiled)
    return fzero.plan.choose(k, form, layout, compiled=compiled), params


def update_path(plan, *, detail: bool = True) -> str:
    """The update's variant and the fallbacks it carries, as ``Native > FusedChunks(256) > Chunks(256)``
    (``detail=False``: by name only, ``Native > FusedChunks > Chunks``)."""
    names, v = [], plan.update
    while v is not None:
        chunk = getattr(v, "chunk", None) if detail else None
        names.append(type(v).__name__ + ("(traced)" if detail and getattr(v, "traced", False) else "")
                     + (f"({chunk})" if chunk is not None else ""))
        v = getattr(v, "fallback", None)
    return " > ".join(names)


def plan_summary(plan) -> tuple:
    """``(update path, cast, gather, norm, grads as Segments)`` of a ``StepPlan``, by name."""
    gather = type(plan.gather).__name__
    if gather == "GatherNew":
        gather += "(write)" if plan.gather.write else "(new)"
    if gather == "GatherLaunched":
        gather += "(new)" if plan.gather.buffer is None else "(into)"
    norm = type(plan.norm).__name__ + ("(traced)" if plan.norm.compiled else "")
    return update_path(plan), type(plan.cast).__name__, gather, norm, plan.segments
