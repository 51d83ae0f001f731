"""Process-group set-up for scripts launched by ``torchrun`` (decent-dp's ``decent_dp.utils``)."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Mapping, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["choose_backend", "initialize_dist"]

logger = logging.getLogger(__name__)

# What torchrun (and any env:// launcher) sets for every worker.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def choose_backend(local_rank: int, local_world_size: int, gpu_count: int) -> Tuple[str, Optional[int]]:
    """``("nccl", device index)`` when GPUs are visible (one per local rank), else ``("gloo", None)``.

    NCCL cannot put two ranks on one GPU, so fewer visible GPUs than local ranks is an error.
    """
    if gpu_count <= 0:
        return "gloo", None
    if gpu_count < local_world_size:
        raise RuntimeError(
            f"{local_world_size} processes on this node (LOCAL_WORLD_SIZE) but only {gpu_count} GPU(s) visible; "
            f"NCCL needs one GPU per process: launch --nproc_per_node={gpu_count} (or fewer), make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES), or pass backend='gloo'")
    return "nccl", local_rank


def initialize_dist(backend: Optional[str] = None,
                    timeout: Optional[datetime.timedelta] = None) -> Tuple[int, int]:
    """Initialize ``torch.distributed`` from the launcher's environment; return ``(rank, world_size)``.

    As decent-dp's: NCCL when GPUs are visible, each local rank on its own GPU
    (``torch.cuda.set_device(LOCAL_RANK)``, so ``torch.device("cuda")`` and ``.cuda()`` mean this
    rank's GPU), gloo otherwise. ``backend`` overrides the choice. If the default process group
    already exists it is kept and its rank and size are returned.
    """
    if dist.is_initialized():
        logger.debug("initialize_dist: the default process group already exists; keeping it")
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in LAUNCHER_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"initialize_dist() reads the launcher's environment, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; launch the script with torchrun "
            "(e.g. `torchrun --nproc_per_node=4 train.py`), or set " + ", ".join(LAUNCHER_ENV))
    local_rank = _env_int(os.environ, "LOCAL_RANK")
    local_world_size = _env_int(os.environ, "LOCAL_WORLD_SIZE")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be in [0, LOCAL_WORLD_SIZE={local_world_size})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend, device = choose_backend(local_rank, local_world_size, gpus)
    else:
        device = local_rank if backend == "nccl" else None
    if device is not None:
        torch.cuda.set_device(device)
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    logger.debug("initialize_dist: rank %d/%d, backend %s, local rank %d/%d", dist.get_rank(),
                 dist.get_world_size(), backend, local_rank, local_world_size)
    return dist.get_rank(), dist.get_world_size()
