"""A rank's shard file: safetensors, written straight from the tensors' bytes, hashed as written.

The safetensors format is an 8-byte little-endian header length, a JSON header (padded with
spaces to a multiple of 8 bytes) naming each tensor's dtype, shape and ``[begin, end)`` byte
range in the data that follows, then the data, the tensors back to back with no gap
(https://github.com/huggingface/safetensors#format). A shard file holds 1-D tensors only,
ordered by item size, largest first, then by name, as safetensors' own writer orders them, so
every tensor starts at a multiple of its item size.

Why not ``safetensors.torch.save_file``: it first copies every tensor into a Python ``bytes``
object while holding the GIL (and the memory twice over), which stalls a training loop whose
checkpoint is written by a background thread. Here each tensor's memory goes to ``os.write``
(which releases the GIL) in chunks, and each chunk is hashed as it is written (``hashlib``
releases the GIL on large buffers): the file's sha256 needs no second pass over it. The file
is read back by ``safetensors.safe_open`` (``load``); ``tests/test_checkpoint_shard_file.py``
checks the two agree.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from typing import Iterable, NamedTuple

import torch

from . import files

__all__ = ["Entry", "order", "header", "write"]

CHUNK = 1 << 24  # bytes per write and hash: 16 MiB

_NAMES = {  # safetensors' dtype names
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


class Entry(NamedTuple):
    """One 1-D tensor of a shard file: its name, dtype and number of elements."""

    name: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def order(entries: Iterable[Entry]) -> list[Entry]:
    """The order of the tensors in the file: item size, largest first, then name."""
    return sorted(entries, key=lambda e: (-e.dtype.itemsize, e.name))


def header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The file's first bytes, for ``entries`` in file order (:func:`order`): the header length
    and the padded JSON header."""
    table, offset = {"__metadata__": metadata}, 0
    for e in entries:
        table[e.name] = {"dtype": _NAMES[e.dtype], "shape": [e.numel], "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, without a copy."""
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def write(file: str, head: bytes, parts: Iterable[torch.Tensor]) -> tuple[str, int]:
    """Create the new regular file ``file`` (it must not exist), write ``head`` then ``parts``
    (1-D tensors whose bytes, back to back, are the data section; a CPU tensor is written from
    its own memory, another is copied to the CPU one part at a time), fsync it. Returns its
    ``(sha256 hex, size)``. An ``OSError`` (a full disk, a read-only filesystem) propagates with
    the file's name."""
    if sys.byteorder != "little":  # pragma: no cover -- safetensors' data is little-endian
        raise RuntimeError("fzero.checkpoint writes safetensors files on little-endian hosts only")
    h, size = hashlib.sha256(), 0
    fd = files.create(file)
    try:
        def put(view: memoryview) -> None:
            nonlocal size
            for start in range(0, len(view), CHUNK):
                chunk = view[start : start + CHUNK]
                h.update(chunk)
                while chunk:  # os.write may write less than it was given
                    chunk = chunk[os.write(fd, chunk):]
            size += len(view)

        put(memoryview(head))
        for part in parts:
            put(_bytes(part.detach().to("cpu")))
        os.fsync(fd)
    except OSError as e:
        raise OSError(e.errno, f"writing {file}: {e.strerror}") from e
    finally:
        os.close(fd)
    return h.hexdigest(), size
