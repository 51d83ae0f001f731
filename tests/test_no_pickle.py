"""No rank runs code another process chose (issue 52): every message between ranks outside the
exchanges' tensors is plain data (JSON, or a tensor state read with ``weights_only=True``), so a
crafted pickle payload -- an object whose ``__reduce__`` creates a marker file -- in any of them is a
named error, and the marker file never appears.

One spawn of 2 gloo workers runs every message kind in turn; rank 1 sends the payload in place of
its part, and after each case an all-reduce proves the process group still works. The checkpoint
files are tests/test_checkpoints.py's (a file is another way in).
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
import re
import traceback
from typing import Any, Callable, Dict, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_harness import run_workers
from reference import batch, decentpy_optim_fn, loss_fn, make_mlp

WORLD = 2
ROOT = pathlib.Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): the proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def pickled(marker: str) -> bytes:
    """A raw pickle of the payload (what a message of torch.distributed's object collectives is)."""
    return pickle.dumps(Payload(marker))


def torch_saved(marker: str) -> bytes:
    """The payload in torch.save's format (what a state message or a checkpoint file is)."""
    buf = io.BytesIO()
    torch.save({"state": Payload(marker)}, buf)
    return buf.getvalue()


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any, active: bool) -> Iterator[None]:
    """``module.name = value`` while inside (only where ``active``: the sending rank)."""
    old = getattr(module, name)
    if active:
        setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _outcome(fn: Callable[[], Any], marker: str) -> Dict[str, Any]:
    """What ``fn`` raised (type, message), whether the marker exists, and an all-reduce after it."""
    out: Dict[str, Any] = {"type": None, "text": ""}
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        out = {"type": type(exc).__name__, "text": str(exc), "tb": traceback.format_exc()[-1500:]}
    t = torch.ones(1)
    dist.all_reduce(t)
    out["allreduce"] = t.item()
    out["marker"] = os.path.exists(marker)
    return out


def _oss(rank: int) -> Any:
    from decentpy import OSS, ShardedDataParallel

    model = make_mlp(0)
    oss = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    sdp = ShardedDataParallel(model, oss)
    x, y = batch(rank, 0)
    loss_fn(sdp(x), y).backward()
    oss.step()
    return oss


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom on the last stage")


def worker(rank: int, world: int, directory: str) -> Dict[str, Dict[str, Any]]:
    import decentpy.comm.wire as wire
    import decentpy.sharding.oss as oss_mod
    from decentpy import AsyncPipe, DecentralizedDataParallel

    sender = rank == 1
    out: Dict[str, Dict[str, Any]] = {}

    def marker(case: str) -> str:
        return os.path.join(directory, f"{case}.ran")

    # OSS's consolidated optimizer state, on every rank and on one
    for case, recipient in (("oss_all_ranks", -1), ("oss_to_rank0", 0)):
        oss = _oss(rank)
        with patched(oss_mod, "encode_state", lambda _state, m=marker(case): torch_saved(m), sender):
            out[case] = _outcome(lambda: oss.consolidate_state_dict(recipient_rank=recipient), marker(case))
    # AsyncPipe: the failing stage's error text, broadcast to the other stages
    torch.manual_seed(0)
    pipe = AsyncPipe(nn.Sequential(nn.Linear(4, 4), _Boom()), [1, 1], chunks=1)
    case = "pipe_error_text"
    with patched(wire, "to_json_bytes", lambda _v, m=marker(case): pickled(m), sender):
        def step() -> None:
            y = pipe(torch.randn(2, 4) if rank == 0 else None)
            if not pipe.final_stage:
                pipe.back_helper(y)
        out[case] = _outcome(step, marker(case))
    # the construction agreement of a wrapper (settings, verdicts: JSON)
    case = "settings_agreement"
    with patched(wire, "to_json_bytes", lambda _v, m=marker(case): pickled(m), sender):
        out[case] = _outcome(lambda: DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam")),
                             marker(case))
    # a training state sent point to point (wire.send_state / recv_state)
    case = "state_message"

    def state_message() -> None:
        if sender:
            wire.send_bytes(torch_saved(marker(case)), 0)
        else:
            wire.recv_state(1)
    out[case] = _outcome(state_message, marker(case))
    return out


CASES = {  # case -> (what each rank raises (None: returns), words in the receivers' message)
    "oss_all_ranks": (("MalformedMessageError", "MalformedMessageError"), ["optimizer state from rank 1",
                                                                         "weights_only=True"]),
    "oss_to_rank0": (("MalformedMessageError", None), ["optimizer state from rank 1", "weights_only=True"]),
    "pipe_error_text": (("PipelineError", "ValueError"), ["stage 1", "could not be read", "not a valid JSON"]),
    "settings_agreement": (("MalformedMessageError", "MalformedMessageError"), ["from rank 1",
                                                                              "not a valid JSON"]),
    "state_message": (("MalformedMessageError", None), ["from rank 1", "weights_only=True"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> Dict[str, Any]:
    directory = tmp_path_factory.mktemp("markers")
    res = run_workers(worker, WORLD, str(directory), timeout=240)
    return {"by_rank": res, "directory": directory}


def test_the_payload_is_live(tmp_path: pathlib.Path) -> None:
    """Not vacuous: unpickled the usual way, the payload creates its marker."""
    m1, m2 = tmp_path / "a", tmp_path / "b"
    pickle.loads(pickled(str(m1)))
    torch.load(io.BytesIO(torch_saved(str(m2))), weights_only=False)
    assert m1.exists() and m2.exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pickle_payload_is_a_named_error_and_never_runs(results: Dict[str, Any], case: str) -> None:
    raised, words = CASES[case]
    for rank, (want, got) in enumerate(zip(raised, (r[case] for r in results["by_rank"]))):
        assert got["type"] == want, (case, rank, got)
        assert not got["marker"], f"{case}: the payload ran on rank {rank}"
        assert got["allreduce"] == WORLD, (case, rank, got)
        if rank == 0:
            for w in words:
                assert w in got["text"], (case, w, got["text"])
    assert not any(results["directory"].iterdir()), list(results["directory"].iterdir())


def test_no_object_collective_or_unsafe_load_in_the_package() -> None:
    """No torch.distributed object collective (pickle), no import of a pickler and no torch.load
    without ``weights_only=True`` anywhere in decentpy/ (read from the code's syntax tree, so prose
    that mentions pickle does not count)."""
    import ast

    picklers = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}
    hits = []
    for path in (ROOT / "decentpy").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.split(".")[0] in picklers]
            elif isinstance(node, ast.ImportFrom):
                bad = [node.module] if (node.module or "").split(".")[0] in picklers else []
            elif isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                bad = []
                if name.endswith("_object") or name.endswith("_object_list"):
                    bad = [name]
                elif name == "load" and isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "torch":
                    safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                               for k in node.keywords)
                    bad = [] if safe else ["torch.load without weights_only=True"]
            else:
                bad = []
            hits += [f"{rel}:{node.lineno}: {b}" for b in bad]
    assert not hits, "\n".join(hits)
