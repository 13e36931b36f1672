"""Data for examples/train.py: nothing to download.

* ``CharCorpus``: character-level text. By default the corpus is built at run time from the
  Python standard library's own ``.py`` sources, which ship with every Python install; pass
  any text file instead with ``CharCorpus.from_file`` (a regular file: not a device or a FIFO,
  which every rank reads whole). The vocabulary is fixed (newline, printable ASCII and one
  replacement character: 97 symbols), whatever the text.
* ``TeacherRegression``: a synthetic regression task, ``y = teacher(x)`` (scaled to unit
  variance) for a fixed random MLP teacher and ``x ~ N(0, 1)``.

Both sample batches with ``get_batch(split, step, batch_size, seed)``: a pure function of its
arguments (a generator seeded by ``(seed, split, step)``), so every rank of a data-parallel
run draws the same global batch and takes its own rows of it.
"""
from __future__ import annotations

import os
import re
import stat
import sysconfig

import torch

from fzero.models import mlp

__all__ = ["VOCAB", "CharCorpus", "TeacherRegression", "encode", "decode"]

UNK = "\x7f"  # stands for any character outside the vocabulary (tab, non-ASCII, ...)
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127)) + UNK
_OUTSIDE_VOCAB = re.compile(r"[^\n\x20-\x7e]")
_ID_OF_BYTE = torch.full((256,), VOCAB.index(UNK), dtype=torch.uint8)
_ID_OF_BYTE[[ord(c) for c in VOCAB]] = torch.arange(len(VOCAB), dtype=torch.uint8)

_SPLITS = {"train": 0, "val": 1}


def encode(text: str) -> torch.Tensor:
    """text -> int64 token ids in ``[0, len(VOCAB))``; characters outside VOCAB become UNK."""
    raw = _OUTSIDE_VOCAB.sub(UNK, text).encode("ascii")
    return _ID_OF_BYTE[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()].long()


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


def stdlib_text(max_bytes: int = 3_000_000) -> str:
    """The standard library's ``.py`` files (tests and site-packages left out), in sorted
    path order, concatenated up to ``max_bytes``. The same Python install gives the same text."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__", "idlelib")]
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    parts, size = [], 0
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
        size += len(parts[-1])
        if size >= max_bytes:
            break
    return "".join(parts)[:max_bytes]


_NOT_REGULAR = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def _not_text_file(path: str) -> str | None:
    """Why ``path`` is not a corpus to read (from its ``stat``, without opening it), or None."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "no such file"
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for is_kind, name in _NOT_REGULAR if is_kind(st.st_mode)), "a special file")
        return f"not a regular file but {kind}; give a text file"
    return "the file is empty" if st.st_size == 0 else None


def _generator(seed: int, split: str, step: int) -> torch.Generator:
    """A CPU generator that depends only on ``(seed, split, step)``."""
    return torch.Generator().manual_seed((seed * 2 + _SPLITS[split]) * 1_000_003 + step)


class CharCorpus:
    """Token ids split deterministically into train (first 90%) and val (last 10%)."""

    vocab_size = len(VOCAB)

    def __init__(self, text: str, block_size: int, val_fraction: float = 0.1):
        ids = encode(text)
        n_val = int(len(ids) * val_fraction)
        self.block_size = block_size
        self.splits = {"train": ids[: len(ids) - n_val], "val": ids[len(ids) - n_val :]}
        for name, split in self.splits.items():
            if len(split) <= block_size:
                raise ValueError(f"the {name} split has {len(split)} characters; --block-size {block_size} needs more")

    @classmethod
    def from_stdlib(cls, block_size: int) -> "CharCorpus":
        return cls(stdlib_text(), block_size)

    @classmethod
    def from_file(cls, path: str, block_size: int) -> "CharCorpus":
        """The text of the regular file at ``path``; ``ValueError`` saying what else it is (no such
        file, a directory, a device or FIFO: those are not read at all, a FIFO would block or be
        drained by the first rank, ``/dev/zero`` never ends) or that it is empty."""
        problem = _not_text_file(path)
        if problem:
            raise ValueError(problem)
        with open(path, encoding="utf-8", errors="replace") as f:
            return cls(f.read(), block_size)

    def get_batch(self, split: str, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows: (tokens, next tokens), int64 ``[batch_size, block_size]``."""
        ids, T = self.splits[split], self.block_size
        starts = torch.randint(len(ids) - T, (batch_size,), generator=_generator(seed, split, step))
        windows = ids[starts[:, None] + torch.arange(T + 1)]
        return windows[:, :-1], windows[:, 1:]

    def __repr__(self):
        n = {k: len(v) for k, v in self.splits.items()}
        return f"CharCorpus(train={n['train']:,} chars, val={n['val']:,} chars, vocab={self.vocab_size})"


class TeacherRegression:
    """``y = c * teacher(x)``, ``x ~ N(0, 1)``, for a fixed random MLP ``teacher`` with ``dims``
    and ``c`` the constant that gives ``y`` unit variance (so the MSE starts near 1)."""

    def __init__(self, dims: tuple[int, ...], teacher_seed: int = 1234):
        self.dims = tuple(dims)
        g = torch.Generator().manual_seed(teacher_seed)
        self.teacher = mlp.init(g, self.dims)
        with torch.no_grad():
            self.out_scale = 1.0 / mlp.apply(self.teacher, torch.randn(4096, self.dims[0], generator=g)).std().item()

    @torch.no_grad()
    def get_batch(self, split: str, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): fp32 ``[batch_size, dims[0]]`` and ``[batch_size, dims[-1]]``."""
        x = torch.randn(batch_size, self.dims[0], generator=_generator(seed, split, step))
        return x, mlp.apply(self.teacher, x) * self.out_scale

    def __repr__(self):
        return f"TeacherRegression(dims={self.dims})"
