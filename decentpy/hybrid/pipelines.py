"""Decentralized pipelines: ``S`` stages x ``R`` replicas.

``R`` pipelines (:class:`~decentpy.AsyncPipe`) run side by side, each on its own data; the ``R``
replicas of each stage gossip among themselves with a
:class:`~decentpy.DecentralizedDataParallel` on that stage's replica group, once per mini-batch.
This module only lays out the ranks and creates the groups; the composition is three lines::

    groups = pipeline_groups(stages=2, replicas=2)                 # every rank, collective
    pipe = AsyncPipe(model, balance, group=groups.pipeline, chunks=4)
    ddp = pipe.wrap_partition(lambda part: DecentralizedDataParallel(
        part, optim_fn, topology="complete", process_group=groups.replicas))

Rank layout (replica-major): global rank ``ranks[replica * S + stage]`` holds stage ``stage`` of
pipeline ``replica``; with the default ``ranks`` (the world) replica ``r`` is ranks ``r*S ..
r*S + S - 1``, so a pipeline's consecutive stages sit on consecutive ranks (the same node, when
a node holds a multiple of ``S`` ranks) and the replica groups, whose traffic is once per
mini-batch, span the nodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

__all__ = ["PipelineLayout", "PipelineGroups", "pipeline_layout", "pipeline_groups", "factor_pairs"]

logger = logging.getLogger(__name__)


def factor_pairs(n: int) -> List[Tuple[int, int]]:
    """Every ``(stages, replicas)`` with ``stages * replicas == n``."""
    return [(s, n // s) for s in range(1, n + 1) if n % s == 0]


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class PipelineLayout:
    """Which global rank holds which (stage, replica): pure bookkeeping, no process group.

    ``pipelines[r]`` lists pipeline ``r``'s global ranks in stage order (an ``AsyncPipe``'s
    group: stage ``i`` = group rank ``i``); ``stage_replicas[s]`` lists the global ranks holding
    stage ``s``, in replica order (a ``DecentralizedDataParallel``'s group: replica ``r`` = group
    rank ``r``)."""

    stages: int
    replicas: int
    pipelines: Tuple[Tuple[int, ...], ...]
    stage_replicas: Tuple[Tuple[int, ...], ...]

    def rank_of(self, stage: int, replica: int) -> int:
        """The global rank that holds ``stage`` of pipeline ``replica``."""
        if not (0 <= stage < self.stages and 0 <= replica < self.replicas):
            raise ValueError(f"(stage, replica) must be in [0, {self.stages}) x [0, {self.replicas}), "
                             f"got ({stage}, {replica})")
        return self.pipelines[replica][stage]

    def position(self, rank: int) -> Optional[Tuple[int, int]]:
        """``(stage, replica)`` of global ``rank``; None if the layout does not use it."""
        for r, ranks in enumerate(self.pipelines):
            if rank in ranks:
                return ranks.index(rank), r
        return None


def pipeline_layout(stages: int, replicas: int, ranks: Optional[Sequence[int]] = None,
                    world_size: Optional[int] = None) -> PipelineLayout:
    """The replica-major layout of ``stages x replicas`` over ``ranks`` (default: ``0 ..
    world_size - 1``, the world's size when None). Raises ValueError naming the valid
    ``(stages, replicas)`` when the sizes do not multiply to the number of ranks."""
    stages = _positive_int(stages, "stages")
    replicas = _positive_int(replicas, "replicas")
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if ranks is None:
        if world_size is None:
            raise ValueError("pipeline_layout needs ranks or world_size (or an initialized process group)")
        ranks = list(range(world_size))
    ranks = [int(r) for r in ranks]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct, got {ranks}")
    if world_size is not None:
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"ranks must be global ranks in [0, {world_size}), got {bad}")
    n = len(ranks)
    if stages * replicas != n:
        valid = ", ".join(f"({s}, {r})" for s, r in factor_pairs(n)) if n else "none"
        raise ValueError(f"stages x replicas must equal the number of ranks: {stages} x {replicas} = "
                         f"{stages * replicas}, but there are {n} ranks; valid (stages, replicas) for {n}: {valid}")
    pipelines = tuple(tuple(ranks[r * stages + s] for s in range(stages)) for r in range(replicas))
    stage_replicas = tuple(tuple(ranks[r * stages + s] for r in range(replicas)) for s in range(stages))
    return PipelineLayout(stages, replicas, pipelines, stage_replicas)


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's place in a ``stages x replicas`` layout and its two process groups.

    ``pipeline``: the group of this rank's pipeline (pass it to ``AsyncPipe(group=...)``; group
    rank = stage). ``replicas``: the group of the ranks holding this rank's stage (pass it to
    ``DecentralizedDataParallel(process_group=...)``; group rank = replica). ``layout`` has every
    rank's place."""

    stage: int
    replica: int
    pipeline: dist.ProcessGroup
    replicas: dist.ProcessGroup
    layout: PipelineLayout

    @property
    def num_stages(self) -> int:
        return self.layout.stages

    @property
    def num_replicas(self) -> int:
        return self.layout.replicas

    @property
    def pipeline_ranks(self) -> Tuple[int, ...]:
        """Global ranks of this rank's pipeline, in stage order."""
        return self.layout.pipelines[self.replica]

    @property
    def replica_ranks(self) -> Tuple[int, ...]:
        """Global ranks holding this rank's stage, in replica order."""
        return self.layout.stage_replicas[self.stage]

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def final_stage(self) -> bool:
        return self.stage == self.layout.stages - 1


def pipeline_groups(stages: int, replicas: int, ranks: Optional[Sequence[int]] = None, *,
                    backend: Optional[str] = None) -> Optional[PipelineGroups]:
    """Lay ``stages x replicas`` out over ``ranks`` (default: the world) and create the ``replicas``
    pipeline groups and the ``stages`` stage-replica groups.

    A collective over the **whole world**: ``torch.distributed.new_group`` must be called by every
    rank for every group in the same order, so every rank (also one outside ``ranks``) calls this
    with the same arguments and creates every group, pipelines first, then the stage groups. A rank
    outside ``ranks`` gets None. Each group is new (never the world itself, even when it has every
    rank), so the pipe's messages and the gossip never share a group with the caller's collectives.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pipeline_groups needs torch.distributed: call torch.distributed.init_process_group(...) "
                           "first")
    layout = pipeline_layout(stages, replicas, ranks, dist.get_world_size())
    me = dist.get_rank()
    pipes = [dist.new_group(list(r), backend=backend) for r in layout.pipelines]
    stage_groups = [dist.new_group(list(r), backend=backend) for r in layout.stage_replicas]
    where = layout.position(me)
    if where is None:
        logger.debug("rank %d is not in the pipeline layout %s", me, layout.pipelines)
        return None
    stage, replica = where
    logger.debug("rank %d: stage %d of pipeline %d (pipeline ranks %s, stage replicas %s)", me, stage, replica,
                 layout.pipelines[replica], layout.stage_replicas[stage])
    return PipelineGroups(stage, replica, pipes[replica], stage_groups[stage], layout)
