"""Helpers shared by the test modules: reference pytrees, reference optimizers, comparisons."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
from pathlib import Path

import optree
import torch
import torch.distributed._functional_collectives as funcol
import torch.utils._python_dispatch

import fzero
import fzero.comm
import transforms

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TRAIN = EXAMPLES / "train.py"


def load_train_module(monkeypatch=None):
    """examples/train.py as a module. It imports its sibling data.py as ``data``, so examples/
    goes on sys.path: for the test only with pytest's ``monkeypatch``, for good without (a
    spawned rank)."""
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(EXAMPLES))
    elif str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("examples_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def odd_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g),
        "blocks": [{"g": torch.randn(13, generator=g)}, {"g": torch.randn(3, 1, 2, generator=g)}],
        "one": torch.randn(1, generator=g),
    }


def grads_like(params, seed, scale=1.0):
    g = torch.Generator().manual_seed(1000 + seed)
    return optree.tree_map(lambda p: torch.randn(p.shape, generator=g) * scale, params)


def torch_adamw(params, grads_list, **kw):
    leaves, spec = optree.tree_flatten(params)
    ps = [torch.nn.Parameter(p.clone()) for p in leaves]
    opt = torch.optim.AdamW(ps, **kw)
    for grads in grads_list:
        for p, g in zip(ps, spec.flatten_up_to(grads)):
            p.grad = g.clone()
        opt.step()
    return spec.unflatten([p.detach() for p in ps])


def tree_assert_close(a, b, **kw):
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        torch.testing.assert_close(x, y, **kw)


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

    def reduce_scatter_bucket(self, x, i, layout, *, wait=True):
        self._log("reduce_scatter", x)
        return super().reduce_scatter_bucket(x, i, layout, wait=wait)

    def all_gather_bucket(self, x, i, layout):
        y = super().all_gather_bucket(x, i, layout)
        self._log("all_gather", y)
        return y

    def all_reduce_sum(self, x):
        self._log("all_reduce", x)
        return super().all_reduce_sum(x)

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
                comm.events.append((name, group, x.numel() * x.element_size()))
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


class NewTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of every tensor an aten op creates (views excluded): what a
    step allocates."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rets = func._schema.returns
        if not (rets and all(r.alias_info is not None for r in rets)):  # not a view, not in place
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
