"""Sharded data parallelism: optimizer state (ZeRO-1) and gradients (ZeRO-2) split over a group.

fairscale's API -- :class:`OSS`, :class:`ShardedDataParallel`, :class:`ShardedGradScaler` -- on
decentpy's parts: flat parameter blocks packed by the extension (one contiguous run per owner,
:mod:`.partition`), the fused optimizer kernels, cross-rank input checks before any collective,
and torch's ``Join`` for uneven inputs. Everything works on a sub-group.
"""

from .grad_scaler import ShardedGradScaler
from .oss import OSS
from .partition import partition_by_size
from .sharded_ddp import ShardedDataParallel

__all__ = ["OSS", "ShardedDataParallel", "ShardedGradScaler", "partition_by_size"]
