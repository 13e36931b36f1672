"""How a state tensor is stored between steps: its FP32 value inside the step, its stored form outside.

The step works on FP32 values. What the state keeps of them between steps is the storage's
choice, made once (``zero1(master=...)``) and asked nothing at run time: the engine calls the
same four members whatever the storage is.

* ``dtype``, ``numel(S)``: the stored tensor's dtype and length (what ``check_state`` expects of
  ``state.master``);
* ``full(stored, params_shard) -> FP32``: the value the step works on, rebuilt from what is
  stored. ``params_shard`` is a zero-argument function returning this rank's ``[S]`` params
  shard; only a storage with ``reads_params`` calls it (reading the params of a pytree can mean
  laying them out anew);
* ``store(value, params_shard) -> stored``: what is kept of the FP32 ``value``; ``params_shard``
  is the params shard cast from it (the tensor itself);
* ``reads_params``: whether ``full`` needs the params, so that params and state must come from
  the same step (``fzero.lineage``'s ``same_step``).

A storage of the optimizer's moments (8-bit or BF16 Adam moments) has the same members, with
``reads_params`` false. The master storages:

* ``FP32Master`` (``master="fp32"``): the FP32 master itself, 4S bytes;
* ``RemainderMaster`` (``master="remainder"``, BF16 params only): the int16 remainder below this
  rank's BF16 params shard, 2S bytes, from which the exact FP32 master is rebuilt
  (``fzero.remainder``);
* ``ParamsMaster`` (``master="params"``, FP32 params only): nothing; the params' own FP32 shard
  is the master (an FP32 master beside FP32 params would be a second copy of the same values).
"""
from __future__ import annotations

from typing import Callable

import torch

from .remainder import join, split

__all__ = ["FP32Master", "RemainderMaster", "ParamsMaster", "MASTERS", "master_storage"]

ParamsShard = Callable[[], torch.Tensor]


class FP32Master:
    """The FP32 master shard, stored as it is."""

    name = "fp32"
    dtype = torch.float32
    reads_params = False

    def numel(self, shard_numel: int) -> int:
        return shard_numel

    def full(self, stored: torch.Tensor, params_shard: ParamsShard) -> torch.Tensor:
        return stored

    def store(self, value: torch.Tensor, params_shard: torch.Tensor) -> torch.Tensor:
        return value

    def __repr__(self) -> str:
        return "FP32Master()"


class RemainderMaster:
    """The FP32 master as the int16 remainder below its BF16 rounding, the params shard: an exact
    split (``fzero.remainder``); the params hold the other 16 bits."""

    name = "remainder"
    dtype = torch.int16
    reads_params = True

    def numel(self, shard_numel: int) -> int:
        return shard_numel

    def full(self, stored: torch.Tensor, params_shard: ParamsShard) -> torch.Tensor:
        return join(params_shard().to(stored.device), stored)

    def store(self, value: torch.Tensor, params_shard: torch.Tensor) -> torch.Tensor:
        return split(value, params_shard.to(value.device))

    def __repr__(self) -> str:
        return "RemainderMaster()"


class ParamsMaster:
    """No stored master: the FP32 params shard is the master. ``state.master`` is an empty FP32
    tensor (``[0]``), kept so that the state has the same structure in every mode."""

    name = "params"
    dtype = torch.float32
    reads_params = True

    def numel(self, shard_numel: int) -> int:
        return 0

    def full(self, stored: torch.Tensor, params_shard: ParamsShard) -> torch.Tensor:
        return params_shard().to(stored.device)

    def store(self, value: torch.Tensor, params_shard: torch.Tensor) -> torch.Tensor:
        return value.new_empty(0)

    def __repr__(self) -> str:
        return "ParamsMaster()"


MASTERS = {"fp32": FP32Master(), "remainder": RemainderMaster(), "params": ParamsMaster()}
_NEEDS = {"remainder": (torch.bfloat16, "stores the FP32 master as the BF16 params plus an int16 remainder"),
          "params": (torch.float32, "takes the FP32 params' own shard as the master")}


def master_storage(master: str, param_dtype: torch.dtype) -> FP32Master | RemainderMaster | ParamsMaster:
    """The storage of ``zero1(master=...)``: ``"fp32"``; ``"remainder"`` with BF16 params;
    ``"params"`` with FP32 params."""
    if master not in MASTERS:
        raise ValueError(f"master must be 'fp32', 'remainder' or 'params', got {master!r}")
    if master in _NEEDS and param_dtype != _NEEDS[master][0]:
        need, what = _NEEDS[master]
        raise ValueError(f"master={master!r} {what}: it needs param_dtype={need}, got {param_dtype} "
                         "(use master='fp32')")
    return MASTERS[master]
