"""Analytic per-iteration runtime model: all-reduce DDP versus decentralized (gossip) training.

The model itself (no command line, plots or SciPy here: see the package's other modules). It
predicts the time of one training iteration for

* all-reduce DDP (gradient all-reduce, bucketed, overlapped with the backward pass only), and
* decentpy's decentralized topologies (``complete``, ``ring``, ``one-peer-exp``,
  ``alternating-exp-ring``), whose parameter exchange of iteration k overlaps the whole
  forward + backward of iteration k+1, uncompressed or with compressed gossip (bf16 / int8 / int4),
* the hybrid modes that shard the model inside a node: HSDP (FSDP HYBRID_SHARD) and decentpy's
  sharded gossip (a topology over the nodes, each node's model sharded over its workers),
  uncompressed or compressed,

together with the consensus rate of each topology (spectral gap) and the published-speedup
scenarios the model is compared with. Siblings in tools/runtime_model/: ``fit.py``
(measurements and calibration of the free parameters), ``plots.py`` (plots), ``cli.py`` (the
command line, run by ``python -m tools.runtime_model``).

Model (alpha-beta, all times in seconds, sizes in bytes)
---------------------------------------------------------
Cluster: N nodes of L workers, n = N * L, rank r lives on node r // L.

* ``intra_bw`` is the per-worker intra-node link bandwidth (NVLink, shared memory): every worker
  of a node can use it at the same time. ``inter_bw`` is the per-NODE network (NIC) bandwidth,
  shared by all the flows leaving that node in the same step. Links are full duplex (sending M
  and receiving M at the same time costs M / bw). ``intra_lat`` / ``inter_lat``: per message.
* Pair exchange (group of 2): send my full model, receive the peer's:
  ``lat + M / bw`` over the link the peer is on; if f cross-node flows leave the same node in
  that step, each inter-node flow gets ``inter_bw / f``.
* All-reduce of M bytes over a group that spans k nodes with l ranks on a node:
  - k == 1: ring all-reduce, ``2 (l-1) intra_lat + 2 (l-1)/l * M / intra_bw``;
  - k > 1, hierarchical (default): intra-node reduce-scatter + all-gather
    (``2 [(l-1) intra_lat + (l-1)/l * M / intra_bw]``) plus an inter-node ring all-reduce in which
    the l local ranks each carry M / l, so each NIC moves ``2 (k-1)/k * M`` in total
    (``2 (k-1) inter_lat + 2 (k-1)/k * M / inter_bw``);
  - ``flat``: one ring over all s ranks, ordered by node: ``2 (s-1) max(lat) +
    2 (s-1)/s * M / min(bw)`` (option for DDP only).
* A step's communication time is the slowest group of that step (all groups run concurrently).

Iteration time (T_c = forward + backward compute, backward = ``backward_fraction`` * T_c):

* decentralized, step t of the topology's period:
  ``T_t = max(T_c, C_t) + (1 - overlap) * min(T_c, C_t) + K_dec``,
  ``K_dec = kernel_traffic_dec * M / mem_bw`` (the fused mix-and-step kernel, not overlapped);
  the iteration time is the mean of T_t over the period (a step's exchange must finish before
  the next step mixes, so slack does not carry over: the mean of the max, not the max of the
  mean). ``complete`` is one all-reduce of the parameters, overlapped like any exchange.
* all-reduce DDP: ``T = F + max(B, A - tail) + (1 - overlap) * min(B, A - tail) + tail + K_ddp``
  with F / B the forward / backward time, A the all-reduce of the M gradient bytes and ``tail``
  the all-reduce of the last bucket (``min(bucket_bytes, M)``), which is ready only when the
  backward ends and so can never overlap; ``K_ddp = kernel_traffic_ddp * M / mem_bw`` (optimizer
  step). With overlap == 1: ``T = F + max(B + tail, A) + K_ddp``.
* ``overlap`` (1.0 on GPUs with a dedicated comm stream) is the fraction of min(compute, comm)
  that is hidden; it is a free parameter of the CPU calibration (gloo and compute share cores).

Hybrid modes (sharding inside a node; b = ``min(bucket_bytes, M)`` is one bucket / FSDP unit;
``RS(x)`` / ``AG(x)`` = ring reduce-scatter / all-gather of x bytes over the L ranks of a node,
half an intra ring all-reduce: ``(L-1) intra_lat + (L-1)/L * x / intra_bw``; ``_bucketed(C, A,
e) = e + max(C, A - e) + (1 - overlap) * min(C, A - e)``: communication A overlapping compute C
except an exposed piece e, the shape of DDP's backward above):

* HSDP (torch FSDP HYBRID_SHARD): parameters, gradients and optimizer state sharded over the L
  ranks of a node, replicated across the N nodes. Forward: ``_bucketed(F, AG(M), AG(b))`` (the
  next unit's parameters are prefetched during the current unit's forward; the first unit's
  all-gather is exposed). Backward: ``_bucketed(B, A_b, RS(b) + X(b))`` with ``A_b = AG(M) +
  RS(M) + X(M)`` (the re-gather of the parameters resharded after the forward, the gradient
  reduce-scatter, and X = the all-reduce of each rank's M / L shard across the N nodes, the L
  such all-reduces of a node sharing its NIC: ``2 (N-1) inter_lat + 2 (N-1)/N * M / inter_bw``);
  link by link these are the same bytes as DDP's hierarchical all-reduce, summed like it (no
  pipelining across links); the last unit's gradient reduce-scatter and all-reduce are exposed.
  Optimizer step: ``kernel_traffic_ddp * M / L / mem_bw``. N == 1: plain intra-node sharding.
* Sharded gossip (decentpy ``intra_node="shard"``): per bucket in the backward the gradients are
  reduce-scattered inside the node (overlapped with the backward like DDP's buckets, last bucket
  exposed); each rank steps its M / L shard with the fused kernel (``kernel_traffic_dec * M / L
  / mem_bw``, mixing in the shards received in the previous exchange) and exchanges the updated
  shard with the same-shard ranks of the peer node(s) chosen by the topology run over the N
  nodes; the updated shards are all-gathered inside the node before the next forward, with the
  same prefetch as HSDP's forward (first bucket exposed). The exchange overlaps everything
  between two steps: ``T_t = max(W, C_t) + (1 - overlap) * min(W, C_t) + K_shard`` with ``W =
  _bucketed(F, AG(M), AG(b)) + _bucketed(B, RS(M), RS(b))``. ``C_t``: the topology's step
  costed over N nodes of one rank (``complete``, ``ring``, ``one-peer-exp`` over N nodes;
  ``alternating-exp-ring``: its node pairing, whose groups inside one node vanish, since the L
  shards of a node form one model that the gradient reduce-scatter already averages). One rank
  per node stands for the L concurrent same-shard flows of M / L each: the same NIC bytes and
  message count. So the node's NIC moves M per pair exchange: L times less than plain
  ``one-peer-exp`` (whose L workers each send a full model), as much as plain AER (whose
  cross-node step is a hierarchical all-reduce over the 2 nodes), which however also carries an
  intra-node reduce-scatter and all-gather and one more latency inside its exchange. The
  exchange (NIC) and the all-gather / reduce-scatter (intra link) use different links, so they
  overlap. L == 1: plain gossip.

Compressed gossip (decentpy ``compression="int8"`` / ``"int4"`` / ``"bf16"``, CHOCO-style;
docs/compression.md; byte counts from decentpy.optim.compression, the model restates none):

* Pairs (m == 2): one message each way of ``W = decentpy.optim.compression.wire_bytes(kind, M / 4)``
  where uncompressed gossip sends M (bf16 M / 2; int8 ``4 ceil(n / 256) + n`` for n = M / 4
  elements, 0.254 M; the model is taken as one run of int8 blocks: the partial block ending each
  real bucket adds at most 4 bytes per bucket), costed as the uncompressed pair.
* A group of m > 2 ranks is no all-reduce: a reduce-scatter and an all-gather of compressed
  chunks, point to point. The ``ceil(n / 256)`` scale blocks are split into m chunks
  (``decentpy.optim.compression.chunk_bounds``). Round 1: each member sends chunk c of its q to member c
  and receives the other members' bytes of its own chunk (m - 1 messages each way, ~W / m each);
  the owner reduces its chunk; round 2: it sends its reduced chunk to each of the m - 1 others and
  receives theirs. The busiest member (the owner of the largest chunk) sends ``S =
  decentpy.optim.compression.group_wire_bytes(kind, n, m, position)`` bytes (~``2 (m - 1) / m W``) in
  2 (m - 1) messages, each taken as ``s = S / (2 (m - 1))``. Round 2 starts only once round 1 has
  arrived, so a group's time is two rounds, each with the intra and the inter messages in flight
  together (the max of the two, not the sum): a member with l - 1 other members on its node and m
  - l elsewhere costs ``2 max((l - 1) (intra_lat + s / intra_bw), (m - l) inter_lat + NIC /
  inter_bw)``, its node's NIC carrying ``sum over the node's groups of l (m - l) s`` per round (one
  latency per message, as for a pair). The middle step runs on a helper thread, so the exchange
  overlaps compute like any other. Per node and step, AER's node-pair group of 2L ranks puts ``2
  L^2 s ~ L W`` through each NIC, against the hierarchical all-reduce's ``2 (k - 1) / k M = M``:
  int8 AER moves more NIC bytes than fp32 AER when ``L * 0.254 > 1``, i.e. for L >= 4 (8 GPUs per
  node: 2.03 M), fewer for L <= 3, and pays 2L inter-node latencies against 2.
* Kernels: the fused compressing pass, the same for a pair and a group, moves
  ``kernel_traffic_choco * M + 2 W`` bytes (the step's p, g, m, v and the tracked copies, fp32: a
  pair's two copies, or the group's mean and this rank's public copy in the group; the q (or the
  reduced r) received and the q sent). A group of m > 2 adds the owner's reduction of its chunk of
  c elements (the largest): it reads the m members' chunk wires and writes the reduced one, ``(m +
  1) wire_bytes(kind, c)``, and reads and writes its fp32 copy's chunk, ``8 c`` (~``(m + 1) / m W
  + 2 M / m``; int8, m = 16: 0.39 M against the pass's 12.5 M). It runs between the rounds on the
  helper thread; the model counts it with the pass, not hidden. A step's kernel time is that over
  ``mem_bw`` for its largest group. These are memory-bound passes, counted like
  ``kernel_traffic_dec``: 1.56x (int8) / 1.63x (bf16) the uncompressed pass, more than the 1.28x /
  1.20x measured on a 2-core CPU (bench_kernels: 17.9 / 16.8 ms against 14.0 ms for a 25 MiB
  bucket, not purely bandwidth-bound there).
* Memory (reported, not timed): 2 fp32 copies of the model per distinct pair partner and 2 per
  distinct group of m > 2 over the period (decentpy's CompressedGossip.memory_bytes); AER over N =
  2^r nodes of L >= 3: its node, and r node pairs, ``2 (1 + r)`` copies.
* Sharded compressed gossip (``intra_node="shard"`` with ``compression=``, decentpy's
  CompressedNodeShard): the node's reduce-scatter and all-gather stay exact and are costed as in
  sharded gossip above (same window); rank l of a node exchanges its shard, compressed, with rank
  l of each other node of its node group, as plain compressed gossip over ranks: a pair of nodes
  one message of ``W_s = wire_bytes(kind, M / 4 / L)`` each way, a group of k > 2 nodes the two
  rounds of chunks of the shard (buckets are padded to a multiple of L elements; the model is one
  run of int8 blocks). As for uncompressed sharded gossip, one rank per node stands for the node's
  L concurrent flows: the node topology's rows with L times each rank's bytes through the NIC
  (int8 pair of nodes: 0.254 M, where uncompressed sharded gossip puts M). Kernels: the
  compressing pass (and a group's reduction) above on the shard, ``M / L`` bytes, for the step's
  largest node group (k = 1, no exchange: the uncompressed fused step on the shard). Memory: 2
  fp32 copies of the shard (``M / L``) per distinct partner node and 2 per distinct node group.
  L == 1: plain compressed gossip. The node-allreduce variant (``intra_node="allreduce"``) is not
  modelled, compressed or not.
* Not modelled, refused like decentpy refuses them: compression with DDP / HSDP (no gossip). The
  consensus rate is taken as uncompressed (``gamma = 1`` with bf16 / int8: docs/compression.md's
  runs end at the same consensus distance; a group's re-quantised mean is not modelled either).

Local steps (decentpy ``DecentralizedDataParallel(local_steps=H)``: DiLoCo on ``complete``, a gossip
outer step on any other topology; docs/guide/local_sgd.md):

* H - 1 inner iterations exchange nothing: ``T_in = T_c + K_in`` with ``K_in = kernel_traffic_ddp *
  M / mem_bw`` (the fused inner Adam step inside the backward, nothing mixed, not hidden).
* The H-th: each bucket's pseudo-gradient starts its outer exchange after its inner step and
  overlaps only the rest of that backward (it must complete before the next forward): DDP's shape,
  ``T_out,t = F + _bucketed(B, X_t(M), X_t(b)) + K_in + K_out``, X_t(x) the outer exchange of a
  model of x bytes at the outer step t (outer step k runs the topology's step k mod period), b =
  ``min(bucket_bytes, M)`` the last bucket, exposed. ``K_out = kernel_traffic_outer * M / mem_bw``
  (pseudo-gradient and outer optimizer), plus ``kernel_traffic_outer_mix * M / mem_bw`` for a gossip
  outer step's mix, plus the int8 passes below. Mean iteration: ``((H - 1) T_in + mean_t T_out,t) /
  H``; with overlap == 1 the outer step exposes ``b's exchange + max(0, X - b's - B)``. A window of
  iterations that is not whole periods (a measured one): the iterations c that are multiples of H
  are outer steps (the c / H-th, topology step ``(c / H - 1) mod period``), the rest inner ones.
* X_t: ``complete`` (DiLoCo): the hierarchical all-reduce of the M-byte pseudo-gradient (the global
  copies are equal everywhere and stay home). Another topology (gossip DiLoCo): the buffer [theta;
  delta], 2M bytes, mixed with the group of step t, costed as uncompressed gossip of 2M (pairs point
  to point, M -> 2M each way: twice DiLoCo's bytes; groups the hierarchical all-reduce).
* ``compression="int8"`` of the outer exchange, two paths (``node_level``). The node-level path
  (``node_level=True``, the default and the tables at scale): on ``complete`` and
  ``alternating-exp-ring``, whose groups are whole nodes, exact in the node and int8 across: the fp32
  ring reduce-scatter of the buffer over the node's L ranks, each rank's 1/L shard exchanged int8
  with the same shard of the group's other nodes (sharded compressed gossip's node rows: a pair of
  nodes one message of ``wire_bytes(x / 4 / L)`` each way, a group of k > 2 nodes -- all N for
  ``complete`` -- the two rounds of compressed chunks; L flows per NIC, 0.254x the fp32 NIC bytes),
  the fp32 all-gather in the node: ``X = allreduce_time(x, L, L) + node rows``; other topologies as
  below. decentpy's ``intra_node="shard"`` with ``local_steps`` and compression is the nearest
  implementation (each rank's shard int8 across the nodes, without the fp32 reduce-scatter: the
  node's ranks hold the same parameters). The replicas' path (``node_level=False``) is what decentpy
  runs with every rank a replica (``DecentralizedDataParallel(local_steps=H, compression="int8")``,
  ``intra_node="gossip"``, measured by bench-lm): on ``complete`` the error-fed int8
  pseudo-gradients through compressed gossip's two-round group exchange over all n ranks, on a
  gossip topology compressed gossip (CHOCO) of the buffer [theta; delta]; both costed as every-step
  compressed gossip of the buffer on the topology's groups of ranks (point to point: pairs one wire
  each way, a group of m > 2 the two rounds of chunks; on ``complete`` at L = 2 and N = 2, 2 W
  through each NIC, 0.51x the fp32 all-reduce's M, where the node-level path puts 0.254 M).
  Kernels: error feedback, quantise and dequantise, ``4 y + 2 wire_bytes(y)`` per compressed y bytes
  of a rank (its shard on the node-level path, the whole buffer on the replicas' path).
* Compute utilisation ``= T_solo / T``, ``T_solo = T_c + K_in``: the share of an iteration that one
  GPU alone would also spend (forward, backward, its Adam step), so it tends to 1 as H grows.
  :func:`bandwidth_for_utilisation` bisects (on a log scale) the per-node NIC speed at which a mode
  reaches a target utilisation on :func:`gpu_hardware`'s cluster (iteration time never grows with
  bandwidth). Not modelled: the outer optimizer's effect on convergence (how large H may be),
  Streaming DiLoCo's fragments, ``fragment_sync_delay``.

Consensus: ``gap`` = 1 - |lambda_2| of the period-averaged mixing matrix, from
``decentpy.topology`` for n <= ``EXACT_GAP_MAX_N`` and from closed forms beyond (checked equal
in the tests): complete 1, ring (1 - cos(2 pi / n)) / 2 (n even), one-peer-exp 1 / log2(n)
(n = 2^r), alternating-exp-ring 1 / (2 log2 N) (N = 2^r; on node-constant vectors the averaged
matrix is 3/4 I + 1/(4r) sum_t P_t over the hypercube matchings P_t, eigenvalues 1 - j/(2r);
within-node disagreement is removed exactly every step). Sizes without a closed form (odd rings,
other n or N) are computed by ``decentpy.topology`` at any n. Iterations to cut the consensus distance 10x:
``ln(10) / -ln(1 - gap)`` (~ ln(10) / gap for small gaps; 1 when gap == 1).

Topology schedules and their validity come from ``decentpy.topology`` (importing it loads the
compiled extension, so decentpy must be built). Run ``python -m tools.runtime_model --help``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from decentpy.optim.compression import Compression, chunk_bounds, group_wire_bytes, wire_bytes
from decentpy.topology import Topology, TopologyError, make_topology, node_topology

__all__ = [
    "TOPOLOGIES",
    "GBIT",
    "Hardware",
    "Workload",
    "topology_valid",
    "topology_rows",
    "step_comm_times",
    "allreduce_time",
    "decentralized_iteration_time",
    "ddp_iteration_time",
    "hsdp_iteration_time",
    "sharded_topology_valid",
    "node_topology_rows",
    "sharded_gossip_iteration_time",
    "iteration_times",
    "exchange_bytes",
    "largest_chunk",
    "compressed_send_bytes",
    "compressed_topology_rows",
    "compressed_node_topology_rows",
    "choco_kernel_time",
    "step_group_sizes",
    "compressed_copies",
    "sharded_compressed_copies",
    "node_group_sizes",
    "COMPRESSION_MODES",
    "SHARD_PREFIX",
    "mode_name",
    "compression_table",
    "HYBRID_MODES",
    "hybrid_iteration_times",
    "hybrid_workloads",
    "hybrid_table",
    "gpu_hardware",
    "spectral_gap",
    "closed_form_gap",
    "iterations_to_10x",
    "EXACT_GAP_MAX_N",
    "Scenario",
    "published_scenarios",
    "published_table",
    "PUBLISHED_RANGE",
    "outer_exchange_times",
    "outer_kernel_time",
    "local_steps_iteration_time",
    "local_steps_step_times",
    "local_steps_window_time",
    "diloco_iteration_time",
    "gossip_diloco_iteration_time",
    "solo_iteration_time",
    "compute_utilisation",
    "LocalStepsMode",
    "LOCAL_STEPS_MODES",
    "LOCAL_STEPS_GPUS",
    "LOCAL_STEPS_TARGETS",
    "LOCAL_STEPS_GBPS",
    "local_steps_workload",
    "utilisation_at",
    "bandwidth_for_utilisation",
    "local_steps_table",
]

TOPOLOGIES: Tuple[str, ...] = ("complete", "ring", "one-peer-exp", "alternating-exp-ring")
EXACT_GAP_MAX_N = 512
PUBLISHED_RANGE = (1.2, 2.8)
GBIT = 1e9 / 8  # bytes/s in one Gb/s

# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """Link and memory parameters. Bandwidths in bytes/s, latencies in seconds."""

    intra_bw: float = 100 * GBIT  # per worker
    inter_bw: float = 25 * GBIT  # per node (NIC shared by the node's L workers)
    intra_lat: float = 10e-6
    inter_lat: float = 10e-6
    mem_bw: float = 900e9  # achieved bandwidth of the fused mix/step kernel
    overlap: float = 1.0  # fraction of min(compute, comm) hidden behind the other


@dataclass(frozen=True)
class Workload:
    """One model on one worker."""

    model_bytes: float  # bytes of parameters (= bytes exchanged / all-reduced per step)
    compute_s: float  # forward + backward of one iteration
    backward_fraction: float = 2.0 / 3.0
    bucket_bytes: float = 25e6  # DDP bucket_cap_mb
    # Bytes moved per parameter byte. Fused mix+Adam step: read p, c, g, m, v; write p, m, v.
    kernel_traffic_dec: float = 8.0
    # DDP Adam step: read p, g, m, v; write p, m, v.
    kernel_traffic_ddp: float = 7.0
    # Compressed gossip's fused pass (csrc/kernels/mix_and_step.h), fp32 only: the Adam step's
    # p, g, m, v (7, no c) plus the tracked copies: the peer's copy or the group's mean (read,
    # write), this rank's for the mix (read) and for the next send (read, write). The q (or r)
    # received and the q sent add 2 W; a group's chunk reduction is counted apart (no parameter).
    kernel_traffic_choco: float = 12.0
    # Local steps' outer step (fp32, per outer step): the pseudo-gradient delta = theta - x (read
    # 2, write 1), the outer Nesterov SGD from the global copy (read p, g, buf; write buf, p) and
    # the parameters set to the result, kept as the new global copy (read 1, write 2).
    kernel_traffic_outer: float = 11.0
    # A gossip outer step's mix of the buffer [theta; delta] with its group's (read own 2 and
    # received 2, write 2); DiLoCo's all-reduce reduces inside the collective.
    kernel_traffic_outer_mix: float = 6.0


# ----------------------------------------------------------------------------------------------
# topologies (decentpy's own schedules and validity rules)
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _build_topology(name: str, n: int, local: int) -> Optional[Topology]:
    """decentpy's topology, or None where decentpy refuses the sizes.

    Cached: the model asks about the same few sizes many times, and building (and validating) a
    schedule of thousands of ranks is not free.
    """
    if name not in TOPOLOGIES:  # the cost rows and closed forms exist for these only
        raise ValueError(f"unknown topology {name!r}; valid: {', '.join(TOPOLOGIES)}")
    try:
        return make_topology(name, n, local)
    except TopologyError:
        return None


def topology_valid(name: str, n: int, local: int) -> bool:
    """Whether decentpy can build topology ``name`` for ``n`` workers, ``local`` per node."""
    return _build_topology(name, n, local) is not None


# Each group of a step is reduced to a cost row (c_intra_lat, c_intra_byte, c_inter_lat,
# c_inter_byte): its time is c0 * intra_lat + c1 * M / intra_bw + c2 * inter_lat + c3 * M /
# inter_bw. A step costs the max over its rows; rows depend only on (topology, n, L).


def _allreduce_row(size: int, nodes: int, per_node: int, nic_units: float) -> Tuple[float, ...]:
    if size <= 1:
        return (0.0, 0.0, 0.0, 0.0)
    if nodes == 1:
        return (2.0 * (size - 1), 2.0 * (size - 1) / size, 0.0, 0.0)
    l = per_node
    intra = (2.0 * (l - 1), 2.0 * (l - 1) / l) if l > 1 else (0.0, 0.0)
    return (intra[0], intra[1], 2.0 * (nodes - 1), nic_units)


def _group_rows(groups: Sequence[Tuple[int, ...]], local: int) -> np.ndarray:
    """Cost rows of one step of uncompressed gossip; ``groups`` are tuples of ranks (pairs: one
    exchange of M each way; larger groups: the hierarchical all-reduce)."""
    nic: Dict[int, float] = {}  # node -> inter-node bytes through its NIC, in units of M
    shapes = []
    for ranks in groups:
        per_node: Dict[int, int] = {}
        for r in ranks:
            per_node[r // local] = per_node.get(r // local, 0) + 1
        k = len(per_node)
        shapes.append((len(ranks), per_node))
        if k > 1:
            for node in per_node:
                nic[node] = nic.get(node, 0.0) + (1.0 if len(ranks) == 2 else 2.0 * (k - 1) / k)
    rows = set()
    for size, per_node in shapes:
        k = len(per_node)
        if size == 1:
            continue
        worst = max(nic.get(node, 0.0) for node in per_node)
        if size == 2:
            rows.add((1.0, 1.0, 0.0, 0.0) if k == 1 else (0.0, 0.0, 1.0, worst))
        else:
            rows.add(_allreduce_row(size, k, max(per_node.values()), worst))
    if not rows:
        rows.add((0.0, 0.0, 0.0, 0.0))
    return np.array(sorted(rows), dtype=np.float64)


@lru_cache(maxsize=1024)
def largest_chunk(numel: int, members: int) -> Tuple[int, int]:
    """(position, elements) of the largest chunk of a bucket of ``numel`` in a compressed group
    exchange of ``members`` ranks (decentpy.optim.compression.chunk_bounds; the first such position)."""
    sizes = [hi - lo for lo, hi in (chunk_bounds(numel, members, p) for p in range(members))]
    big = max(sizes)
    return sizes.index(big), big


@lru_cache(maxsize=1024)
def compressed_send_bytes(kind: str, numel: int, members: int) -> int:
    """Bytes the busiest member sends in one compressed exchange of ``numel`` fp32 elements within
    a group of ``members`` ranks: a pair, one wire (decentpy.optim.compression.wire_bytes); a larger
    group, decentpy.optim.compression.group_wire_bytes of the owner of the largest chunk (its round-2
    sends are the largest, its round-1 sends the same total as anyone's); a lone rank, nothing."""
    if members < 2:
        return 0
    if members == 2:
        return wire_bytes(kind, numel)
    return group_wire_bytes(kind, numel, members, largest_chunk(numel, members)[0])


def _compressed_group_rows(groups: Sequence[Tuple[int, ...]], local: int, kind: str,
                           numel: int) -> np.ndarray:
    """Cost rows of one step of compressed gossip, in bytes (unit cost vector: 1 byte). A pair:
    one message of W each way. A group of m > 2: two rounds of one message to each other member,
    each of s = compressed_send_bytes / (2 (m - 1)) bytes; per node of a group with l members,
    an intra row ``(2 (l-1), 2 (l-1) s, 0, 0)`` and an inter row ``(0, 0, 2 (m-l), NIC)``, the
    NIC carrying ``2 l (m - l) s`` per such group of the step (intra and inter messages in flight
    together: separate rows, the max; both rounds alike: twice one round)."""
    nic: Dict[int, float] = {}  # node -> bytes through its NIC in the step (each way)
    shapes = []
    for ranks in groups:
        size = len(ranks)
        if size < 2:
            continue
        per_node: Dict[int, int] = {}
        for r in ranks:
            per_node[r // local] = per_node.get(r // local, 0) + 1
        rounds = 1 if size == 2 else 2
        msg = compressed_send_bytes(kind, numel, size) / (rounds * (size - 1))
        shapes.append((size, per_node, rounds, msg))
        for node, l in per_node.items():
            if size > l:
                nic[node] = nic.get(node, 0.0) + rounds * l * (size - l) * msg
    rows = set()
    for size, per_node, rounds, msg in shapes:
        for node, l in per_node.items():
            if l > 1:
                rows.add((float(rounds * (l - 1)), rounds * (l - 1) * msg, 0.0, 0.0))
            if size > l:
                rows.add((0.0, 0.0, float(rounds * (size - l)), nic[node]))
    if not rows:
        rows.add((0.0, 0.0, 0.0, 0.0))
    return np.array(sorted(rows), dtype=np.float64)


def _valid_topology(name: str, n: int, local: int) -> Topology:
    topo = _build_topology(name, n, local)
    if topo is None:
        raise ValueError(f"topology {name!r} is not valid for n={n}, L={local}")
    return topo


@lru_cache(maxsize=256)
def topology_rows(name: str, n: int, local: int) -> Tuple[np.ndarray, ...]:
    """Per step of the period, the cost rows of uncompressed ``name`` on n workers, ``local`` per
    node (in units of the model's bytes)."""
    topo = _valid_topology(name, n, local)
    if name == "complete":  # one group: the hierarchical all-reduce row, no walk
        nodes = n // local
        return (np.array([_allreduce_row(n, nodes, local, 2.0 * (nodes - 1) / nodes)]),)
    return tuple(_group_rows([g.ranks for g in topo.groups(t)], local) for t in range(topo.period))


@lru_cache(maxsize=256)
def compressed_topology_rows(name: str, n: int, local: int, kind: str,
                             numel: int) -> Tuple[np.ndarray, ...]:
    """Per step of the period, the cost rows of compressed gossip (``kind``) on ``name``, n
    workers, ``local`` per node, exchanging ``numel`` fp32 elements: point-to-point pairs and the
    two rounds of a group's chunks, in bytes (module docstring)."""
    topo = _valid_topology(name, n, local)
    return tuple(_compressed_group_rows([g.ranks for g in topo.groups(t)], local, kind, numel)
                 for t in range(topo.period))


@lru_cache(maxsize=256)
def step_group_sizes(name: str, n: int, local: int) -> Tuple[int, ...]:
    """Per step of the period, the size of the step's largest group (its slowest rank's kernel
    passes in compressed gossip)."""
    topo = _valid_topology(name, n, local)
    return tuple(max(g.size for g in topo.groups(t)) for t in range(topo.period))


def _copies_of_rank0(topo: Topology) -> int:
    """Two per distinct pair partner of rank 0 over the period (its own public copy as the partner
    knows it, the partner's) and two per distinct group of more than two ranks (its own public
    copy in the group, the group's mean): the copies term of decentpy's
    CompressedGossip.memory_bytes."""
    partners, groups = set(), set()
    for t in range(topo.period):
        ranks = tuple(topo.group_of(0, t).ranks)
        if len(ranks) == 2:
            partners.add(ranks[0] if ranks[1] == 0 else ranks[1])
        elif len(ranks) > 2:
            groups.add(ranks)
    return 2 * (len(partners) + len(groups))


def compressed_copies(name: str, n: int, local: int) -> int:
    """fp32 copies of the model that compressed gossip keeps beside it on rank 0 (two per distinct
    pair partner, two per distinct group of m > 2; :func:`_copies_of_rank0`). Every rank alike on
    full nodes of powers of two, the sizes of the tables."""
    return _copies_of_rank0(_valid_topology(name, n, local))


def _flat_allreduce_row(n: int, local: int) -> np.ndarray:
    """Flat ring over all n ranks (ordered by node); costs in the slowest link's terms."""
    if n <= 1:
        return np.zeros(4)
    return np.array([0.0, 0.0, 2.0 * (n - 1), 2.0 * (n - 1) / n])  # see _cost_vector(flat=True)


def _cost_vector(hw: Hardware, nbytes: float, flat: bool = False) -> np.ndarray:
    if flat:
        return np.array(
            [0.0, 0.0, max(hw.intra_lat, hw.inter_lat), nbytes / min(hw.intra_bw, hw.inter_bw)]
        )
    return np.array([hw.intra_lat, nbytes / hw.intra_bw, hw.inter_lat, nbytes / hw.inter_bw])


def _compression_kind(compression: Optional[str]) -> Optional[str]:
    """``compression`` checked by decentpy's own rules (None: uncompressed)."""
    return None if compression is None else Compression(compression).kind


def _numel(model_bytes: float) -> int:
    """fp32 elements of ``model_bytes`` (the model as one bucket, one run of int8 blocks: each
    real bucket's partial last block adds at most 4 bytes)."""
    return int(round(model_bytes / 4))


def exchange_bytes(compression: Optional[str], model_bytes: float) -> float:
    """Bytes one exchange of the model with one peer (a pair) puts on the wire: ``model_bytes``
    without compression, else decentpy.optim.compression.wire_bytes of its fp32 elements."""
    kind = _compression_kind(compression)
    if kind is None:
        return model_bytes
    return float(wire_bytes(kind, _numel(model_bytes)))


def step_comm_times(name: str, n: int, local: int, model_bytes: float, hw: Hardware,
                    compression: Optional[str] = None) -> np.ndarray:
    """Communication time of every step of the topology's period (seconds); ``compression``
    ('bf16', 'int8', 'int4'): compressed gossip's point-to-point pairs and group rounds."""
    kind = _compression_kind(compression)
    if kind is None:
        return _step_times(topology_rows(name, n, local), model_bytes, hw)
    return _step_times(compressed_topology_rows(name, n, local, kind, _numel(model_bytes)), 1.0, hw)


def _step_times(steps: Sequence[np.ndarray], model_bytes: float, hw: Hardware) -> np.ndarray:
    """Each step's cost: its slowest group (all groups run at once)."""
    v = _cost_vector(hw, model_bytes)
    return np.array([float(np.max(rows @ v)) for rows in steps])


def allreduce_time(
    nbytes: float, n: int, local: int, hw: Hardware, algorithm: str = "hierarchical"
) -> float:
    """All-reduce of ``nbytes`` over n workers (``hierarchical`` or ``flat`` ring)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "flat":
        if n == local:  # one node: the flat ring is the intra ring
            return float(topology_rows("complete", n, local)[0][0] @ _cost_vector(hw, nbytes))
        return float(_flat_allreduce_row(n, local) @ _cost_vector(hw, nbytes, flat=True))
    if algorithm != "hierarchical":
        raise ValueError(f"algorithm must be 'hierarchical' or 'flat', got {algorithm!r}")
    return float(topology_rows("complete", n, local)[0][0] @ _cost_vector(hw, nbytes))


def _overlapped(a: float, b: float, overlap: float) -> float:
    return max(a, b) + (1.0 - overlap) * min(a, b)


def choco_kernel_time(group: int, compression: str, wl: Workload, hw: Hardware) -> float:
    """Seconds of compressed gossip's kernel passes at a step whose group has ``group`` ranks: the
    fused compressing pass (a pair or a group alike), plus for a group of more than two the
    owner's reduction of its (largest) chunk of c elements, ``(m + 1)`` chunk wires and ``8 c``
    bytes of its fp32 copy (memory-bound passes, like the uncompressed fused step; a lone rank:
    that fused step)."""
    if group < 2:
        return wl.kernel_traffic_dec * wl.model_bytes / hw.mem_bw
    kind = _compression_kind(compression)
    assert kind is not None, "choco_kernel_time needs a compression kind"
    numel = _numel(wl.model_bytes)
    traffic = wl.kernel_traffic_choco * wl.model_bytes + 2.0 * wire_bytes(kind, numel)
    if group > 2:
        c = largest_chunk(numel, group)[1]
        traffic += (group + 1) * wire_bytes(kind, c) + 8.0 * c
    return traffic / hw.mem_bw


def decentralized_iteration_time(
    name: str, n: int, local: int, wl: Workload, hw: Hardware, compression: Optional[str] = None
) -> Tuple[float, float]:
    """(mean iteration time, mean communication time) over the topology's period; ``compression``
    ('bf16', 'int8'): compressed gossip (its bytes and kernel passes, module docstring)."""
    comm = step_comm_times(name, n, local, wl.model_bytes, hw, compression)
    if _compression_kind(compression) is None:
        kernels = [wl.kernel_traffic_dec * wl.model_bytes / hw.mem_bw] * len(comm)
    else:
        kernels = [choco_kernel_time(m, compression, wl, hw)
                   for m in step_group_sizes(name, n, local)]
    per_step = [_overlapped(wl.compute_s, c, hw.overlap) + k for c, k in zip(comm, kernels)]
    return float(np.mean(per_step)), float(np.mean(comm))


def _bucketed(compute: float, comm: float, exposed: float, overlap: float) -> float:
    """Compute and bucketed communication: all but the ``exposed`` bucket (the one that cannot
    start before the compute ends, or that the compute must wait for) overlaps the compute."""
    return _overlapped(compute, max(comm - exposed, 0.0), overlap) + exposed


def _fwd_bwd(wl: Workload) -> Tuple[float, float]:
    return (1.0 - wl.backward_fraction) * wl.compute_s, wl.backward_fraction * wl.compute_s


def ddp_iteration_time(
    n: int, local: int, wl: Workload, hw: Hardware, algorithm: str = "hierarchical"
) -> Tuple[float, float]:
    """(iteration time, all-reduce time) of all-reduce DDP."""
    fwd, bwd = _fwd_bwd(wl)
    full = allreduce_time(wl.model_bytes, n, local, hw, algorithm)
    tail = allreduce_time(min(wl.bucket_bytes, wl.model_bytes), n, local, hw, algorithm)
    kernel = wl.kernel_traffic_ddp * wl.model_bytes / hw.mem_bw
    return fwd + _bucketed(bwd, full, tail, hw.overlap) + kernel, full


# ----------------------------------------------------------------------------------------------
# hybrid modes: sharding inside a node (see the module docstring)
# ----------------------------------------------------------------------------------------------


def _intra_shard_time(nbytes: float, local: int, hw: Hardware) -> float:
    """Ring reduce-scatter (or all-gather) of ``nbytes`` over one node's L ranks: half a ring
    all-reduce, which is a reduce-scatter followed by an all-gather."""
    return 0.5 * allreduce_time(nbytes, local, local, hw)


def _check_nodes(n: int, local: int) -> int:
    if local < 1 or n % local:
        raise ValueError(f"n={n} is not a multiple of L={local}")
    return n // local


def hsdp_iteration_time(n: int, local: int, wl: Workload, hw: Hardware) -> Tuple[float, float]:
    """(iteration time, communication time) of HSDP: shard over the L ranks of a node, all-reduce
    the shards across the N nodes."""
    nodes = _check_nodes(n, local)
    fwd, bwd = _fwd_bwd(wl)
    m, b = wl.model_bytes, min(wl.bucket_bytes, wl.model_bytes)
    gather, head = _intra_shard_time(m, local, hw), _intra_shard_time(b, local, hw)
    # the shard all-reduces across nodes: L flows of M / L per NIC = one all-reduce of M over
    # N nodes of one rank
    across, across_tail = allreduce_time(m, nodes, 1, hw), allreduce_time(b, nodes, 1, hw)
    backward_comm = gather + _intra_shard_time(m, local, hw) + across  # AG + RS + X
    tail = _intra_shard_time(b, local, hw) + across_tail
    kernel = wl.kernel_traffic_ddp * m / local / hw.mem_bw
    t = (_bucketed(fwd, gather, head, hw.overlap) + _bucketed(bwd, backward_comm, tail, hw.overlap)
         + kernel)
    return t, gather + backward_comm


def sharded_topology_valid(name: str, nodes: int) -> bool:
    """Whether topology ``name`` can run over ``nodes`` nodes in sharded gossip (decentpy's rules
    on the nodes: AER needs >= 2 nodes, whatever L)."""
    if name == "alternating-exp-ring":
        return topology_valid(name, 2 * nodes, 2)
    return topology_valid(name, nodes, 1)


@lru_cache(maxsize=256)
def _node_topology(name: str, nodes: int) -> Topology:
    """decentpy's topology over the nodes (decentpy.topology.node_topology: AER's node pairing)."""
    if not sharded_topology_valid(name, nodes):
        raise ValueError(f"topology {name!r} is not valid over {nodes} nodes")
    return node_topology(name, nodes)


@lru_cache(maxsize=256)
def node_topology_rows(name: str, nodes: int) -> Tuple[np.ndarray, ...]:
    """Per step, the cost rows of ``name`` run over the nodes (one rank per node: the node's L
    same-shard flows of M / L each put the same bytes and messages on its NIC)."""
    if not sharded_topology_valid(name, nodes):
        raise ValueError(f"topology {name!r} is not valid over {nodes} nodes")
    if name != "alternating-exp-ring":
        return topology_rows(name, nodes, 1)
    # AER's node pairing (a cross-node group of 2L ranks becomes the 2 nodes, a group inside a
    # node the node alone: no exchange)
    topo = _node_topology(name, nodes)
    return tuple(_group_rows([g.ranks for g in topo.groups(t)], 1) for t in range(topo.period))


@lru_cache(maxsize=256)
def compressed_node_topology_rows(name: str, nodes: int, kind: str,
                                  numel: int) -> Tuple[np.ndarray, ...]:
    """Per step, the cost rows of sharded compressed gossip's exchange (``kind``, a shard of
    ``numel`` fp32 elements per rank) over the nodes, in bytes of one rank's flow: one rank per
    node stands for the node's L same-shard flows (scale the bytes by L for the NIC)."""
    topo = _node_topology(name, nodes)
    return tuple(_compressed_group_rows([g.ranks for g in topo.groups(t)], 1, kind, numel)
                 for t in range(topo.period))


@lru_cache(maxsize=256)
def node_group_sizes(name: str, nodes: int) -> Tuple[int, ...]:
    """Per step of the node topology's period, the most nodes in one of its groups (the kernel
    passes of sharded compressed gossip's slowest rank)."""
    topo = _node_topology(name, nodes)
    return tuple(max(g.size for g in topo.groups(t)) for t in range(topo.period))


def sharded_compressed_copies(name: str, nodes: int) -> int:
    """fp32 copies of the shard (1/L of the model) that sharded compressed gossip keeps beside it
    on rank 0: two per distinct partner node and two per distinct group of more than two nodes
    over the period (rank l's groups are the ranks l of those nodes; the copies term of decentpy's
    CompressedNodeShard.memory_bytes)."""
    return _copies_of_rank0(_node_topology(name, nodes))


def sharded_gossip_iteration_time(
    name: str, n: int, local: int, wl: Workload, hw: Hardware, compression: Optional[str] = None
) -> Tuple[float, float]:
    """(mean iteration time, mean inter-node exchange time) of sharded gossip: topology ``name``
    over the N nodes, each node's model sharded over its L ranks. ``compression`` ('bf16',
    'int8', 'int4'): decentpy's CompressedNodeShard, each rank's shard exchanged compressed, point
    to point, with the same shard of every other node of its node group (a pair of nodes: one
    message; more: the group's two rounds of chunks; module docstring)."""
    kind = _compression_kind(compression)
    nodes = _check_nodes(n, local)
    fwd, bwd = _fwd_bwd(wl)
    m, b = wl.model_bytes, min(wl.bucket_bytes, wl.model_bytes)
    full, one = _intra_shard_time(m, local, hw), _intra_shard_time(b, local, hw)
    # between two steps, what the exchange overlaps: the parameter all-gather with the forward,
    # the gradient reduce-scatter with the backward (both one bucket exposed)
    window = _bucketed(fwd, full, one, hw.overlap) + _bucketed(bwd, full, one, hw.overlap)
    if kind is None:
        comm = _step_times(node_topology_rows(name, nodes), m, hw)
        kernels = [wl.kernel_traffic_dec * m / local / hw.mem_bw] * len(comm)
    else:
        # the node's L ranks each exchange their compressed shard, all at once: L flows per NIC
        rows = compressed_node_topology_rows(name, nodes, kind, _numel(m / local))
        comm = _step_times(rows, float(local), hw)
        shard = replace(wl, model_bytes=m / local)
        kernels = [choco_kernel_time(k, kind, shard, hw) for k in node_group_sizes(name, nodes)]
    per_step = [_overlapped(window, c, hw.overlap) + k for c, k in zip(comm, kernels)]
    return float(np.mean(per_step)), float(np.mean(comm))


def iteration_times(
    n: int, local: int, wl: Workload, hw: Hardware, algorithm: str = "hierarchical"
) -> Dict[str, Optional[float]]:
    """Iteration time of DDP ('allreduce') and of each topology (None where not valid)."""
    out: Dict[str, Optional[float]] = {"allreduce": ddp_iteration_time(n, local, wl, hw, algorithm)[0]}
    for name in TOPOLOGIES:
        out[name] = (
            decentralized_iteration_time(name, n, local, wl, hw)[0]
            if topology_valid(name, n, local)
            else None
        )
    return out


# ----------------------------------------------------------------------------------------------
# consensus
# ----------------------------------------------------------------------------------------------


def _has_closed_form(name: str, n: int, local: int) -> bool:
    """Whether closed_form_gap knows the sizes: even rings, powers of two (of nodes for AER)."""
    size = n // local if name == "alternating-exp-ring" else n
    if n == 1 or name == "complete":
        return True
    if name == "ring":
        return n % 2 == 0
    return size & (size - 1) == 0


def closed_form_gap(name: str, n: int, local: int) -> float:
    """Spectral gap of the period-averaged mixing matrix, closed form (see _has_closed_form)."""
    if not topology_valid(name, n, local):
        raise ValueError(f"topology {name!r} is not valid for n={n}, L={local}")
    if not _has_closed_form(name, n, local):
        raise ValueError(f"no closed form for {name!r} at n={n}, L={local} (only even rings and "
                         f"powers of two); spectral_gap() computes it")
    if n == 1 or name == "complete":
        return 1.0
    if name == "ring":
        return (1.0 - math.cos(2.0 * math.pi / n)) / 2.0
    if name == "one-peer-exp":
        return 1.0 / math.log2(n)
    if name == "alternating-exp-ring":
        return 1.0 / (2.0 * math.log2(n // local))
    raise ValueError(name)


@lru_cache(maxsize=512)
def spectral_gap(name: str, n: int, local: int) -> float:
    """From decentpy's topology module for n <= EXACT_GAP_MAX_N or without a closed form, closed
    form beyond."""
    exact = n <= EXACT_GAP_MAX_N or not _has_closed_form(name, n, local)
    if exact and name != "complete" and topology_valid(name, n, local):
        # a fresh build: the cached one would keep its n x n mixing matrices alive
        return float(make_topology(name, n, local).spectral_gap())
    return closed_form_gap(name, n, local)


def iterations_to_10x(gap: float) -> float:
    """Iterations for the consensus distance to shrink 10x at rate (1 - gap) per iteration."""
    if gap >= 1.0:
        return 1.0
    if gap <= 0.0:
        return math.inf
    return max(1.0, math.log(10.0) / -math.log1p(-gap))


# ----------------------------------------------------------------------------------------------
# published comparison (the model on the GPU setups of the published speedups)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One published setup: a model on ``gpus`` GPUs, ``local`` per node, at ``inter_gbps``."""

    model: str
    gpus: int
    local: int
    inter_gbps: float
    workload: Workload
    hardware: Hardware


# Assumptions (V100-class GPUs, NVLink, strong scaling at a fixed global batch as in the
# published experiments, so the local batch shrinks as GPUs are added):
GPU_INTRA_BW = 100e9  # NVLink all-reduce bus bandwidth per GPU, bytes/s
GPU_INTRA_LAT = 5e-6
GPU_INTER_LAT = 25e-6  # NIC + switch, per message
GPU_MEM_BW = 800e9  # achieved HBM bandwidth of the fused kernels


def _resnet50(gpus: int) -> Workload:
    # 25.6M fp32 params = 102.4 MB; global batch 1024 -> 1024/gpus images per GPU; V100 AMP
    # ~1200 img/s fwd+bwd plus 5 ms fixed per iteration.
    local_batch = 1024 / gpus
    return Workload(model_bytes=25.6e6 * 4, compute_s=5e-3 + local_batch / 1200.0)


def _transformer(gpus: int) -> Workload:
    # 110M params (transformer-base / BERT-base size), fp32 params and gradients = 440 MB;
    # global batch 262k tokens -> 262144/gpus tokens per GPU at 6 * params * tokens FLOPs and
    # 40 TFLOP/s achieved (AMP), plus 10 ms fixed.
    tokens = 262144 / gpus
    return Workload(model_bytes=110e6 * 4, compute_s=10e-3 + 6 * 110e6 * tokens / 40e12)


def gpu_hardware(inter_gbps: float) -> Hardware:
    """The GPU cluster of the assumptions above, with ``inter_gbps`` Gb/s per node NIC."""
    return Hardware(intra_bw=GPU_INTRA_BW, inter_bw=inter_gbps * GBIT, intra_lat=GPU_INTRA_LAT,
                    inter_lat=GPU_INTER_LAT, mem_bw=GPU_MEM_BW, overlap=1.0)


def published_scenarios() -> List[Scenario]:
    """The 24 setups of the papers' range: 2 models x 25/100 Gb/s x L = 8/4 x 16-64 GPUs."""
    out = []
    for model, make in (("ResNet-50", _resnet50), ("Transformer-110M", _transformer)):
        for inter in (25.0, 100.0):
            for local in (8, 4):
                for gpus in (16, 32, 64):
                    out.append(Scenario(model, gpus, local, inter, make(gpus),
                                        gpu_hardware(inter)))
    return out


def published_table(algorithm: str = "hierarchical") -> List[Dict[str, object]]:
    """Per scenario, the model's all-reduce / AER iteration-time ratio against the papers'."""
    rows = []
    for sc in published_scenarios():
        t_ar = ddp_iteration_time(sc.gpus, sc.local, sc.workload, sc.hardware, algorithm)[0]
        t_aer = decentralized_iteration_time("alternating-exp-ring", sc.gpus, sc.local,
                                             sc.workload, sc.hardware)[0]
        ratio = t_ar / t_aer
        rows.append(dict(model=sc.model, gpus=sc.gpus, local=sc.local, inter_gbps=sc.inter_gbps,
                         model_mb=sc.workload.model_bytes / 1e6,
                         compute_ms=sc.workload.compute_s * 1e3, allreduce_ms=t_ar * 1e3,
                         aer_ms=t_aer * 1e3, ratio=ratio,
                         in_range=PUBLISHED_RANGE[0] <= ratio <= PUBLISHED_RANGE[1]))
    return rows


# ----------------------------------------------------------------------------------------------
# hybrid modes at scale (8 to 4096 GPUs)
# ----------------------------------------------------------------------------------------------

#: The four modes of the hybrid comparison: DDP, HSDP, plain AER, sharded gossip over AER.
HYBRID_MODES: Tuple[str, ...] = ("allreduce", "hsdp", "alternating-exp-ring",
                                 "shard-alternating-exp-ring")
HYBRID_LOCAL = 8
HYBRID_GPUS: Tuple[int, ...] = tuple(2 ** k for k in range(3, 13))  # 8 .. 4096
HYBRID_INTER_GBPS: Tuple[float, ...] = (25.0, 100.0)


def hybrid_workloads() -> Dict[str, Workload]:
    """Weak scaling (the global batch grows with the GPUs, as at scale): each GPU keeps the
    local batch of the published setups, 32 ResNet-50 images (1024 on 32 GPUs) and 4096
    transformer tokens (262k on 64 GPUs)."""
    return {"ResNet-50": _resnet50(32), "Transformer-110M": _transformer(64)}


def hybrid_iteration_times(
    n: int, local: int, wl: Workload, hw: Hardware, topology: str = "alternating-exp-ring"
) -> Dict[str, Optional[float]]:
    """Iteration time of DDP, HSDP, plain gossip and sharded gossip on ``topology`` (keys as in
    HYBRID_MODES for AER: 'allreduce', 'hsdp', topology, 'shard-' + topology); None where the
    topology does not fit."""
    nodes = _check_nodes(n, local)
    return {
        "allreduce": ddp_iteration_time(n, local, wl, hw)[0],
        "hsdp": hsdp_iteration_time(n, local, wl, hw)[0],
        topology: (decentralized_iteration_time(topology, n, local, wl, hw)[0]
                   if topology_valid(topology, n, local) else None),
        "shard-" + topology: (sharded_gossip_iteration_time(topology, n, local, wl, hw)[0]
                              if sharded_topology_valid(topology, nodes) else None),
    }


def hybrid_table(gpus: Sequence[int] = HYBRID_GPUS, local: int = HYBRID_LOCAL,
                 inter_gbps: Sequence[float] = HYBRID_INTER_GBPS) -> List[Dict[str, object]]:
    """Per workload, NIC speed and GPU count: each hybrid mode's iteration time (s, None where
    not valid) on the GPU cluster of :func:`gpu_hardware`."""
    rows = []
    for model, wl in hybrid_workloads().items():
        for inter in inter_gbps:
            hw = gpu_hardware(inter)
            for n in gpus:
                times = hybrid_iteration_times(n, local, wl, hw)
                rows.append(dict(model=model, gpus=n, nodes=n // local, local=local,
                                 inter_gbps=inter, model_mb=wl.model_bytes / 1e6,
                                 compute_ms=wl.compute_s * 1e3,
                                 **{f"{k}_s": times[k] for k in HYBRID_MODES}))
    return rows


# ----------------------------------------------------------------------------------------------
# compressed gossip at scale (8 to 4096 GPUs, the hybrid table's cluster and workloads)
# ----------------------------------------------------------------------------------------------

#: The columns of the compressed-gossip comparison, (topology, compression): DDP ('allreduce',
#: never compressed), AER and one-peer-exp uncompressed, int8 and bf16, and sharded gossip over
#: AER ('shard-alternating-exp-ring', intra_node="shard") uncompressed, int8 and bf16.
COMPRESSION_MODES: Tuple[Tuple[str, Optional[str]], ...] = (
    ("allreduce", None),
    ("alternating-exp-ring", None), ("alternating-exp-ring", "int8"),
    ("alternating-exp-ring", "bf16"),
    ("one-peer-exp", None), ("one-peer-exp", "int8"), ("one-peer-exp", "bf16"),
    ("shard-alternating-exp-ring", None), ("shard-alternating-exp-ring", "int8"),
    ("shard-alternating-exp-ring", "bf16"),
)
SHARD_PREFIX = "shard-"


def mode_name(topology: str, compression: Optional[str]) -> str:
    """The key of a (topology, compression) column: the topology, or 'topology+kind'."""
    return topology if compression is None else f"{topology}+{compression}"


def compression_table(gpus: Sequence[int] = HYBRID_GPUS, local: int = HYBRID_LOCAL,
                      inter_gbps: Sequence[float] = HYBRID_INTER_GBPS
                      ) -> List[Dict[str, object]]:
    """Per workload, NIC speed (per node) and GPU count: the iteration time (s, None where the
    topology does not fit) of each of COMPRESSION_MODES on the GPU cluster of
    :func:`gpu_hardware`, with the hybrid table's workloads, and the fp32 copies that compressed
    gossip keeps per GPU on each topology (``<topology>_copies``: of the model for plain gossip,
    of the 1/L shard for 'shard-' topologies, :func:`sharded_compressed_copies`)."""
    rows = []
    topologies = sorted({t for t, c in COMPRESSION_MODES if c is not None})
    for model, wl in hybrid_workloads().items():
        for inter in inter_gbps:
            hw = gpu_hardware(inter)
            for n in gpus:
                row: Dict[str, object] = dict(
                    model=model, gpus=n, nodes=_check_nodes(n, local), local=local,
                    inter_gbps=inter, model_mb=wl.model_bytes / 1e6, compute_ms=wl.compute_s * 1e3)
                nodes = n // local
                for topo, kind in COMPRESSION_MODES:
                    sharded = topo.startswith(SHARD_PREFIX)
                    base = topo[len(SHARD_PREFIX):] if sharded else topo
                    t: Optional[float] = None
                    if topo == "allreduce":
                        t = ddp_iteration_time(n, local, wl, hw)[0]
                    elif sharded and sharded_topology_valid(base, nodes):
                        t = sharded_gossip_iteration_time(base, n, local, wl, hw, kind)[0]
                    elif not sharded and topology_valid(topo, n, local):
                        t = decentralized_iteration_time(topo, n, local, wl, hw, kind)[0]
                    row[f"{mode_name(topo, kind)}_s"] = t
                for topo in topologies:
                    if topo.startswith(SHARD_PREFIX):
                        base = topo[len(SHARD_PREFIX):]
                        row[f"{topo}_copies"] = (sharded_compressed_copies(base, nodes)
                                                 if sharded_topology_valid(base, nodes) else None)
                    else:
                        row[f"{topo}_copies"] = (compressed_copies(topo, n, local)
                                                 if topology_valid(topo, n, local) else None)
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# local steps: DiLoCo and gossip DiLoCo (module docstring), and what they buy at scale
# ----------------------------------------------------------------------------------------------

#: Topologies whose groups are whole nodes: an int8 outer exchange is exact inside the node (fp32
#: reduce-scatter / all-gather) and int8 across nodes, each rank sending its 1/L shard.
NODE_LEVEL_INT8: Tuple[str, ...] = ("complete", "alternating-exp-ring")


def _outer_buffers(name: str) -> int:
    """Model-sized buffers of one outer exchange: DiLoCo's pseudo-gradient on ``complete`` (the
    global copies are equal and stay home), or a gossip outer step's global copy and
    pseudo-gradient."""
    return 1 if name == "complete" else 2


def _check_local_steps(local_steps: int) -> int:
    if int(local_steps) != local_steps or local_steps < 1:
        raise ValueError(f"local_steps must be a positive integer, got {local_steps!r}")
    return int(local_steps)


def outer_exchange_times(name: str, n: int, local: int, nbytes: float, hw: Hardware,
                         compression: Optional[str] = None, node_level: bool = True) -> np.ndarray:
    """Per outer step of the topology's period, the seconds of the outer exchange of a model (or a
    bucket) of ``nbytes`` parameter bytes: ``complete`` (DiLoCo), the hierarchical all-reduce of
    the pseudo-gradient; another topology (gossip DiLoCo), the buffer [global copy; pseudo-gradient]
    of 2 ``nbytes`` mixed with the group of the step, costed as uncompressed gossip of it.
    ``compression='int8'`` (or another decentpy kind): with ``node_level`` on :data:`NODE_LEVEL_INT8`
    topologies exact in the node and compressed across nodes (the intra ring all-reduce of the buffer
    plus sharded compressed gossip's node rows of its 1/L shards); otherwise, and always with
    ``node_level=False`` (decentpy with every rank a replica), decentpy's compressed gossip of the
    buffer over the topology's groups of ranks, point to point (module docstring)."""
    kind = _compression_kind(compression)
    _valid_topology(name, n, local)
    x = _outer_buffers(name) * nbytes
    if kind is None:
        if name == "complete":
            return np.array([allreduce_time(x, n, local, hw)])
        return step_comm_times(name, n, local, x, hw)
    if node_level and name in NODE_LEVEL_INT8:
        nodes = _check_nodes(n, local)
        intra = allreduce_time(x, local, local, hw)  # reduce-scatter + all-gather in the node
        if nodes == 1:
            return np.array([intra])
        rows = compressed_node_topology_rows(name, nodes, kind, _numel(x / local))
        return intra + _step_times(rows, float(local), hw)  # the node's L shard flows per NIC
    return step_comm_times(name, n, local, x, hw, kind)


def outer_kernel_time(name: str, n: int, local: int, wl: Workload, hw: Hardware,
                      compression: Optional[str] = None, node_level: bool = True) -> float:
    """Seconds of one outer step's memory-bound passes (not hidden): the pseudo-gradient and the
    outer optimizer (``kernel_traffic_outer``), a gossip outer step's mix
    (``kernel_traffic_outer_mix``), and with compression the error feedback, quantisation and
    dequantisation of what the rank compresses, ``4 y + 2 wire_bytes(y)`` for y bytes (the buffer,
    or its 1/L shard on the node-level path: ``node_level`` as in :func:`outer_exchange_times`)."""
    kind = _compression_kind(compression)
    m = wl.model_bytes
    traffic = wl.kernel_traffic_outer * m
    if name != "complete":
        traffic += wl.kernel_traffic_outer_mix * m
    if kind is not None and n > 1:
        x = _outer_buffers(name) * m
        node_path = node_level and name in NODE_LEVEL_INT8
        if not (node_path and n == local):  # one node: nothing crosses a NIC, nothing compressed
            y = x / local if node_path else x
            traffic += 4.0 * y + 2.0 * wire_bytes(kind, _numel(y))
    return traffic / hw.mem_bw


def _outer_parts(name: str, n: int, local: int, wl: Workload, hw: Hardware,
                 compression: Optional[str], node_level: bool
                 ) -> Tuple[float, float, float, np.ndarray, float]:
    """(forward, backward, inner kernel, the H-th backward with its outer exchange per outer step of
    the period, outer kernel) seconds: the pieces of :func:`local_steps_iteration_time`."""
    fwd, bwd = _fwd_bwd(wl)
    k_in = wl.kernel_traffic_ddp * wl.model_bytes / hw.mem_bw
    full = outer_exchange_times(name, n, local, wl.model_bytes, hw, compression, node_level)
    tail = outer_exchange_times(name, n, local, min(wl.bucket_bytes, wl.model_bytes), hw,
                                compression, node_level)
    backward = np.array([_bucketed(bwd, a, e, hw.overlap) for a, e in zip(full, tail)])
    return fwd, bwd, k_in, backward, outer_kernel_time(name, n, local, wl, hw, compression,
                                                       node_level)


def local_steps_iteration_time(name: str, n: int, local: int, wl: Workload, hw: Hardware,
                               local_steps: int, compression: Optional[str] = None,
                               node_level: bool = True) -> Tuple[float, float]:
    """(mean iteration time, mean exposed outer communication per iteration) of local steps:
    ``local_steps`` = H - 1 iterations without communication and one outer step whose exchange on
    topology ``name`` (``complete``: DiLoCo; another: gossip DiLoCo) overlaps the rest of the
    H-th backward only, like DDP's buckets (the last bucket exposed); averaged over the outer
    steps of the topology's period (module docstring; ``node_level``: the int8 path, as in
    :func:`outer_exchange_times`)."""
    h = _check_local_steps(local_steps)
    fwd, bwd, k_in, backward, k_out = _outer_parts(name, n, local, wl, hw, compression,
                                                   node_level)
    outer = fwd + float(np.mean(backward)) + k_in + k_out
    inner = wl.compute_s + k_in
    return ((h - 1) * inner + outer) / h, float(np.mean(backward) - bwd) / h


def local_steps_step_times(name: str, n: int, local: int, wl: Workload, hw: Hardware,
                           compression: Optional[str] = None, node_level: bool = True
                           ) -> Tuple[float, np.ndarray]:
    """(an inner iteration's seconds, the seconds of the iteration that ends with outer step t, for
    each t of the topology's period): the terms whose mean :func:`local_steps_iteration_time` takes,
    for a window of iterations that is not whole periods (:func:`local_steps_window_time`)."""
    fwd, _, k_in, backward, k_out = _outer_parts(name, n, local, wl, hw, compression, node_level)
    return wl.compute_s + k_in, fwd + backward + k_in + k_out


def local_steps_window_time(name: str, n: int, local: int, wl: Workload, hw: Hardware,
                            local_steps: int, first: int, last: int,
                            compression: Optional[str] = None, node_level: bool = True) -> float:
    """Mean seconds of iterations ``first`` .. ``last`` (1-based, inclusive) of a local-steps run:
    iteration c ends with an outer step when c is a multiple of H (the ``c / H``-th outer step, which
    runs the topology's step ``(c / H - 1) mod period``), the others are inner iterations. A
    measured window is rarely whole periods of H iterations (bench-lm's evaluation points are not
    multiples of H), and at H = 128 one outer step in 214 iterations is not 1 / H of them; over
    whole periods of the topology's schedule this is :func:`local_steps_iteration_time`."""
    h = _check_local_steps(local_steps)
    if not 1 <= first <= last:
        raise ValueError(f"the window must be 1 <= first <= last, got first={first!r}, last={last!r}")
    inner, outer = local_steps_step_times(name, n, local, wl, hw, compression, node_level)
    outers = range((first + h - 1) // h, last // h + 1)  # c / H of the multiples c of H inside
    total = (last - first + 1 - len(outers)) * inner
    total += sum(float(outer[(k - 1) % len(outer)]) for k in outers)
    return total / (last - first + 1)


def diloco_iteration_time(n: int, local: int, wl: Workload, hw: Hardware, local_steps: int,
                          compression: Optional[str] = None, node_level: bool = True
                          ) -> Tuple[float, float]:
    """DiLoCo (``topology='complete'``): :func:`local_steps_iteration_time` on ``complete``."""
    return local_steps_iteration_time("complete", n, local, wl, hw, local_steps, compression,
                                      node_level)


def gossip_diloco_iteration_time(name: str, n: int, local: int, wl: Workload, hw: Hardware,
                                 local_steps: int, compression: Optional[str] = None,
                                 node_level: bool = True) -> Tuple[float, float]:
    """Gossip DiLoCo on topology ``name`` (not ``complete``): :func:`local_steps_iteration_time`."""
    if name == "complete":
        raise ValueError("'complete' is DiLoCo, not a gossip outer step: diloco_iteration_time")
    return local_steps_iteration_time(name, n, local, wl, hw, local_steps, compression, node_level)


def solo_iteration_time(wl: Workload, hw: Hardware) -> float:
    """One GPU alone: forward + backward and its Adam step (``kernel_traffic_ddp``), no exchange."""
    return wl.compute_s + wl.kernel_traffic_ddp * wl.model_bytes / hw.mem_bw


def compute_utilisation(iteration_s: float, wl: Workload, hw: Hardware) -> float:
    """The share of an iteration of ``iteration_s`` seconds that one GPU alone would also spend
    (:func:`solo_iteration_time` / iteration_s): 1 when communication costs nothing."""
    return solo_iteration_time(wl, hw) / iteration_s


@dataclass(frozen=True)
class LocalStepsMode:
    """A mode of the local-steps comparison: ``kind`` 'ddp' (all-reduce DDP), 'gossip' (gossip
    every step on ``topology``) or 'local-steps' (``local_steps`` inner steps, then an outer
    exchange on ``topology``: DiLoCo on 'complete', gossip DiLoCo on another); ``compression``:
    None or a decentpy kind ('int8'), never with DDP."""

    kind: str
    topology: str = "complete"
    local_steps: int = 1
    compression: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in ("ddp", "gossip", "local-steps"):
            raise ValueError(f"kind must be 'ddp', 'gossip' or 'local-steps', got {self.kind!r}")
        if self.kind == "ddp" and (self.compression is not None or self.topology != "complete"):
            raise ValueError("DDP all-reduces the gradients: no topology, no compression")
        if self.kind != "local-steps" and self.local_steps != 1:
            raise ValueError(f"{self.kind!r} exchanges every step: local_steps must be 1")
        _check_local_steps(self.local_steps)
        _compression_kind(self.compression)

    @property
    def name(self) -> str:
        """'allreduce', the topology, 'diloco-H<H>' or 'diloco-<topology>-H<H>' ('+int8')."""
        if self.kind == "ddp":
            return "allreduce"
        if self.kind == "gossip":
            return mode_name(self.topology, self.compression)
        base = ("diloco" if self.topology == "complete" else f"diloco-{self.topology}")
        return mode_name(f"{base}-H{self.local_steps}", self.compression)

    def valid(self, n: int, local: int) -> bool:
        """Whether the mode runs on n GPUs, ``local`` per node (its topology fits)."""
        return self.kind == "ddp" or topology_valid(self.topology, n, local)

    def iteration_time(self, n: int, local: int, wl: Workload, hw: Hardware) -> float:
        """The mode's mean iteration time (s)."""
        if self.kind == "ddp":
            return ddp_iteration_time(n, local, wl, hw)[0]
        if self.kind == "gossip":
            return decentralized_iteration_time(self.topology, n, local, wl, hw,
                                                self.compression)[0]
        return local_steps_iteration_time(self.topology, n, local, wl, hw, self.local_steps,
                                          self.compression)[0]


_AER = "alternating-exp-ring"
#: DDP; AER every step, fp32 and int8; DiLoCo and gossip DiLoCo over AER, H = 32 and 128, fp32 and
#: int8 (the node-level int8 outer exchange: exact in the node, each GPU's shard int8 across).
LOCAL_STEPS_MODES: Tuple[LocalStepsMode, ...] = (
    LocalStepsMode("ddp"),
    LocalStepsMode("gossip", _AER), LocalStepsMode("gossip", _AER, compression="int8"),
    *(LocalStepsMode("local-steps", topo, h, c)
      for topo in ("complete", _AER) for h in (32, 128) for c in (None, "int8")),
)
LOCAL_STEPS_GPUS: Tuple[int, ...] = tuple(2 ** k for k in range(6, 13))  # 64 .. 4096
LOCAL_STEPS_TARGETS: Tuple[float, ...] = (0.90, 0.95)
LOCAL_STEPS_GBPS: Tuple[float, ...] = (25.0, 100.0, 400.0)  # utilisation columns of the table


def local_steps_workload() -> Workload:
    """The transformer of the published scenarios at the hybrid table's weak scaling: 110M fp32
    parameters (440 MB), 4096 tokens per GPU (77.6 ms of forward + backward)."""
    return hybrid_workloads()["Transformer-110M"]


def utilisation_at(mode: LocalStepsMode, n: int, inter_gbps: float, local: int = HYBRID_LOCAL,
                   wl: Optional[Workload] = None, hardware=gpu_hardware) -> float:
    """Compute utilisation of ``mode`` on n GPUs, ``local`` per node, with ``inter_gbps`` Gb/s per
    node NIC (``hardware``: Gb/s -> Hardware, default :func:`gpu_hardware`; ``wl`` default
    :func:`local_steps_workload`)."""
    wl = local_steps_workload() if wl is None else wl
    hw = hardware(inter_gbps)
    return compute_utilisation(mode.iteration_time(n, local, wl, hw), wl, hw)


def bandwidth_for_utilisation(mode: LocalStepsMode, n: int, target: float,
                              local: int = HYBRID_LOCAL, wl: Optional[Workload] = None,
                              hardware=gpu_hardware, lo: float = 0.01, hi: float = 1e5,
                              rel_tol: float = 1e-4) -> Optional[float]:
    """The per-node NIC bandwidth (Gb/s) at which ``mode`` reaches utilisation ``target`` on n
    GPUs: bisection on a log scale between ``lo`` and ``hi`` Gb/s (the iteration time never grows
    with the bandwidth) to a relative ``rel_tol``; the returned bandwidth reaches the target.
    ``lo`` when already reached there, None when not even at ``hi`` (latencies and kernel
    passes cap the utilisation below 1)."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target must be in (0, 1), got {target!r}")
    if not mode.valid(n, local):
        raise ValueError(f"{mode.name} does not run on n={n}, L={local}")

    def reaches(gbps: float) -> bool:
        return utilisation_at(mode, n, gbps, local, wl, hardware) >= target

    if not reaches(hi):
        return None
    if reaches(lo):
        return lo
    while hi / lo > 1.0 + rel_tol:
        mid = math.sqrt(lo * hi)
        if reaches(mid):
            hi = mid
        else:
            lo = mid
    return hi


def local_steps_table(gpus: Sequence[int] = LOCAL_STEPS_GPUS, local: int = HYBRID_LOCAL,
                      targets: Sequence[float] = LOCAL_STEPS_TARGETS,
                      gbps: Sequence[float] = LOCAL_STEPS_GBPS,
                      modes: Sequence[LocalStepsMode] = LOCAL_STEPS_MODES
                      ) -> List[Dict[str, object]]:
    """Per mode and GPU count, on :func:`gpu_hardware`'s cluster with :func:`local_steps_workload`:
    the NIC bandwidth per node needed for each target utilisation (``gbps_for_<pct>pct``, None
    where out of reach), and the utilisation and iteration time at each of ``gbps``."""
    wl = local_steps_workload()
    rows = []
    for mode in modes:
        for n in gpus:
            row: Dict[str, object] = dict(
                mode=mode.name, kind=mode.kind, topology=mode.topology,
                local_steps=mode.local_steps, compression=mode.compression or "", gpus=n,
                nodes=_check_nodes(n, local), local=local, model_mb=wl.model_bytes / 1e6,
                compute_ms=wl.compute_s * 1e3)
            valid = mode.valid(n, local)
            for t in targets:
                row[f"gbps_for_{round(t * 100)}pct"] = (
                    bandwidth_for_utilisation(mode, n, t, local, wl) if valid else None)
            for g in gbps:
                hw = gpu_hardware(g)
                it = mode.iteration_time(n, local, wl, hw) if valid else None
                row[f"util_at_{g:g}gbps"] = (None if it is None
                                             else compute_utilisation(it, wl, hw))
                row[f"iter_ms_at_{g:g}gbps"] = None if it is None else it * 1e3
            rows.append(row)
    return rows
