"""benchmarks/e2e.py: the torch recipe's model is ``models.gpt``; its allocator settings and the
fresh-pages measures (``common.fresh_mib``, ``common.fresh_pages``).
Under glibc's defaults a buffer above the mmap threshold is mapped when allocated and unmapped
when freed: fresh pages every time. Under ``--malloc caching`` (``MALLOC_CACHING``) it comes from
the heap, and when freed its pages stay there for the next allocation to reuse. Which allocation
first finds a freed region large enough is not fixed (small objects allocated in between may
take the start of one, and the heap then grows again: the fifth of 8 allocations still did in
one run), so the test reads where the buffer lives and what the heap keeps (glibc's
``mallinfo2``), not when reuse begins."""
import json
import os
import sys

import pytest
import torch

from fzero.models import gpt
from helpers import REPO, run_script


def module_names(params) -> dict:
    """``models.gpt``'s params under the names of ``e2e.ModuleGPT``'s ``state_dict``."""
    out = {"wte.weight": params["wte"], "wpe.weight": params["wpe"],
           "lnf.weight": params["ln_f"]["g"], "lnf.bias": params["ln_f"]["b"]}
    where = {"ln1": ("ln1", "g", "b"), "qkv": ("attn", "qkv_w", "qkv_b"), "proj": ("attn", "proj_w", "proj_b"),
             "ln2": ("ln2", "g", "b"), "fc": ("mlp", "fc_w", "fc_b"), "out": ("mlp", "proj_w", "proj_b")}
    for i, blk in enumerate(params["blocks"]):
        for name, (group, w, b) in where.items():
            out[f"blocks.{i}.{name}.weight"], out[f"blocks.{i}.{name}.bias"] = blk[group][w], blk[group][b]
    return out


def test_the_torch_recipes_module_is_models_gpt():
    """The torch recipe trains ``e2e.ModuleGPT``: given ``models.gpt``'s params by name, as they
    are (the same shapes, ``nn.Linear``'s ``[out, in]``), its loss and grads are ``gpt.loss``'s,
    so the two recipes run the same matrix products on the same layouts."""
    from e2e import ModuleGPT
    cfg = gpt.GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32)
    params = gpt.init(torch.Generator().manual_seed(0), cfg)
    module = ModuleGPT(cfg)
    module.load_state_dict(module_names(params))  # strict: every name, every shape
    batch = tuple(torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    loss = module(*batch)
    loss.backward()
    grads = torch.func.grad(gpt.loss)(params, batch, cfg)
    torch.testing.assert_close(loss, gpt.loss(params, batch, cfg))  # FP32: to a few roundings
    for name, g in module_names(grads).items():
        torch.testing.assert_close(module.get_parameter(name).grad, g, msg=lambda m: f"{name}: {m}")

SNIPPET = """
import ctypes, json, sys, torch
sys.path.insert(0, "benchmarks")
from common import fresh_mib

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None))
    sys.exit()
libc.mallinfo2.restype = MallInfo2
mib = lambda n: n / 2**20
rows = []
for _ in range(4):
    live = {}
    def touch():
        x = torch.ones(16 * 2**20)  # 64 MiB, above glibc's largest mmap threshold (32 MiB)
        info = libc.mallinfo2()
        live.update(mapped=mib(info.hblkhd), heap=mib(info.uordblks))
        del x
    fresh = fresh_mib(touch)
    info = libc.mallinfo2()
    rows.append(dict(fresh=fresh, **live, mapped_after=mib(info.hblkhd), free_in_heap_after=mib(info.fordblks)))
print(json.dumps(rows))
"""


def rows_under(malloc: str, snippet: str):
    """What ``snippet`` prints last (JSON), run in a new process under ``e2e.py``'s ``malloc``
    setting (its environment must be set before the process starts). Skips where the kernel
    backs every large anonymous mapping with transparent huge pages: one fault then maps 2 MiB,
    and ``fresh_mib`` counts faults."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[always]" in f.read():
                pytest.skip("transparent huge pages are always on: fresh_mib counts one 4 KiB page per fault")
    except OSError:
        pass
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from e2e import MALLOCS
    finally:
        sys.path.pop(0)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(MALLOCS[malloc])
    proc = run_script([sys.executable, "-c", snippet], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.parametrize("malloc", ["glibc", "caching"])
def test_a_64_mib_buffer_is_fresh_pages_every_time_unless_the_allocator_keeps_it(malloc):
    rows = rows_under(malloc, SNIPPET)
    if rows is None:
        pytest.skip("needs glibc's mallinfo2 (glibc >= 2.33)")
    if malloc == "glibc":
        for r in rows:  # mapped, faulted in whole, unmapped when freed
            assert r["fresh"] >= 63 and r["mapped"] - r["mapped_after"] >= 64, rows
    else:
        for r in rows:  # never mapped: in the heap, and kept there when freed, the next allocation's to reuse
            assert r["mapped"] - r["mapped_after"] < 1 and r["heap"] >= 64 and r["free_in_heap_after"] >= 64, rows


FRESH_PAGES_SNIPPET = """
import json, sys, torch
sys.path.insert(0, "benchmarks")
from common import fresh_mib, fresh_pages

resident = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
shared = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("RssShmem:")).split()[1]) / 2**10
before, rows = resident(), []
for _ in range(4):
    live = {}
    def write():
        x = fresh_pages(16 * 2**20, torch.float32)  # 64 MiB
        x.fill_(1.0)
        assert x.dtype == torch.float32 and x.numel() == 16 * 2**20 and bool(x[:: 2**16].eq(1).all())
        live.update(resident=resident() - before, shared=shared())
    rows.append(dict(fresh=fresh_mib(write), kept=resident() - before, **live))
print(json.dumps(rows))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("malloc", ["glibc", "caching"])
def test_fresh_pages_are_fresh_every_time_whatever_the_allocator_keeps_and_go_with_the_tensor(malloc):
    """``common.fresh_pages``, the fresh-outputs floor's buffers in ``benchmarks/step.py``: even
    where the allocator keeps freed memory (``caching``, where a 64 MiB ``torch.ones`` is served
    from the heap: the test above), each buffer is faulted in whole when written, as private
    memory (not shared memory, whose pages cost about twice as much to fault in), and unmapped
    when the tensor goes (the process keeps none of it)."""
    rows = rows_under(malloc, FRESH_PAGES_SNIPPET)
    assert all(r["fresh"] >= 63.9 and r["resident"] >= 63.9 and r["shared"] < 16 and r["kept"] < 16 for r in rows), rows
