"""PreemptionCheckpointer's files are input like any other (issue 52): a resume reads them as plain
data (``weights_only=True``), checks each against the manifest's SHA-256 and its state against this
rank (rank, world size, topology), and the ranks agree on the outcome in one collective -- the rank
whose file is bad raises a CheckpointError naming the file, the others a RuntimeError naming that
rank and file, nobody hangs, nothing is loaded anywhere, and no code in a file ever runs.

One spawn of 2 gloo workers: the round trip of three configurations (fused optimizer + scheduler +
int8 gossip; local steps with an outer optimizer; torch's RMSprop + OneCycleLR), bit for bit against
the uninterrupted run (RNG included: the batches carry noise from torch's global generator); then
every kind of damage, each on a fresh copy of the first configuration's checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import traceback
import zipfile
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_workers
from reference import batch, decentpy_optim_fn, loss_fn, make_mlp
from test_no_pickle import Payload

WORLD = 2
SAVE_AT, STEPS = 4, 8


def _make(config: str, seed: int) -> Any:
    from decentpy import DecentralizedDataParallel
    from decentpy.optim import lr_scheduler_fn_cosine_with_warmup

    torch.manual_seed(seed)
    if config == "adamw_cosine_int8_ring":
        return DecentralizedDataParallel(
            make_mlp(0), decentpy_optim_fn("adamw"), topology="ring", compression="int8",
            lr_scheduler_fn=lambda o: lr_scheduler_fn_cosine_with_warmup(o, STEPS, 2))
    if config == "local_steps_outer_nesterov":
        return DecentralizedDataParallel(
            make_mlp(0), decentpy_optim_fn("adam"), local_steps=2,
            outer_optim=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
    if config == "torch_rmsprop_onecycle":
        return DecentralizedDataParallel(
            make_mlp(0), decentpy_optim_fn("rmsprop"), topology="complete",
            lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.05, total_steps=STEPS + 2))
    if config == "other_topology":  # the first configuration's, on another topology
        return DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adamw"), topology="complete",
                                         compression="int8",
                                         lr_scheduler_fn=lambda o: lr_scheduler_fn_cosine_with_warmup(o, STEPS, 2))
    raise AssertionError(config)


CONFIGS = ("adamw_cosine_int8_ring", "local_steps_outer_nesterov", "torch_rmsprop_onecycle")


def _train(rank: int, ddp: Any, steps: range) -> None:
    for k in steps:
        x, y = batch(rank, k)
        loss_fn(ddp(x + 0.1 * torch.randn_like(x)), y).backward()  # the noise: torch's global generator


def _state(ddp: Any) -> List[torch.Tensor]:
    """Everything that must be bit-equal: parameters, optimizer tensors, learning rates, the step."""
    ddp.wait()
    out = [p.detach().clone() for p in ddp.parameters()]
    for opt in ddp.state_optimizers:
        for st in opt.state.values():
            out += [v.detach().clone().reshape(-1) for v in st.values() if isinstance(v, torch.Tensor)]
        out += [torch.tensor([float(g["lr"]) for g in opt.param_groups], dtype=torch.float64)]
    return out + [torch.tensor([ddp.step_count])]


def round_trip(rank: int, config: str, directory: str) -> Dict[str, Any]:
    from decentpy import PreemptionCheckpointer

    ddp = _make(config, 100 + rank)
    ckpt = PreemptionCheckpointer(ddp, directory, every=SAVE_AT, signals=())
    _train(rank, ddp, range(SAVE_AT))
    ckpt.save(SAVE_AT, {"next": SAVE_AT, "order": torch.arange(5), "note": "data position"})
    _train(rank, ddp, range(SAVE_AT, STEPS))
    want = _state(ddp)
    ddp.close()
    torch.manual_seed(7)  # another generator state and other initial values: the resume replaces both
    resumed = _make(config, 200 + rank)
    got = PreemptionCheckpointer(resumed, directory, every=SAVE_AT, signals=()).resume()
    assert got is not None
    _train(rank, resumed, range(got["extra"]["next"], STEPS))
    have = _state(resumed)
    resumed.close()
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    return {"equal": len(want) == len(have) and all(torch.equal(a, b) for a, b in zip(want, have)),
            "step": got["step"], "extra_order": got["extra"]["order"].tolist(), "note": got["extra"]["note"],
            "manifest": manifest}


# --- damage, each applied by rank 0 to a fresh copy of the first configuration's checkpoint ----------

def _files(d: str) -> Dict[str, Any]:
    with open(os.path.join(d, "manifest.json")) as f:
        return json.load(f)


def _rewrite_manifest(d: str, edit: Callable[[Dict[str, Any]], None]) -> None:
    m = _files(d)
    edit(m)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(m, f)


def _tensor_record_offset(path: str) -> int:
    """Where the bytes of the first tensor record (``<archive>/data/0``) begin in a torch.save file."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len = int.from_bytes(header[26:28], "little")
    extra_len = int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def flip_byte_rank1(d: str) -> None:
    path = os.path.join(d, _files(d)["files"]["1"])
    at = _tensor_record_offset(path) + 3
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def truncate_rank0(d: str) -> None:
    path = os.path.join(d, _files(d)["files"]["0"])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def swap_files(d: str) -> None:
    m = _files(d)["files"]
    a, b = os.path.join(d, m["0"]), os.path.join(d, m["1"])
    os.replace(a, a + ".swap")
    os.replace(b, a)
    os.replace(a + ".swap", b)


def swap_in_manifest(d: str) -> None:
    """A consistent manifest (checksums match) that gives each rank the other's file."""
    def edit(m: Dict[str, Any]) -> None:
        for key in ("files", "sha256", "bytes"):
            m[key] = {"0": m[key]["1"], "1": m[key]["0"]}
    _rewrite_manifest(d, edit)


def pickle_payload_rank1(d: str) -> None:
    """Rank 1's file replaced by a crafted pickle (an object whose __reduce__ creates a marker), the
    manifest's checksum updated to match: only the reading can stop it."""
    import hashlib

    path = os.path.join(d, _files(d)["files"]["1"])
    buf = io.BytesIO()
    torch.save({"model": Payload(os.path.join(d, "payload.ran")), "step": 4, "buckets": None}, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)

    def edit(m: Dict[str, Any]) -> None:
        m["sha256"]["1"] = hashlib.sha256(data).hexdigest()
        m["bytes"]["1"] = len(data)
    _rewrite_manifest(d, edit)


def missing_rank0(d: str) -> None:
    os.remove(os.path.join(d, _files(d)["files"]["0"]))


def manifest_not_json(d: str) -> None:
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write('{"step": 4, "world_size": 2, "fil')


def manifest_world_size_3(d: str) -> None:
    _rewrite_manifest(d, lambda m: m.update(world_size=3))


def manifest_path_elsewhere(d: str) -> None:
    _rewrite_manifest(d, lambda m: m["files"].update({"1": "../../etc/passwd"}))


def untouched_copy(d: str) -> None:
    """No damage: the resume on another topology is the wrapper's refusal."""


DAMAGE: Dict[str, Callable[[str], None]] = {
    "flipped_byte_rank1": flip_byte_rank1, "truncated_rank0": truncate_rank0, "swapped_files": swap_files,
    "swapped_in_manifest": swap_in_manifest, "pickle_payload_rank1": pickle_payload_rank1,
    "missing_rank0": missing_rank0, "manifest_not_json": manifest_not_json,
    "manifest_world_size_3": manifest_world_size_3, "manifest_path_elsewhere": manifest_path_elsewhere,
    "other_topology": untouched_copy,
}


def damaged_resume(rank: int, name: str, source: str, root: str) -> Dict[str, Any]:
    from decentpy import PreemptionCheckpointer

    d = os.path.join(root, name)
    if rank == 0:
        shutil.copytree(source, d)
        DAMAGE[name](d)
    dist.barrier()
    ddp = _make("other_topology" if name == "other_topology" else CONFIGS[0], 300 + rank)
    before = [p.detach().clone() for p in ddp.parameters()]
    t0 = time.monotonic()
    out: Dict[str, Any] = {"type": None, "types": [], "text": ""}
    try:
        PreemptionCheckpointer(ddp, d, every=SAVE_AT, signals=()).resume()
    except Exception as exc:  # noqa: BLE001 - checked by the parent
        out = {"type": type(exc).__name__, "types": [c.__name__ for c in type(exc).__mro__], "text": str(exc),
               "tb": traceback.format_exc()[-2000:]}
    out["seconds"] = time.monotonic() - t0
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
    out["marker"] = os.path.exists(os.path.join(d, "payload.ran"))
    # the wrapper still trains with its peers (nothing half-loaded, no collective left behind)
    _train(rank, ddp, range(2))
    ddp.wait()
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in ddp.parameters())
    ddp.close()
    t = torch.ones(1)
    dist.all_reduce(t)
    out["allreduce"] = t.item()
    return out


def worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    torch.set_num_threads(1)
    out: Dict[str, Any] = {}
    for config in CONFIGS:
        out[config] = round_trip(rank, config, os.path.join(root, config))
    for name in DAMAGE:
        out[name] = damaged_resume(rank, name, os.path.join(root, CONFIGS[0]), root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> List[Dict[str, Any]]:
    return run_workers(worker, WORLD, str(tmp_path_factory.mktemp("ckpt")), timeout=300, require_clean_exit=True)


@pytest.mark.parametrize("config", CONFIGS)
def test_the_whole_training_state_round_trips_bit_for_bit(results: List[Dict[str, Any]], config: str) -> None:
    for rank, r in enumerate(results):
        got = r[config]
        assert got["equal"], f"{config}: rank {rank}'s resumed run differs from the uninterrupted one"
        assert got["step"] == SAVE_AT and got["extra_order"] == list(range(5)) and got["note"] == "data position"
        m = got["manifest"]
        assert m["format"] == 2 and m["world_size"] == WORLD and m["step"] == SAVE_AT, m
        assert sorted(m["files"]) == ["0", "1"] and all(len(m["sha256"][r]) == 64 for r in ("0", "1")), m
        assert m["topology"] == ("ring" if "ring" in config else "complete"), m


# damage -> {rank: (exception, words)}; a rank whose own file is fine names the bad rank and its file
F0, F1 = f"rank0-step{SAVE_AT}.pt", f"rank1-step{SAVE_AT}.pt"
EXPECT: Dict[str, Dict[int, tuple]] = {
    "flipped_byte_rank1": {1: ("CheckpointError", [F1, "damaged", "SHA-256"]),
                           0: ("RuntimeError", ["failed on rank 1", "CheckpointError", F1, "damaged"])},
    "truncated_rank0": {0: ("CheckpointError", [F0, "damaged", "truncated"]),
                        1: ("RuntimeError", ["failed on rank 0", F0, "truncated"])},
    "swapped_files": {0: ("CheckpointError", [F0, "holds rank 1's checkpoint", "this is rank 0"]),
                      1: ("CheckpointError", [F1, "holds rank 0's checkpoint", "this is rank 1"])},
    "swapped_in_manifest": {0: ("CheckpointError", [F1, "holds the state of rank 1", "this is rank 0"]),
                            1: ("CheckpointError", [F0, "holds the state of rank 0", "this is rank 1"])},
    "pickle_payload_rank1": {1: ("CheckpointError", [F1, "not a plain-data training state", "weights_only=True"]),
                             0: ("RuntimeError", ["failed on rank 1", F1, "not a plain-data"])},
    "missing_rank0": {0: ("CheckpointError", [F0, "cannot be read", "No such file"]),
                      1: ("RuntimeError", ["failed on rank 0", F0])},
    "manifest_not_json": {r: ("CheckpointError", ["manifest.json", "cannot be read"]) for r in range(WORLD)},
    "manifest_world_size_3": {r: ("ValueError", ["written by 3 ranks", "has 2"]) for r in range(WORLD)},
    "manifest_path_elsewhere": {1: ("CheckpointError", ["'../../etc/passwd'", "not a file of its directory"]),
                                0: ("RuntimeError", ["failed on rank 1", "../../etc/passwd"])},
    "other_topology": {r: ("ValueError", ["topology 'ring'", "'complete'"]) for r in range(WORLD)},
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_bad_checkpoint_is_named_on_every_rank_and_nothing_is_loaded(results: List[Dict[str, Any]],
                                                                      damage: str) -> None:
    for rank, r in enumerate(results):
        got = r[damage]
        want, words = EXPECT[damage][rank]
        assert want in got["types"], f"{damage}: rank {rank} raised {got['type']} ({got['text']!r}), expected {want}"
        if want == "RuntimeError":
            assert got["type"] == "RuntimeError", (damage, rank, got["type"])  # the peer's verdict, not a local one
        for w in words:
            assert w in got["text"], f"{damage}: rank {rank}: {w!r} not in {got['text']!r}"
        assert "OSError" not in got["types"], (damage, rank, got["types"])
        assert got["untouched"], f"{damage}: rank {rank} loaded something although the resume failed"
        assert not got["marker"], f"{damage}: the payload ran on rank {rank}"
        assert got["finite"] and got["allreduce"] == WORLD, (damage, rank, got)
        assert got["seconds"] < 20, (damage, rank, got["seconds"])
