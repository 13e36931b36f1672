"""The public table of tensor collectives (``fzero.comm.Collectives``): a wrapped table sees every
collective a ``Comm`` issues, changes no result, and traces into a compiled step."""
import optree
import pytest
import torch

import fzero
import fzero.comm
from fzero import transforms
from distributed import run_ranks
from helpers import compiled_buffers, counting_comm, grads_like, odd_params


def test_wrapped_applies_the_wrapper_to_each_collective_by_name():
    table = fzero.comm.FUNCTIONAL.wrapped(lambda name, fn: (name, fn))
    assert table == fzero.comm.Collectives(*((name, fn) for name, fn in zip(table._fields, fzero.comm.FUNCTIONAL)))
    assert [name for name, _ in table] == ["reduce_scatter", "all_gather", "all_reduce", "broadcast",
                                          "reduce_scatter_donated", "all_gather_into", "all_to_all"]


def counted_step(rank, world_size):
    calls = []
    p0 = odd_params()
    seq = [optree.tree_map(lambda x: x.half(), grads_like(p0, 10 * i + rank)) for i in range(2)]
    out = {}
    for name, group in (("plain", None), ("counted", counting_comm(calls))):
        engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float16, loss_scale=None, bucket_bytes=40,
                             group=group)
        step = engine.step if name == "plain" else torch.compile(engine.step, fullgraph=True)
        params, state, ss = engine.init(p0)
        calls.clear()  # init gathered the first params
        params, state, ss, _ = engine.step(params, seq[0], state, ss)  # eager
        eager = {"master": state.master.clone(), "params": fzero.flatten(params, engine.layout)}
        eager_calls = list(calls)
        params, state, ss, _ = step(params, seq[1], state, ss)  # compiled, for the wrapped table
        out[name] = {"eager": eager, "master": state.master}
    out["calls"], out["after_compiled"] = eager_calls, len(calls)
    out["buckets"], out["padded"] = len(engine.layout.buckets), engine.layout.padded_numel
    return out


@pytest.mark.multirank
def test_a_wrapped_table_counts_every_collective_and_compiles():
    for r in run_ranks(counted_step, 2):
        for key in ("master", "params"):  # eager: the same bits as without the wrapper
            assert torch.equal(r["counted"]["eager"][key], r["plain"]["eager"][key])
        torch.testing.assert_close(r["counted"]["master"], r["plain"]["master"], rtol=1e-6, atol=1e-7)  # compiled
        b, padded = r["buckets"], r["padded"]
        assert b > 1
        names = [name for name, _ in r["calls"]]
        # the FP16 grads pytree is laid out into FP16 buckets, each sent as it is (an all-to-all)
        # and summed in FP32 where it lands
        assert names.count("all_to_all") == names.count("all_gather") == b and names.count("all_reduce") == 1
        assert len(names) == 2 * b + 1  # nothing else, and no broadcast without replicas
        nbytes = {n: sum(x for m, x in r["calls"] if m == n) for n in ("all_to_all", "all_gather", "all_reduce")}
        # FP16 grads of the whole buffer in, this rank's FP16 half of the params in, one float64
        assert nbytes == {"all_to_all": 2 * padded, "all_gather": 2 * padded // 2, "all_reduce": 8}
        assert r["after_compiled"] == len(names)  # the compiled step ran the wrapper only while tracing


def gloo_table_against_gloos_own(rank, world_size):
    from fzero.comm.collectives import FUNCTIONAL, completed
    comm = fzero.comm.Comm.of(None)  # gloo: the table Comm picks for it
    group, n = comm.group, 4 * world_size * 5
    # integers: the sums are exact whatever order each implementation adds in
    x = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(rank)).float()
    before = x.clone()
    shard = x[: n // world_size]
    out = {"picked": comm.collectives is not FUNCTIONAL}
    for name, table in (("own", FUNCTIONAL), ("picked", comm.collectives)):
        rs = lambda x, t=table: completed(t.reduce_scatter(x, "sum", 0, group))  # noqa: E731
        ag = lambda s, t=table: completed(t.all_gather(s, 0, group))  # noqa: E731
        out[name] = [rs(x), ag(shard)]
    # traced into a graph as the compiled step issues them (gloo's own are, test_compile.py);
    # at 2 ranks only: what the trace holds does not depend on the world size, its cost does
    compiled = world_size == 2
    out["compiled"] = [torch.compile(rs, fullgraph=True)(x), torch.compile(ag, fullgraph=True)(shard)] if compiled else out["picked"]
    out["input kept"] = torch.equal(x, before)
    # the donated forms: the reduce-scatter in the given buffer, the all-gather into ``out``
    t = comm.collectives
    rsd = lambda d: t.reduce_scatter_donated(d, "sum", 0, group)  # noqa: E731
    agi = lambda s, o: t.all_gather_into(s, o, 0, group)  # noqa: E731
    out["donated"], out["buffers"] = [], []
    for fn in (rsd, agi):
        for run in ([fn, torch.compile(fn, fullgraph=True)] if compiled else [fn]):
            given, into = x.clone(), torch.full((n,), float("nan"))
            args = (given,) if fn is rsd else (shard, into)
            if run is fn:
                got = run(*args)
            else:  # and what the generated code allocates
                got, buffers = compiled_buffers(run, *args)
                out["buffers"].append(buffers)
            mine = given if fn is rsd else into  # the buffer written
            out["donated"].append((got.clone(), mine.clone(), got.data_ptr() - mine.data_ptr()))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_on_gloo_reduce_scatter_and_all_gather_go_over_all_reduce_and_broadcast_with_gloos_results(world_size):
    for rank, r in enumerate(run_ranks(gloo_table_against_gloos_own, world_size)):
        assert r["picked"] and r["input kept"]
        for got, eager, want in zip(r["compiled"], r["picked"], r["own"]):
            assert torch.equal(eager, want) and torch.equal(got, want)
        # donated: the same results, in the given buffers (the reduce-scatter's shard is this
        # rank's slice of the whole sum, left in the buffer; the gather fills ``out``)
        rs_want, ag_want = r["own"]
        runs = len(r["donated"]) // 2
        S = rs_want.numel()
        for got, buffer, offset in r["donated"][:runs]:
            assert torch.equal(got, rs_want) and torch.equal(buffer[rank * S : (rank + 1) * S], rs_want)
            assert offset == rank * S * 4  # a view of the donated buffer, eager and compiled
        for got, buffer, offset in r["donated"][runs:]:
            assert torch.equal(got, ag_want) and torch.equal(buffer, ag_want) and offset == 0
        # compiled, neither makes a buffer of a shard or of the whole: each works in the one given
        for buffers in r["buffers"]:
            assert not [b for b in buffers if b[0] in (S, S * world_size)], buffers


def widening_reduce_scatter(rank, world_size):
    from fzero.comm.collectives import FUNCTIONAL, completed
    from fzero.layout import make_layout
    n = 4 * world_size * 64
    layout = make_layout({"g": torch.empty(n)}, world_size)  # one bucket of n elements
    assert layout.padded_numel == n
    S = n // world_size
    gen = torch.Generator().manual_seed(rank)
    ints = torch.randint(-50, 50, (n,), generator=gen)  # exact sums in any order
    spread = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-14, 10, (n,), generator=gen).float())  # finite in FP16
    out = {}
    # the table gloo's Comm picks and the one NCCL's does: the widening form is the same in both
    comms = {"gloo's": fzero.comm.Comm.of(None), "NCCL's": fzero.comm.Comm.of(None, collectives=FUNCTIONAL)}
    group = comms["gloo's"].group
    wide = lambda x, c=comms["gloo's"]: c.reduce_scatter_bucket(x, 0, layout, dtype=torch.float32)  # noqa: E731
    for dtype in (torch.float16, torch.bfloat16):
        x, y = ints.to(dtype), spread.to(dtype)
        got = {"eager": wide(x), "NCCL's table": wide(x, comms["NCCL's"])}
        # started in flight (inside backward), summed when waited for
        for name, c in comms.items():
            started = c.reduce_scatter_bucket(x, 0, layout, dtype=torch.float32, wait=False)
            got[f"{name} waited"] = c.wait_reduced(started, 0, layout, dtype=torch.float32)
        if world_size == 2:  # what the trace holds does not depend on the world size
            got["compiled"], out[f"{dtype} buffers"] = compiled_buffers(torch.compile(wide, fullgraph=True), x)
        out[dtype] = {
            "got": got,
            "gloo's own": completed(FUNCTIONAL.reduce_scatter(x.float(), "sum", 0, group)),  # of an FP32 copy
            "spread": wide(y),
            # the all-reduce of an FP32 copy, which the step made before
            "spread all-reduced": completed(FUNCTIONAL.all_reduce(y.float(), "sum", group))[rank * S : (rank + 1) * S],
            # every rank's values in float64: the exact sum, and the sum of their magnitudes
            "spread, all ranks": completed(FUNCTIONAL.all_gather(y.double(), 0, group)).view(world_size, n)[:, rank * S : (rank + 1) * S],
        }
    return out, S


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_widening_reduce_scatter_sums_low_precision_grads_in_fp32_without_an_fp32_copy(world_size):
    for out, S in run_ranks(widening_reduce_scatter, world_size):
        for dtype in (torch.float16, torch.bfloat16):
            r = out[dtype]
            for got in r["got"].values():  # eager, waited and compiled: gloo's own sums of the FP32 copy
                assert got.dtype == torch.float32 and torch.equal(got, r["gloo's own"])
            # against float64: N-1 additions in FP32, each rounding by at most half an ulp of the
            # partial sum, so |error| <= (N-1) * 2^-24 * sum |x| (a 16-bit ring would round in 16 bits)
            every = r["spread, all ranks"]
            bound = (world_size - 1) * 2.0**-24 * every.abs().sum(0)
            assert ((r["spread"].double() - every.sum(0)).abs() <= bound).all()
            if world_size == 2:  # one addition, which commutes: the same bits on any values
                assert torch.equal(r["spread"], r["spread all-reduced"])
                # compiled, nothing FP32 of the whole buffer's size: only this rank's [S] sum
                assert not [b for b in out[f"{dtype} buffers"] if b == (S * world_size, "float32")]
