"""``zero1``: an engine and its options, documented (``fzero.checks`` validates them)."""
from __future__ import annotations

import torch

from .engine import Engine

__all__ = ["zero1"]


def zero1(
    tx,
    *,
    param_dtype: torch.dtype = torch.float16,
    loss_scale="auto",
    group=None,
    mesh=None,
    reduce_dtype: torch.dtype = torch.float32,
    wire_dtype: torch.dtype | None = None,
    alignment: int = 64,
    bucket_bytes: int | None = None,
    stage: int = 1,
    offload: str | None = None,
    donate: bool = False,
    chunk_numel: int | None = 2**18,
    simulate: tuple[int, ...] | None = None,
    master: str = "fp32",
    call_timeout: float = 60.0,
    overlap_gather: bool = False,
) -> Engine:
    """A ZeRO engine (stage 1 by default) for gradient transformation ``tx``.

    Args:
      param_dtype: dtype of the model params the user sees: fp16 (default), bf16 or fp32.
      loss_scale: ``DynamicLossScale()``, ``StaticLossScale(s)`` or ``None`` (no scaling);
        default ``"auto"``: dynamic for fp16, none otherwise.
      group: a ProcessGroup; ``None`` = WORLD if torch.distributed is initialized, else one
        process; or a communicator (``fzero.comm.Comm``, ``SimulatedComm``, or a subclass).
      mesh: a ``DeviceMesh`` instead of ``group``: 1-D, the same as ``group=`` its group; 2-D
        with ``mesh_dim_names=("replicate", "shard")``, hybrid sharding: master and moments
        sharded over ``shard`` (12P/S bytes per rank), replicated over ``replicate``; grads
        reduce-scattered inside the shard group, the shard all-reduced over the replicate
        group, params all-gathered inside the shard group (``fzero.comm.HybridComm``).
      reduce_dtype: dtype the gradients are summed (accumulated) in over ranks: FP32 (default;
        the sum cannot overflow) or ``param_dtype`` with the FSDP pre/post split of 1/N.
      wire_dtype: dtype the gradients cross the wire in for the reduce-scatter. ``None``
        (default): the params' dtype -- FP16/BF16 grads go out as they are, in an all-to-all,
        and each rank sums the pieces it receives in ``reduce_dtype`` (Megatron-LM's FP32
        accumulation): half the bytes of an FP32 copy, and the same sum (at 2 ranks bit for bit,
        beyond in rank order). ``reduce_dtype``: a copy in it is reduce-scattered, the sum made
        in flight (NCCL's ring; on gloo an all-reduce): twice the bytes. A stage-1 sum of
        micro-batches (``accumulate``, ``no_sync``) is FP32 and leaves in ``reduce_dtype``
        either way.
      alignment: each rank's slice of each bucket is a multiple of this many elements (64), and
        of the transform's ``block`` (256 with 8-bit moments: no block straddles two ranks).
      bucket_bytes: split the flat buffer into buckets of about this many param bytes, each
        sharded across all ranks (one reduce-scatter and all-gather per bucket), filled in
        reverse leaf order; ``None`` (default): one bucket.
      stage: 1 (default), or 2 for gradient accumulation that reduce-scatters every
        micro-batch and keeps only this rank's FP32 shard of the sum (see ``Engine.accumulate``).
      offload: ``"cpu"`` keeps master weights and transform state in (pinned) host memory and
        runs the update there; params and grads stay on their device. Each step then waits
        for its grads on the host (a device->host copy), by construction. Default ``None``.
      donate: ``step`` writes the new optimizer state and params into the input ``state``'s and
        ``params``' buffers and returns them (JAX's ``donate_argnums``): the inputs must not be
        used again. On more than one rank the step may also overwrite flat ``grads`` (the
        gradient of ``Engine.flat_params``): on gloo it reduces them in their own buffer, and
        it gathers the new params into the params' own buffer (no ``[N*S]`` copy of either).
        With ``torch.compile`` the FP32 state then exists once during the step;
        FP16/BF16 params passed as a pytree (not the flat buffer) then come back in a new
        ``[N*S]`` buffer, which is cheaper there than writing each leaf. Without (default), the
        step is pure and holds old and new state at its peak.
      chunk_numel: an eager step on a CPU shard (CPU training, or ``offload``) updates it in
        chunks of this many elements (default 2**18), so its temporaries stay cache-sized
        (``None``: all at once). Results do not depend on it; compiled steps and CUDA shards
        ignore it.
      simulate: ``(rank, world_size)``: shorthand for ``group=SimulatedComm(rank, world_size)``:
        act as that rank of that many ranks with no process group, every rank holding the
        same grads (for memory accounting on one device); ``(rank, shards, replicas)``: a rank
        of a hybrid mesh.
      master: ``"fp32"`` (default): an FP32 master shard, 4S bytes. ``"remainder"`` (BF16
        params only): an int16 ``[S]`` remainder below this rank's BF16 params shard instead,
        2S bytes, from which the step rebuilds the exact FP32 master and into which it splits
        it again (``fzero.remainder``): the same training bit for bit, state 10S instead of 12S.
        ``"params"`` (FP32 params only): no stored master, the params' own FP32 shard is the
        master (``state.master`` is empty): the same training bit for bit, state 8S instead of
        12S, and a step that reads and writes 8 bytes per element less. With ``"remainder"``
        and ``"params"`` the step needs the params and state that the same call returned.
      call_timeout: seconds a collective call off the hot path (``init``, ``load_params``,
        ``time_collectives``, the ``fzero.checkpoint`` functions) waits for every rank to reach
        it; then every waiting rank raises naming the ranks that did not (default 60). A rank in
        another fzero call, or one that failed inside ``try: ... finally: fzero.shutdown()``,
        makes them raise at once (``fzero.comm.arrival``).
      overlap_gather: an eager ``step`` on more than one rank returns once the new params'
        all-gather is *issued*, bucket by bucket (the first layers' bucket first), and hands out
        leaves that each wait for their bucket at their first use (any call that touches their
        memory; views and metadata do not wait): the next forward overlaps the gathers it has
        not reached, and a read before it reads whole params (``fzero.arriving``). The same
        params bit for bit. Compiled steps gather in their graph either way. Default ``False``
        (docs/communication.md has it measured).
    """
    options = dict(locals())
    return Engine(options.pop("tx"), **options)
