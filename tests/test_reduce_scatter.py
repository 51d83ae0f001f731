"""ReduceScatterBucketer: bucketing, exact results, callback timing, fallback, free(), bad input.

Every rank's inputs are deterministic integer-valued functions of (source rank, call index,
destination rank, element), so each rank computes the exact expected sum locally. One spawn per
world size runs every multi-process check, to keep the file fast on two cores.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_workers

CAP_SMALL_MB = 0.25  # 262144 bytes: 65536 fp32 elements across all ranks' rows
SHARD_SIZES = (1, 262144)


def _shape(numel: int) -> Tuple[int, ...]:
    return (512, 512) if numel == 262144 else (numel,)


def make_input(src: int, call: int, dst: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What rank ``src`` sends to rank ``dst`` in call ``call``: small integers, exact in any dtype."""
    j = torch.arange(numel, dtype=torch.int64)
    v = (j % 5) * (src + 1) + 8 * (call % 4) + 2 * dst + src
    return v.to(dtype).reshape(_shape(numel))


def make_input_list(rank: int, world: int, call: int, numel: int,
                    dtype: torch.dtype = torch.float32) -> List[torch.Tensor]:
    return [make_input(rank, call, dst, numel, dtype) for dst in range(world)]


def expected(rank: int, world: int, call: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    total = sum(make_input(src, call, rank, numel, torch.float64) for src in range(world))
    return total.to(dtype)


class Recorder:
    """Callbacks that record (call index, result) and count how often each fired."""

    def __init__(self) -> None:
        self.fired: List[Tuple[int, torch.Tensor]] = []

    def cb(self, call: int):
        def callback(result: torch.Tensor) -> None:
            self.fired.append((call, result.clone()))
        return callback

    def calls(self) -> List[int]:
        return [c for c, _ in self.fired]


def _check_results(rec: Recorder, rank: int, world: int, numels: Dict[int, int],
                   dtypes: Optional[Dict[int, torch.dtype]] = None) -> None:
    assert sorted(rec.calls()) == sorted(numels), \
        f"callbacks fired {rec.calls()}, expected once each of {sorted(numels)}"
    for call, result in rec.fired:
        dtype = (dtypes or {}).get(call, torch.float32)
        want = expected(rank, world, call, numels[call], dtype)
        assert result.dtype == dtype and result.shape == want.shape, (call, result.dtype, result.shape, want.shape)
        assert torch.equal(result, want), f"call {call}: wrong reduced shard"


def scenario_matrix(rank: int, world: int) -> None:
    """Caps 0 and 0.25 MB x shard sizes 1 and 262144: timing of callbacks and exact results."""
    from decentpy.reduce_scatter import ReduceScatterBucketer

    for cap in (0, CAP_SMALL_MB):
        for numel in SHARD_SIZES:
            bucketed = cap > 0 and numel * world * 4 <= cap * 1024 * 1024
            b = ReduceScatterBucketer(bucket_cap_mb=cap)
            rec = Recorder()
            n_calls = 3
            for call in range(n_calls):
                b.reduce_scatter_async(make_input_list(rank, world, call, numel), dist.group.WORLD, rec.cb(call))
                if bucketed:
                    assert rec.calls() == [], f"cap {cap} numel {numel}: callback fired before flush()"
                else:
                    assert rec.calls() == list(range(call + 1)), f"cap {cap} numel {numel}: not immediate"
            b.flush()
            assert rec.calls() == list(range(n_calls)), (cap, numel, rec.calls())
            _check_results(rec, rank, world, {c: numel for c in range(n_calls)})
            b.flush()  # a second flush fires nothing again
            assert len(rec.fired) == n_calls
            assert (len(b._buckets) == 1) == bucketed


def scenario_overflow(rank: int, world: int) -> None:
    """A bucket is flushed when the next input does not fit; an exactly full bucket works too."""
    from decentpy.reduce_scatter import ReduceScatterBucketer

    b = ReduceScatterBucketer(bucket_cap_mb=CAP_SMALL_MB)
    shard_cap = int(CAP_SMALL_MB * 1024 * 1024) // (4 * world)
    rec = Recorder()
    half_plus = shard_cap // 2 + 1
    b.reduce_scatter_async(make_input_list(rank, world, 0, half_plus), None, rec.cb(0))
    assert rec.calls() == []
    b.reduce_scatter_async(make_input_list(rank, world, 1, half_plus), None, rec.cb(1))  # does not fit
    assert rec.calls() == [0]
    b.flush()
    assert rec.calls() == [0, 1]
    # Exactly full (offset == shard_cap: the one-tensor form), then one more element overflows it.
    half = shard_cap // 2
    b.reduce_scatter_async(make_input_list(rank, world, 2, half), None, rec.cb(2))
    b.reduce_scatter_async(make_input_list(rank, world, 3, shard_cap - half), None, rec.cb(3))
    assert rec.calls() == [0, 1]
    b.reduce_scatter_async(make_input_list(rank, world, 4, 1), None, rec.cb(4))
    assert rec.calls() == [0, 1, 2, 3]
    b.flush()
    assert rec.calls() == [0, 1, 2, 3, 4]
    _check_results(rec, rank, world, {0: half_plus, 1: half_plus, 2: half, 3: shard_cap - half, 4: 1})


def scenario_out_of_order(rank: int, world: int) -> None:
    """small, big, small: the big one's callback fires at once, the small ones at flush()."""
    from decentpy.reduce_scatter import ReduceScatterBucketer

    b = ReduceScatterBucketer(bucket_cap_mb=CAP_SMALL_MB)
    rec = Recorder()
    b.reduce_scatter_async(make_input_list(rank, world, 0, 1), dist.group.WORLD, rec.cb(0))
    assert rec.calls() == []
    b.reduce_scatter_async(make_input_list(rank, world, 1, 262144), dist.group.WORLD, rec.cb(1))
    assert rec.calls() == [1]
    b.reduce_scatter_async(make_input_list(rank, world, 2, 1), dist.group.WORLD, rec.cb(2))
    assert rec.calls() == [1]
    b.flush()
    assert rec.calls() == [1, 0, 2]
    _check_results(rec, rank, world, {0: 1, 1: 262144, 2: 1})


def scenario_dtypes_and_layouts(rank: int, world: int) -> None:
    """Separate buckets per dtype; non-contiguous inputs; zero-size inputs; callback=None."""
    from decentpy.reduce_scatter import ReduceScatterBucketer

    b = ReduceScatterBucketer(bucket_cap_mb=CAP_SMALL_MB)
    rec = Recorder()
    dtypes = {0: torch.float16, 1: torch.bfloat16, 2: torch.int64, 3: torch.float16, 4: torch.float64}
    for call, dt in dtypes.items():
        b.reduce_scatter_async(make_input_list(rank, world, call, 7, dt), None, rec.cb(call))
    assert len(b._buckets) == 4 and rec.calls() == []
    b.reduce_scatter_async(make_input_list(rank, world, 99, 3), None, None)  # no callback: fine
    b.flush()
    _check_results(rec, rank, world, {c: 7 for c in dtypes}, dtypes)

    # Transposed (non-contiguous) inputs, bucketed and not: results keep the input's shape.
    for cap in (CAP_SMALL_MB, 0):
        got: List[torch.Tensor] = []
        b2 = ReduceScatterBucketer(bucket_cap_mb=cap)
        ins = [make_input(rank, 5, dst, 12).reshape(3, 4).t() for dst in range(world)]
        b2.reduce_scatter_async(ins, None, got.append)
        b2.flush()
        assert len(got) == 1 and got[0].shape == (4, 3)
        assert torch.equal(got[0], expected(rank, world, 5, 12).reshape(3, 4).t())

    got = []
    b.reduce_scatter_async([torch.empty(0, 3) for _ in range(world)], None, got.append)
    assert len(got) == 1 and got[0].shape == (0, 3)

    # A raising callback: the others in its bucket still fire, then the error surfaces.
    fired: List[int] = []

    def boom(_: torch.Tensor) -> None:
        fired.append(-1)
        raise KeyError("boom")

    b.reduce_scatter_async(make_input_list(rank, world, 0, 2), None, boom)
    b.reduce_scatter_async(make_input_list(rank, world, 1, 2), None, lambda t: fired.append(1))
    with pytest.raises(KeyError, match="boom"):
        b.flush()
    assert fired == [-1, 1]
    b.flush()
    assert fired == [-1, 1]


def scenario_free(rank: int, world: int) -> None:
    """free() fires pending callbacks, releases the bucket memory, and the bucketer stays usable."""
    from decentpy.reduce_scatter import ReduceScatterBucketer

    b = ReduceScatterBucketer(bucket_cap_mb=CAP_SMALL_MB)
    rec = Recorder()
    b.reduce_scatter_async(make_input_list(rank, world, 0, 5), None, rec.cb(0))
    b.reduce_scatter_async(make_input_list(rank, world, 1, 5, torch.float64), None, rec.cb(1))
    datas = [bk.data for bk in b._buckets.values()]
    assert len(datas) == 2 and all(d.untyped_storage().nbytes() > 0 for d in datas)
    b.free()
    assert sorted(rec.calls()) == [0, 1]
    assert all(d.untyped_storage().nbytes() == 0 for d in datas), "bucket memory not released"
    assert b._buckets == {}
    _check_results(rec, rank, world, {0: 5, 1: 5}, {1: torch.float64})
    b.free()  # idempotent
    rec2 = Recorder()
    b.reduce_scatter_async(make_input_list(rank, world, 2, 5), None, rec2.cb(2))
    b.flush()
    _check_results(rec2, rank, world, {2: 5})


def scenario_bad_input(rank: int, world: int) -> List[str]:
    """Each bad call raises on every rank before any collective; a good call afterwards still works."""
    from decentpy.reduce_scatter import ReduceScatterBucketer

    msgs: List[str] = []
    for cap in (CAP_SMALL_MB, 0):
        b = ReduceScatterBucketer(bucket_cap_mb=cap)
        good = make_input_list(rank, world, 0, 4)
        # a pending bucketed input must survive the bad calls untouched
        rec = Recorder()
        b.reduce_scatter_async(good, None, rec.cb(0))
        cases: List[Tuple[Any, type, str]] = [
            (good + [torch.zeros(4)], ValueError, f"expected exactly {world}"),
            (good[:-1] if world > 1 else [], ValueError, f"group has {world} ranks"),
            (good[:-1] + [torch.zeros(5)], ValueError if world > 1 else None,
             f"input_list[{world - 1}] has shape (5,)"),
            (good[:-1] + [torch.zeros(4, dtype=torch.float64)], TypeError if world > 1 else None,
             f"input_list[{world - 1}] has dtype torch.float64"),
            (good[:-1] + [torch.zeros(4, device="meta")], ValueError if world > 1 else None,
             f"input_list[{world - 1}] is on meta"),
            (good[:-1] + ["x"], TypeError, f"input_list[{world - 1}] is a str"),
            (torch.zeros(world, 4), TypeError, "must be a list of tensors"),
        ]
        for bad, exc_type, text in cases:
            if exc_type is None:  # world 1: a single tensor cannot mismatch another
                continue
            with pytest.raises(exc_type) as info:
                b.reduce_scatter_async(bad, None, rec.cb(1))
            assert text in str(info.value), (text, str(info.value))
            msgs.append(str(info.value))
        with pytest.raises(TypeError, match="callback_fn"):
            b.reduce_scatter_async(good, None, callback_fn=3)  # type: ignore[arg-type]
        assert rec.calls() == ([] if cap else [0])
        b.reduce_scatter_async(make_input_list(rank, world, 2, 4), None, rec.cb(2))
        b.flush()
        _check_results(rec, rank, world, {0: 4, 2: 4})
    return msgs


def scenario_subgroup(rank: int, world: int) -> None:
    """A sub-group of the even ranks: the group's size and rank are used, not the world's."""
    from decentpy.reduce_scatter import ReduceScatterBucketer

    evens = list(range(0, world, 2))
    group = dist.new_group(evens)  # collective over the world: every rank calls it
    if rank not in evens:
        return
    g_rank, g_world = evens.index(rank), len(evens)
    b = ReduceScatterBucketer(bucket_cap_mb=CAP_SMALL_MB)
    got: List[torch.Tensor] = []
    ins = [make_input(g_rank, 7, dst, 6) for dst in range(g_world)]
    b.reduce_scatter_async(ins, group, got.append)
    b.reduce_scatter_async(ins, dist.group.WORLD if g_world == world else group, got.append)
    b.flush()
    want = sum(make_input(src, 7, g_rank, 6) for src in range(g_world))
    assert len(got) == 2 and all(torch.equal(g, want) for g in got)


def all_scenarios_worker(rank: int, world: int) -> Dict[str, Any]:
    """Everything, first with the backend's native reduce-scatter, then with the all-reduce fallback."""
    from decentpy import reduce_scatter as rs

    warnings.simplefilter("ignore", FutureWarning)
    out: Dict[str, Any] = {}
    scenario_matrix(rank, world)
    scenario_overflow(rank, world)
    out["native_modes"] = dict(rs._MODE_CACHE)  # what gloo supports, as found by the first calls
    scenario_out_of_order(rank, world)
    scenario_dtypes_and_layouts(rank, world)
    scenario_free(rank, world)
    out["bad_input_messages"] = scenario_bad_input(rank, world)
    scenario_subgroup(rank, world)

    for form in ("flat", "list"):
        rs._set_mode("gloo", "cpu", form, "all_reduce")
    scenario_matrix(rank, world)
    scenario_overflow(rank, world)
    scenario_out_of_order(rank, world)
    scenario_dtypes_and_layouts(rank, world)
    out["fallback_modes"] = dict(rs._MODE_CACHE)
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reduce_scatter_bucketer(world: int) -> None:
    results = run_workers(all_scenarios_worker, world, timeout=240)
    for rank, res in enumerate(results):
        # torch's gloo implements both reduce-scatter forms on CPU, so no fallback was chosen.
        assert res["native_modes"] == {("gloo", "cpu", "flat"): "native", ("gloo", "cpu", "list"): "native"}, res
        assert set(res["fallback_modes"].values()) == {"all_reduce"}
        # the same clear messages on every rank
        assert res["bad_input_messages"] == results[0]["bad_input_messages"]


def _capability_fallback_worker(rank: int, world: int) -> Dict[str, Any]:
    """A backend that lacks reduce-scatter: the first use detects it once, the rest use all-reduce."""
    from decentpy import reduce_scatter as rs

    calls = {"native": 0}

    def missing(*args: Any, **kwargs: Any) -> None:
        calls["native"] += 1
        raise RuntimeError("Backend gloo does not support reduce_scatter")

    rs._reduce_scatter_flat = missing  # type: ignore[assignment]
    dist.reduce_scatter = missing  # type: ignore[assignment]
    rec = Recorder()
    b = rs.ReduceScatterBucketer(bucket_cap_mb=CAP_SMALL_MB)
    b.reduce_scatter_async(make_input_list(rank, world, 0, 262144), None, rec.cb(0))  # big: list form
    b.reduce_scatter_async(make_input_list(rank, world, 1, 262144), None, rec.cb(1))
    shard_cap = int(CAP_SMALL_MB * 1024 * 1024) // (4 * world)
    b.reduce_scatter_async(make_input_list(rank, world, 2, shard_cap), None, rec.cb(2))  # full bucket
    b.reduce_scatter_async(make_input_list(rank, world, 3, 1), None, rec.cb(3))  # flushes it (flat)
    b.flush()  # partial bucket: list form
    _check_results(rec, rank, world, {0: 262144, 1: 262144, 2: shard_cap, 3: 1})
    return {"native_attempts": calls["native"], "modes": dict(rs._MODE_CACHE)}


def test_capability_fallback_detected_once() -> None:
    results = run_workers(_capability_fallback_worker, 2, timeout=180)
    for res in results:
        assert res["native_attempts"] == 2  # one per form, then cached
        assert res["modes"] == {("gloo", "cpu", "flat"): "all_reduce", ("gloo", "cpu", "list"): "all_reduce"}


# ----------------------------------------------------------------------------------------------
# Single-process tests: the C++ packing, and construction.


def test_pack_into_bucket() -> None:
    from decentpy import _C

    bucket = torch.zeros(3, 10)
    ins = [torch.arange(4.0).reshape(2, 2) + 10 * r for r in range(3)]
    ins[1] = ins[1].t()  # non-contiguous: packed in its logical (row-major) order
    _C.pack_into_bucket(bucket, 3, ins)
    for r in range(3):
        assert torch.equal(bucket[r, 3:7], ins[r].reshape(-1))
        assert torch.equal(bucket[r, :3], torch.zeros(3)) and torch.equal(bucket[r, 7:], torch.zeros(3))
    _C.pack_into_bucket(bucket, 7, [torch.full((3,), float(r)) for r in range(3)])  # exactly to the end
    assert torch.equal(bucket[:, 7:], torch.arange(3.0).unsqueeze(1).expand(3, 3))
    _C.pack_into_bucket(bucket, 10, [torch.empty(0)] * 3)  # empty at the end: no-op

    hb = torch.zeros(2, 4, dtype=torch.bfloat16)
    _C.pack_into_bucket(hb, 1, [torch.tensor([1.5, 2.0], dtype=torch.bfloat16)] * 2)
    assert hb[1].tolist() == [0.0, 1.5, 2.0, 0.0]

    snapshot = bucket.clone()
    bad = [
        (bucket, 0, ins[:2], "expected 3 inputs"),
        (bucket, 0, [ins[0], ins[1], ins[2].double()], "inputs[2] has dtype Double"),
        (bucket, 0, [ins[0], torch.zeros(5), ins[2]], "inputs[1] has 5 elements"),
        (bucket, 0, [ins[0], ins[1], torch.zeros(4, device="meta")], "inputs[2] is on meta"),
        (bucket, 8, ins, "do not fit"),
        (bucket, -1, ins, "offset must be >= 0"),
        (torch.zeros(30), 0, ins, "must be 2-D"),
        (torch.zeros(10, 3).t(), 0, ins, "must be contiguous"),
        (bucket, 0, [bucket[0, :4], ins[1], ins[2]], "inputs[0] overlaps"),
    ]
    for buf, offset, inputs, text in bad:
        with pytest.raises(RuntimeError, match=re.escape(text)):
            _C.pack_into_bucket(buf, offset, inputs)
    assert torch.equal(bucket, snapshot), "a rejected call modified the bucket"


def test_constructor_validation() -> None:
    from decentpy.reduce_scatter import ReduceScatterBucketer

    assert ReduceScatterBucketer().bucket_cap_mb == 25
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ReduceScatterBucketer(-1)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ReduceScatterBucketer(float("nan"))
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        ReduceScatterBucketer("25")  # type: ignore[arg-type]
    b = ReduceScatterBucketer(1)
    b.flush()
    b.free()  # nothing pending: no collective, no process group needed
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            b.reduce_scatter_async([torch.zeros(1)], None)
