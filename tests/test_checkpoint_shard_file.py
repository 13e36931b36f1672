"""fzero.checkpoint.shard_file: the shard files fzero writes are safetensors files that the
safetensors library itself reads back exactly, whatever the dtypes, sizes and write sizes."""
import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fzero.checkpoint import shard_file
from fzero.checkpoint.shard_file import Entry
from fzero.checkpoint.strict_json import DTYPES


def tensors_of_every_dtype(numel):
    g = torch.Generator().manual_seed(numel)
    out = {}
    for name, dtype in DTYPES.items():
        if dtype.is_floating_point:
            t = torch.randn(numel, generator=g).to(dtype)
        elif dtype == torch.bool:
            t = torch.rand(numel, generator=g) > 0.5
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(max(info.min, -1000), min(info.max, 1000), (numel,), generator=g, dtype=torch.int64).to(dtype)
        out[f"x/{name}"] = t
    return out


def write(file, tensors, parts_of=lambda t: [t]):
    entries = shard_file.order(Entry(name, t.dtype, t.numel()) for name, t in tensors.items())
    head = shard_file.header(entries, {"k": "v"})
    return shard_file.write(file, head, (p for e in entries for p in parts_of(tensors[e.name])))


@pytest.mark.parametrize("numel", [0, 1, 7, 1000])
def test_safetensors_reads_back_every_dtype_exactly(tmp_path, numel):
    tensors = tensors_of_every_dtype(numel)
    file = str(tmp_path / "shard.safetensors")
    sha, size = write(file, tensors)
    with open(file, "rb") as f:
        data = f.read()
    assert (sha, size) == (hashlib.sha256(data).hexdigest(), len(data))  # hashed as written
    back = load_file(file)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(file, "pt") as f:
        assert f.metadata() == {"k": "v"}
        assert torch.equal(f.get_slice("x/float32")[numel // 2 :], tensors["x/float32"][numel // 2 :])
    header_len = int.from_bytes(data[:8], "little")
    assert header_len % 8 == 0  # the data starts 8-byte aligned, and every tensor at a multiple of its item size
    for name, info in json.loads(data[8 : 8 + header_len]).items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % tensors[name].dtype.itemsize == 0, name


def test_parts_and_short_writes_give_the_same_file(tmp_path, monkeypatch):
    tensors = tensors_of_every_dtype(1000)
    whole = write(str(tmp_path / "whole"), tensors)
    real_write = os.write
    monkeypatch.setattr(shard_file, "CHUNK", 100)
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:37])))  # every write short
    parts = write(str(tmp_path / "parts"), tensors, lambda t: [t[:3], t[3:500], t[500:]])
    assert parts == whole
    with open(tmp_path / "whole", "rb") as a, open(tmp_path / "parts", "rb") as b:
        assert a.read() == b.read()


def test_a_failed_write_names_the_file_and_an_existing_file_is_never_overwritten(tmp_path, monkeypatch):
    from fzero.checkpoint import CheckpointError

    file = str(tmp_path / "shard.safetensors")
    open(file, "w").close()
    with pytest.raises(CheckpointError, match="something is there already"):
        write(file, tensors_of_every_dtype(3))

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    other = str(tmp_path / "other.safetensors")
    with pytest.raises(OSError, match=rf"writing {other}: No space left on device"):
        write(other, tensors_of_every_dtype(3))
