"""Plan past the box: per-step communication time and per-rank memory of DDP, flat ZeRO-1 and
hybrid ZeRO-1 on ``--nodes`` x ``--gpus-per-node`` GPUs, for models of ``--sizes`` params.

The collectives and their bytes are the ones fzero issues per step (``collective_bytes``;
``tests/test_engine_mesh.py`` checks them against the bytes counted on 4 gloo ranks). Times use
the ring cost model, with D the collective's full buffer in bytes and n the ranks in the group:

    reduce-scatter, all-gather:  t = (n-1)/n * D / bw        all-reduce:  t = 2 (n-1)/n * D / bw

where bw is the per-GPU bandwidth of the slowest link the group crosses: ``--intra-GBps`` (NVLink,
900 GB/s) inside a node, ``--inter-Gbps`` (InfiniBand, 400 Gb/s per GPU) across nodes. Latency
and overlap with backward are left out: the model compares the bytes each scheme puts on each
link. Schemes, for P params, N = nodes x G GPUs, r = reduce bytes per element (4: FP32,
fzero's default; 2 with ``--reduce-dtype fp16``), w = wire bytes per element of the grads (2:
FP16 grads sent as they are, fzero's default -- an all-to-all, each rank summing its shard in
r bytes where it lands, which moves (n-1)/n of w*P per rank as a ring reduce-scatter does; r
with ``zero1(wire_dtype=torch.float32)``), params in FP16:

    DDP           all-reduce of r*P over N ranks
    flat ZeRO-1   reduce-scatter of w*P and all-gather of 2P over N ranks
    hybrid        reduce-scatter of w*P and all-gather of 2P inside each node (S = G ranks),
                  all-reduce of the r*P/S shard across nodes (R = nodes ranks)

Where w < r, the two ZeRO-1 schemes are listed again with w = r ("FP32 copy on the wire"), so
one run shows what the 16-bit wire buys at each scale.

Memory per rank (params 2P + grads 2P + FP32 master and Adam moments 12P/shards): DDP 16P,
ZeRO-1 4P + 12P/N, hybrid 4P + 12P/S. ``--muon F``: the ZeRO-1 schemes again with
``partition(muon, adamw)`` on a fraction F of the params in Muon's matrices: each step adds two
all-to-alls in the shard group (``fzero.shard_view``), each rank sending its shard's share of the
matrices, F P / N elements, out in BF16 and back in FP32 (6 B per element), and Muon keeps 4 B of
state per matrix element where AdamW keeps 8: 4P + (12 - 4F) P/N on average over the ranks (a rank
whose shard holds AdamW's elements only still keeps 12P/N: ``benchmarks/memory.py``). ``--measure`` also runs fzero as rank 0 of the simulated
mesh (``zero1(simulate=(0, S, R))``: the real buffers, no process group) and reports the bytes it
holds after one step, as ``benchmarks/memory.py`` does for N.

    python benchmarks/comm_model.py                                   # 124M and 1B, 8 nodes x 8 GPUs
    python benchmarks/comm_model.py --sizes 1e9 --nodes 8 --gpus-per-node 8 --measure
    python benchmarks/comm_model.py --nodes 2 --gpus-per-node 2 --inter-Gbps 100
    python benchmarks/comm_model.py --muon 0.68                        # + Muon on GPT-2 small's share of matrices
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import table, write_json  # noqa: E402

GB = 2**30


def collective_bytes(padded: int, shards: int, replicas: int, *, reduce_bytes: int, param_bytes: int,
                     wire_bytes: int | None = None) -> dict:
    """``{(collective, group): input bytes per step}`` of fzero's step on a ``replicas x shards``
    mesh, ``padded`` = N*S elements of the flat buffer (``layout.padded_numel``), the same for any
    bucketing: reduce-scatter of the ``[N*S]`` grads (``wire_bytes`` each, default
    ``reduce_bytes``) and all-gather of the ``[S]`` param shard in the shard group, all-reduce of
    the ``[S]`` reduced grads over the replicas, and the 8-byte all-reduce of the norm in the
    shard group. A group of one rank issues nothing."""
    shard = padded // shards
    out = {}
    if shards > 1:
        out[("reduce_scatter", "shard")] = (reduce_bytes if wire_bytes is None else wire_bytes) * padded
        out[("all_gather", "shard")] = param_bytes * shard
        out[("all_reduce", "shard")] = 8
    if replicas > 1:
        out[("all_reduce", "replicate")] = reduce_bytes * shard
    return out


def ring_seconds(kind: str, full_bytes: float, n: int, bandwidth: float) -> float:
    """The ring cost model: ``full_bytes`` is the collective's whole buffer D (for a
    reduce-scatter its input, for an all-gather its output, for an all-reduce the buffer)."""
    if n == 1:
        return 0.0
    hops = 2 if kind == "all_reduce" else 1
    return hops * (n - 1) / n * full_bytes / bandwidth


def all_to_all_seconds(sent_bytes: float, n: int, bandwidth: float) -> float:
    """An all-to-all in which each rank sends ``sent_bytes`` in all, an equal share to every rank
    (itself included): ``(n-1)/n`` of it crosses the links."""
    return (n - 1) / n * sent_bytes / bandwidth


def schemes(P: float, nodes: int, gpus: int, *, reduce_bytes: int, intra: float, inter: float,
            muon: float = 0.0, wire_bytes: int = 2) -> list[dict]:
    """Per-step communication seconds and per-rank bytes of the three schemes (see the module
    docstring), each with the formula it used; where ``wire_bytes`` < ``reduce_bytes`` the two
    ZeRO-1 schemes again with an FP32 copy on the wire; with ``muon`` (the fraction of P in
    Muon's matrices, > 0) the two ZeRO-1 schemes again with ``partition(muon, adamw)``."""
    N = nodes * gpus
    across = inter if nodes > 1 else intra  # a group that spans nodes runs at the NIC's pace
    r, S, R = reduce_bytes, gpus, nodes
    ddp = ring_seconds("all_reduce", r * P, N, across)

    def zero1(w: int, label: str = "") -> tuple[float, float, float, list[dict]]:
        flat = ring_seconds("reduce_scatter", w * P, N, across) + ring_seconds("all_gather", 2 * P, N, across)
        intra_s = ring_seconds("reduce_scatter", w * P, S, intra) + ring_seconds("all_gather", 2 * P, S, intra)
        inter_s = ring_seconds("all_reduce", r * P / S, R, inter)
        return flat, intra_s, inter_s, [
            {"scheme": "flat ZeRO-1" + label, "mesh": f"{N}", "seconds": flat, "bytes": 4 * P + 12 * P / N,
             "formula": f"(N-1)/N * ({w}P + 2P) / bw_inter"},
            {"scheme": "hybrid ZeRO-1" + label, "mesh": f"{R}x{S}", "seconds": intra_s + inter_s,
             "bytes": 4 * P + 12 * P / S, "intra_s": intra_s, "inter_s": inter_s,
             "formula": f"(S-1)/S * ({w}P + 2P) / bw_intra + 2(R-1)/R * {r}P/S / bw_inter"},
        ]

    w = min(wire_bytes, r)
    flat, hybrid_intra, hybrid_inter, rows = zero1(w)
    out = [{"scheme": "DDP", "mesh": f"{N}", "seconds": ddp, "bytes": 16 * P,
            "formula": f"2(N-1)/N * {r}P / bw_inter"}, *rows]
    if w < r:
        out += zero1(r, ", FP32 copy on the wire")[3]
    if muon > 0:
        # fzero.shard_view.whole: each rank sends its shard's share of the matrices, f P / N
        # elements, to the ranks that orthogonalize them (BF16, 2 B) and gets the results back
        # (FP32, 4 B); Muon keeps one FP32 buffer per matrix element where AdamW keeps two.
        f = muon
        out += [
            {"scheme": "flat ZeRO-1 + Muon", "mesh": f"{N}", "seconds": flat + all_to_all_seconds(6 * f * P / N, N, across),
             "bytes": 4 * P + (12 - 4 * f) * P / N,
             "formula": f"flat ZeRO-1 + (N-1)/N * 6 * {f:g}P/N / bw_inter"},
            {"scheme": "hybrid ZeRO-1 + Muon", "mesh": f"{R}x{S}",
             "seconds": hybrid_intra + hybrid_inter + all_to_all_seconds(6 * f * P / S, S, intra),
             "bytes": 4 * P + (12 - 4 * f) * P / S,
             "formula": f"hybrid ZeRO-1 + (S-1)/S * 6 * {f:g}P/S / bw_intra"},
        ]
    return out


def measure_held(P: int, shards: int, replicas: int) -> int:
    """Bytes fzero holds as rank 0 of a simulated ``replicas x shards`` mesh after one step."""
    import torch

    from memory import measure

    return measure(P, shards, torch.device("cpu"), replicas=replicas)["held"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[124e6, 1e9], help="params P")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--intra-GBps", type=float, default=900.0, help="per-GPU bandwidth inside a node, GB/s (NVLink)")
    ap.add_argument("--inter-Gbps", type=float, default=400.0, help="per-GPU bandwidth across nodes, Gbit/s (IB)")
    ap.add_argument("--reduce-dtype", choices=["fp32", "fp16"], default="fp32")
    ap.add_argument("--muon", type=float, default=0.0, metavar="F",
                    help="also the ZeRO-1 schemes with Muon on the fraction F of the params (its matrices; the "
                         "small GPT: 0.985, GPT-2 small: 0.68)")
    ap.add_argument("--measure", action="store_true", help="also measure the bytes held on a simulated mesh")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    intra, inter = args.intra_GBps * 1e9, args.inter_Gbps * 1e9 / 8
    r = 4 if args.reduce_dtype == "fp32" else 2
    rows, results = [], []
    for P in args.sizes:
        for s in schemes(P, args.nodes, args.gpus_per_node, reduce_bytes=r, intra=intra, inter=inter, muon=args.muon):
            held = None
            if args.measure and s["scheme"] in ("flat ZeRO-1", "hybrid ZeRO-1"):
                shards = args.nodes * args.gpus_per_node if s["scheme"] == "flat ZeRO-1" else args.gpus_per_node
                held = measure_held(int(P), shards, args.nodes if s["scheme"] == "hybrid ZeRO-1" else 1)
            rows.append([f"{P:.3g}", s["scheme"], s["mesh"], f"{s['seconds'] * 1e3:.2f}", f"{s['bytes'] / GB:.2f}",
                         "-" if held is None else f"{held / GB:.2f}", s["formula"]])
            results.append({"P": P, **s, "held": held})
    print(f"\n{args.nodes} nodes x {args.gpus_per_node} GPUs; intra-node {args.intra_GBps:g} GB/s, inter-node "
          f"{args.inter_Gbps:g} Gbit/s per GPU; reduce in {args.reduce_dtype}, grads on the wire in FP16, "
          "params FP16\n")
    print(table(rows, ["P", "scheme", "mesh", "comm ms/step", "GiB/rank (formula)", "GiB/rank (held)", "time formula"]))
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": results})
    return results


if __name__ == "__main__":
    main()
