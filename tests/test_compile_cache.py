"""fzero.compile_cache: where fzero keeps its cache, the CPU vector-ISA verdict it remembers, and
AOTAutograd's cache holding the compiled loss that writes into a kept grads buffer."""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor import cpu_vec_isa

import fzero
from fzero import compile_cache


def test_the_cache_directory_is_fzero_cache_dir_else_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FZERO_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.cache_dir() == str(tmp_path / "mine")
    monkeypatch.delenv("FZERO_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == str(tmp_path / "xdg" / "fzero")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "fzero")


def fake_probe(monkeypatch, probed: list[str], listed: list[str]) -> list:
    """Inductor's ISA list: ``probed`` as its subprocess probe leaves it, ``listed`` as the CPU's
    flags give it (the probe skipped, ``cpp.vec_isa_ok``); returns the list of probes run."""
    calls = []

    @functools.cache
    def valid_vec_isa_list():
        if inductor_config.cpp.vec_isa_ok:
            return list(listed)
        calls.append(1)  # a probe
        return list(probed)

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    inductor_config.cpp.vec_isa_ok = None  # a new process (``torch_config`` restores it)
    functorch_config.autograd_cache_allow_custom_autograd_functions = False
    return calls


@pytest.fixture(autouse=True)
def torch_config():
    """The torch settings ``warm_start`` changes, as they were, after each test."""
    with inductor_config.patch({"cpp.vec_isa_ok": inductor_config.cpp.vec_isa_ok}), functorch_config.patch(
            autograd_cache_allow_custom_autograd_functions=functorch_config.autograd_cache_allow_custom_autograd_functions):
        yield


def test_the_isa_verdict_is_probed_once_then_remembered(monkeypatch, tmp_path):
    calls = fake_probe(monkeypatch, ["avx512", "avx2"], ["avx512", "avx2"])
    assert compile_cache.warm_start(directory=str(tmp_path)) == {"autograd_cache": True, "vec_isa": "probed"}
    assert calls == [1] and inductor_config.cpp.vec_isa_ok is True  # one key for this process and the next
    (record,) = (tmp_path / "vec_isa").iterdir()
    assert json.loads(record.read_text())["all_pass"] is True

    calls = fake_probe(monkeypatch, ["avx512", "avx2"], ["avx512", "avx2"])  # a new process
    assert compile_cache.warm_start(directory=str(tmp_path))["vec_isa"] == "remembered"
    assert calls == [] and inductor_config.cpp.vec_isa_ok is True


def test_an_isa_the_probe_rejects_keeps_inductor_probing(monkeypatch, tmp_path):
    fake_probe(monkeypatch, ["avx2"], ["avx512", "avx2"])
    assert compile_cache.warm_start(directory=str(tmp_path))["vec_isa"] == "mixed"
    assert inductor_config.cpp.vec_isa_ok is None
    calls = fake_probe(monkeypatch, ["avx2"], ["avx512", "avx2"])
    assert compile_cache.warm_start(directory=str(tmp_path))["vec_isa"] == "mixed"
    assert inductor_config.cpp.vec_isa_ok is None and calls == []


def test_another_torch_or_cpu_is_probed_afresh_and_a_user_setting_is_kept(monkeypatch, tmp_path):
    fake_probe(monkeypatch, ["avx2"], ["avx2"])
    compile_cache.warm_start(directory=str(tmp_path))
    calls = fake_probe(monkeypatch, ["avx2"], ["avx2"])
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert compile_cache.warm_start(directory=str(tmp_path))["vec_isa"] == "probed" and calls == [1]
    assert len(list((tmp_path / "vec_isa").iterdir())) == 2
    calls = fake_probe(monkeypatch, ["avx2"], ["avx2"])
    inductor_config.cpp.vec_isa_ok = False
    assert compile_cache.warm_start(directory=str(tmp_path))["vec_isa"] == "none" and calls == []
    assert inductor_config.cpp.vec_isa_ok is False


def test_an_unwritable_cache_directory_probes_each_time_and_still_starts(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    fake_probe(monkeypatch, ["avx2"], ["avx2"])
    assert compile_cache.warm_start(directory=str(blocker / "sub"))["vec_isa"] == "probed"


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True], ids=["torch-default", "warm_start"])
def test_the_loss_into_a_kept_grads_buffer_is_served_from_aotautograds_cache(warm, tmp_path):
    """The compiled loss of ``unflatten(..., grads_into=...)`` (fzero's ``autograd.Function``)
    compiled twice in fresh dynamo states over inductor's on-disk cache: AOTAutograd passes over it by
    default; after ``warm_start`` the second compile is a cache hit with the same grads."""
    functorch_config.autograd_cache_allow_custom_autograd_functions = False
    if warm:
        compile_cache.warm_start(directory=str(tmp_path / "fzero"))
    layout = fzero.make_layout({"w": torch.zeros(4, 3), "b": torch.zeros(3)}, 1)
    flat = torch.randn(layout.padded_numel)
    x = torch.randn(5, 4)

    def loss(flat, into):
        p = fzero.unflatten(flat, layout, grads_into=into)
        return (x @ p["w"] + p["b"]).square().sum()

    grads = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        into = torch.zeros_like(flat)
        torch.compile(loss)(flat.detach().requires_grad_(), into).backward()
        grads.append(into)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
    aot = counters["aot_autograd"]
    assert (aot["autograd_cache_hit"], aot["autograd_cache_bypass"]) == ((1, 0) if warm else (0, 1))
