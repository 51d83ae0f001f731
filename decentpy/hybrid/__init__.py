"""Compositions of decentpy's parallelisms.

:func:`pipeline_groups` lays out decentralized pipelines (``S`` stages x ``R`` replicas):
``AsyncPipe`` on each replica's group, ``DecentralizedDataParallel`` on each stage's replica group,
joined by :meth:`decentpy.AsyncPipe.wrap_partition`.
"""

from .pipelines import PipelineGroups, PipelineLayout, factor_pairs, pipeline_groups, pipeline_layout

__all__ = ["PipelineGroups", "PipelineLayout", "factor_pairs", "pipeline_groups", "pipeline_layout"]
