"""decentpy: decentralized data-parallel training for PyTorch.

Each worker keeps its own model and averages parameters with a few peers chosen by a topology,
while its optimizer steps inside the backward pass, bucket by bucket, with communication hidden
behind compute. Hot paths live in the compiled extension ``decentpy._C``.
"""

import logging

import torch  # noqa: F401  (loads libtorch before the extension)

from .version import __version__

logging.getLogger(__name__).addHandler(logging.NullHandler())

from .environment import load_extension, log_cpu_kernel_choice, running_the_report  # noqa: E402

try:
    # Before decentpy._C is loaded: another torch, or a CPU without the instructions it was compiled
    # for, raises an ImportError saying what to do instead of an `undefined symbol` or a SIGILL.
    load_extension()
except ImportError:
    if not running_the_report():
        raise
    # `python -m decentpy` reports what is wrong (decentpy/__main__.py); the API needs the extension.
    __all__ = ["__version__"]
else:
    from . import _C  # noqa: E402  (the compiled extension, loaded just above)

    log_cpu_kernel_choice(_C)
    from . import optim, topo, utils  # noqa: E402  (decent-dp's module paths: decentpy.topo, decentpy.utils)
    from .comm import MalformedMessageError, SettingsMismatchError  # noqa: E402
    from .comm.arrival import ArrivalError  # noqa: E402
    from .optim.hyperparams import HyperparameterError  # noqa: E402
    from .comm import (FaultyPeerError, NonFiniteGradientError, PeerFaultyError, PeerReportedError,  # noqa: E402
                       PeerTimeoutError, PeerUnreachableError)
    from .engine.peer_check import PeerCheck  # noqa: E402
    from .optim.compression import Compression  # noqa: E402
    from .config import show_config  # noqa: E402
    from .ddp import LR_SCHEDULER_FN_TYPE, OPTIM_FN_TYPE, DecentralizedDataParallel  # noqa: E402
    from .join import Join, Joinable, JoinHook  # noqa: E402
    from .local_sgd import DiLoCo, LocalSGD  # noqa: E402
    from .local_steps import LocalSteps, SparseOuter  # noqa: E402
    from .pipeline import AsyncPipe, PipelineError  # noqa: E402
    from . import hybrid  # noqa: E402  (compositions: decentralized pipelines)
    from .preemption import CheckpointError, PreemptionCheckpointer  # noqa: E402
    from .reduce_scatter import ReduceScatterBucketer  # noqa: E402
    from .optim.shards import RankState  # noqa: E402
    from .state_averaging import OptimizerStateAveraging  # noqa: E402
    from .sharding import OSS, ShardedDataParallel, ShardedGradScaler  # noqa: E402
    from .topology import (  # noqa: E402
        CustomTopology,
        Group,
        Topology,
        TopologyError,
        available_topologies,
        make_topology,
        register_topology,
        spectral_gap,
    )

    __all__ = [
        "__version__",
        "DecentralizedDataParallel",
        "Compression",
        "PeerTimeoutError",
        "PeerUnreachableError",
        "PeerReportedError",
        "NonFiniteGradientError",
        "SettingsMismatchError",
        "MalformedMessageError",
        "ArrivalError",
        "HyperparameterError",
        "CheckpointError",
        "FaultyPeerError",
        "PeerFaultyError",
        "PeerCheck",
        "OptimizerStateAveraging",
        "PreemptionCheckpointer",
        "Join",
        "DiLoCo",
        "RankState",
        "LocalSGD",
        "LocalSteps",
        "SparseOuter",
        "Joinable",
        "JoinHook",
        "ReduceScatterBucketer",
        "AsyncPipe",
        "PipelineError",
        "OSS",
        "ShardedDataParallel",
        "ShardedGradScaler",
        "OPTIM_FN_TYPE",
        "LR_SCHEDULER_FN_TYPE",
        "Topology",
        "CustomTopology",
        "Group",
        "TopologyError",
        "available_topologies",
        "make_topology",
        "register_topology",
        "spectral_gap",
        "optim",
        "topo",
        "utils",
        "show_config",
    ]
