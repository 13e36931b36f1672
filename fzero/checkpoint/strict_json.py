"""How fzero reads, writes and checks the small JSON files of a checkpoint (manifest, pointer, marker).

* :func:`parse_json` is strict: no ``NaN``/``Infinity`` tokens, no numbers out of the float64
  range, no duplicate keys, no arrays or objects nested more than ``MAX_DEPTH`` (100) deep --
  checked before parsing (:func:`nested_too_deep`), so a crafted file gives a
  ``CheckpointError`` naming it, never a ``RecursionError``; :func:`dump_json` writes no NaN or
  infinity either.
* :func:`json_value`/:func:`from_json_value` convert a 0-d tensor to its JSON number and back
  (float64 values round-trip bit for bit); a non-finite float is the string ``"inf"``,
  ``"-inf"`` or ``"nan"``.
* :func:`check_header` checks a parsed file's ``format`` and ``version``; the :class:`Fields`
  it returns checks the other fields, each failure a :class:`CheckpointError` naming the file
  and the field.

Also :class:`CheckpointError`, the error of every checkpoint module, and the dtypes a
checkpoint stores (``DTYPES``, by :func:`dtype_name`).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

__all__ = [
    "VERSION", "MAX_DEPTH", "DTYPES", "CheckpointError", "dtype_name", "nested_too_deep", "parse_json", "dump_json", "json_value",
    "from_json_value", "non_finite", "Fields", "check_header",
]

VERSION = 2  # of every file: manifest, pointer and marker
# How deep arrays and objects may nest in a file fzero reads (its own nest 5 deep; the rest is
# for a save's ``extra``): deeper, parsing would recurse past Python's limit.
MAX_DEPTH = 100

DTYPES = {  # the dtypes a checkpoint stores, by name
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file/leaf and rank(s)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how a checkpoint names a dtype."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------- reading and writing
def _reject_constant(token: str):
    raise ValueError(f"non-standard JSON token {token} (JSON has no NaN or infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of the float64 range")
    return value


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_SQUARE = bytes.maketrans(b"{}", b"[]")


def nested_too_deep(data: bytes | str, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``data`` may nest arrays/objects more than ``limit`` deep (exact
    for balanced brackets; unbalanced text, invalid anyway, may be over-counted). Linear passes
    in C, no recursion: the strings are cut out, the brackets kept, then each pass removes the
    innermost pairs (one level)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    brackets = _STRING.sub(b"", data).translate(_SQUARE, _NOT_BRACKET)
    for levels in range(limit):
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets):  # no pair left: what remains is unmatched ("]]][[[")
            return levels + inner.count(b"[") > limit
        brackets = inner
    return bool(brackets)


def parse_json(data: bytes | str, file: str) -> Any:
    """Strict JSON: no ``NaN``/``Infinity`` tokens, no numbers that overflow, no duplicate keys,
    no nesting deeper than ``MAX_DEPTH``."""
    if nested_too_deep(data):
        raise CheckpointError(f"cannot read {file}: arrays or objects nested more than {MAX_DEPTH} deep "
                              "(fzero's files nest 5 deep; a crafted or damaged file?)")
    try:
        return json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {file}: {e}") from e


def dump_json(obj: Any) -> bytes:
    """``obj`` as the bytes of a small JSON file; ``ValueError`` on NaN or infinity."""
    return json.dumps(obj, indent=1, allow_nan=False).encode()


def json_value(t: torch.Tensor):
    """A 0-d tensor as its JSON number (a non-finite float as ``"inf"``, ``"-inf"``, ``"nan"``)."""
    v = t.item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # "inf", "-inf", "nan": kept strict JSON
    return v


def from_json_value(v, dtype: torch.dtype, device) -> torch.Tensor:
    """The 0-d tensor of ``dtype`` on ``device`` that :func:`json_value` wrote as ``v``."""
    if isinstance(v, str):
        v = float(v)
    return torch.tensor(v, dtype=dtype, device=device)


def non_finite(obj: Any, where: str, seen: set[int] | None = None) -> tuple[str, float] | None:
    """``(where, value)`` of the first float in ``obj`` that is NaN or infinite, else None."""
    seen = set() if seen is None else seen
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (where, obj)
    if id(obj) in seen or not isinstance(obj, (dict, list, tuple)):
        return None
    seen.add(id(obj))
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        found = non_finite(value, f"{where}[{key!r}]", seen)
        if found:
            return found
    return None


# ---------------------------------------------------------------------------------- checking fields
class Fields:
    """Checks on the parsed JSON of one file; every failure is a CheckpointError naming the file
    and the field, e.g. ``manifest field state['tx_state/0/b2'].value = 1.5: must be in [0, 1)``."""

    def __init__(self, file: str, kind: str = "manifest"):
        self.file, self.kind = file, kind

    def fail(self, field: str, value: Any, need: str):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(f"{self.file}: {self.kind} field {field} = {shown}: {need}")

    def get(self, obj: dict, key: str, at: str | None = None) -> Any:
        """``obj[key]``; ``at`` names ``obj`` (``None``: the top level)."""
        field = f"{at}.{key}" if at else key
        if key not in obj:
            raise CheckpointError(f"{self.file}: {self.kind} field {field} is missing")
        return obj[key]

    def mapping(self, field: str, value: Any) -> dict:
        if not isinstance(value, dict):
            self.fail(field, value, "must be a JSON object")
        return value

    def sequence(self, field: str, value: Any) -> list:
        if not isinstance(value, list):
            self.fail(field, value, "must be a JSON list")
        return value

    def string(self, field: str, value: Any, pattern: re.Pattern | None = None) -> str:
        if not isinstance(value, str):
            self.fail(field, value, "must be a string")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(field, value, f"must match {pattern.pattern}")
        return value

    def integer(self, field: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
        if type(value) is not int:  # not a bool, not 3.0
            self.fail(field, value, "must be an integer")
        if value < lo or (hi is not None and value > hi):
            self.fail(field, value, f"must be in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}")
        return value

    def dtype(self, field: str, value: Any, *, floating: bool = False) -> str:
        if not isinstance(value, str) or value not in DTYPES or (floating and not DTYPES[value].is_floating_point):
            known = [n for n, d in DTYPES.items() if d.is_floating_point or not floating]
            self.fail(field, value, f"must be one of {known}")
        return value

    def choice(self, field: str, value: Any, choices: tuple) -> Any:
        if value not in choices:
            self.fail(field, value, f"must be one of {list(choices)}")
        return value


def check_header(obj: Any, file: str, kind: str, format: str) -> Fields:
    """A parsed file of ``kind`` (manifest, pointer, marker) is a JSON object of ``format`` and
    this ``VERSION``; the checker for its other fields."""
    if not isinstance(obj, dict) or obj.get("format") != format:
        raise CheckpointError(f"{file} is not an fzero checkpoint {kind}")
    if obj.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {obj.get('version')!r}; this fzero reads version {VERSION}")
    return Fields(file, kind)
