"""What a rank's device and network can do, and how long a collective takes on them.

A call of ``B`` tensor bytes on a group of ``n`` ranks takes ``latency + f * B / bandwidth`` with
the ring factors ``f = 2 (n - 1) / n`` (all-reduce), ``(n - 1) / n`` (all-gather, reduce-scatter,
all-to-all) and 1 (send / recv). Ranks are laid out tp fastest, then cp, dp, pp, so a group's
ranks are consecutive over a span (:func:`group_size_and_span`); a group within one node runs at
the intra-node bandwidth (NVLink), a larger one at the inter-node bandwidth (the NIC per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.plan.layout import Layout


@dataclass(frozen=True)
class Hardware:
    """What a rank's device and network can do."""

    peak_flops: float  # per device, dense, in the compute dtype
    efficiency: float = 0.5  # fraction of peak large matmuls reach (plan/matmul_efficiency.py)
    memory_bw: float = 3.35e12  # bytes/s per device (an H100 SXM's HBM3): smaller matmuls' limit
    gpus_per_node: int = 8
    intra_node_bw: float = 450e9  # bytes/s per device and direction (NVLink)
    inter_node_bw: float = 50e9  # bytes/s per device and direction (one 400 Gb/s NIC per GPU)
    latency_s: float = 5e-6  # per collective call or pipeline message
    shared_cores: float | None = None  # CPU: all ranks share this many cores; None: a device each
    pcie_bw: float = 25e9  # bytes/s per device and direction to its host (optimizer offload)
    host_memory_bw: float = 12.5e9  # bytes/s of host memory a rank's CPU update gets (offload)


def ring_factor(op: str, n: int) -> float:
    """Bytes each rank sends per tensor byte: ring all-reduce, all-gather / reduce-scatter, p2p."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def group_size_and_span(group: str, layout: Layout) -> tuple[int, int]:
    """Ranks in a group and how many consecutive ranks it spans (tp fastest, then cp, dp, pp)."""
    if group == "tp":
        return layout.tp, layout.tp
    if group == "cp":
        return layout.cp, layout.tp * layout.cp
    if group == "cp_a2a":  # consecutive members of a cp group
        return layout.cp_a2a_size, layout.tp * layout.cp_a2a_size
    if group == "cp_ring":  # every cp_a2a_size-th member of a cp group
        return layout.cp // layout.cp_a2a_size, layout.tp * layout.cp
    if group == "dp":
        return layout.dp, layout.tp * layout.cp * layout.dp
    if group == "dp_cp":
        return layout.dp_cp, layout.tp * layout.dp_cp
    if group == "zero_shard":  # consecutive members of a dp x cp group
        return layout.zero_shard_ranks, layout.tp * layout.zero_shard_ranks
    if group == "zero_replica":  # every zero_shard_ranks-th member of a dp x cp group
        return layout.zero_replicas, layout.tp * layout.dp_cp
    if group == "ep":  # consecutive members of a dp x cp group
        return layout.ep, layout.tp * layout.ep
    if group == "edp":  # every ep-th member of a dp x cp group
        return layout.edp, layout.tp * layout.dp_cp
    return 2, layout.world_size  # pp neighbours and the embedding group: across the pipeline


def bandwidth(span: int, hw: Hardware) -> float:
    return hw.intra_node_bw if span <= hw.gpus_per_node else hw.inter_node_bw


def comm_time(layout: Layout, hw: Hardware, key: str, calls: int, nbytes: int) -> float:
    """Seconds of ``calls`` collectives (or messages) ``"group/op"`` moving ``nbytes`` tensor
    bytes in all, on a device of its own."""
    group, _, op = key.partition("/")
    n, span = group_size_and_span(group, layout)
    return calls * hw.latency_s + ring_factor(op, n) * nbytes / bandwidth(span, hw)


def slowdown(layout: Layout, hw: Hardware) -> float:
    """How much slower a rank runs than on a device of its own (ranks sharing fewer cores)."""
    return max(1.0, layout.world_size / hw.shared_cores) if hw.shared_cores else 1.0


def add_volumes(*volumes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The sum of ``{"group/op": (calls, bytes)}`` tables (keys in order of first appearance)."""
    out: dict[str, tuple[int, int]] = {}
    for volume in volumes:
        for key, (calls, nbytes) in volume.items():
            c, b = out.get(key, (0, 0))
            out[key] = (c + calls, b + nbytes)
    return out
