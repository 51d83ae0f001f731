"""Local steps' one home (decentpy/local_steps): the settings object, the wrapper's two spellings of
it, and the window clock against the schedules stated directly from the algorithm (Streaming
DiLoCo: fragment ``k % F`` starts its exchange ``tau`` inner steps before the end of each period of
``H / F`` steps and applies it at the end).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

import decentpy
from decentpy.local_steps import LocalSteps, WindowClock, resolve_local_steps
from reference import make_mlp


def _schedule(h: int, f: int, tau: int, steps: int) -> List[Tuple[int, Optional[int], bool]]:
    """(iteration, fragment launched, applied) from the rule itself: iteration ``s`` (0-based) ends
    period ``(s + 1 + tau) / (H / F)`` when that divides; an exchange started there applies ``tau``
    iterations later."""
    period = h // f
    out, launched = [], 0
    for s in range(steps):
        frag = launched % f if (s + 1 + tau) % period == 0 else None
        if frag is not None:
            launched += 1
        applied = (s + 1) % period == 0 and s + 1 >= period  # the window's end
        out.append((s, frag, applied))
    return out


@pytest.mark.parametrize("h, f, tau", [(1, 1, 0), (4, 1, 0), (4, 1, 3), (8, 4, 0), (8, 4, 1), (12, 3, 2), (6, 2, 2)])
def test_the_clock_follows_the_streaming_schedule(h: int, f: int, tau: int) -> None:
    clock = WindowClock(LocalSteps(sync_every=h, fragments=f, fragment_sync_delay=tau))
    got = []
    for s in range(5 * h):
        frag = clock.tick()
        applied = clock.apply_due
        got.append((s, frag, applied))
        if applied:
            clock.applied()
    assert got == _schedule(h, f, tau, 5 * h)
    assert clock.outer_steps == 5 * f


def test_a_dropped_exchange_keeps_the_count_running() -> None:
    """An exchange dropped without its outer step (an elastic re-formation): the next starts one
    period later, as if the first had not been launched, and its weight counts both windows."""
    clock = WindowClock(LocalSteps(sync_every=4))
    launches = [s for s in range(12) if clock.tick() is not None]
    assert launches == [3, 7, 11] and clock.inner_steps == 12 and clock.outer_steps == 0


def test_the_time_budget_window() -> None:
    now = [0.0]
    clock = WindowClock(LocalSteps(sync_every_s=2.5), lambda: now[0])
    clock.start()
    ends = []
    for s in range(10):
        now[0] += 1.0
        if clock.tick() is not None:
            assert clock.apply_due
            ends.append((s, clock.inner_steps))
            clock.applied()
    assert ends == [(2, 3), (5, 3), (8, 3)]
    state = clock.state_dict()
    other = WindowClock(LocalSteps(sync_every_s=2.5))
    other.load_state_dict(state)
    assert (other.outer_steps, other.inner_steps) == (3, 1)


def test_the_wrapper_takes_the_settings_as_one_object() -> None:
    params = inspect.signature(decentpy.DecentralizedDataParallel.__init__).parameters
    # the local-steps settings are one parameter (LocalSteps' fields reach it through **keywords)
    assert not {"outer_optim", "sync_every_s", "fragments", "fragment_sync_delay", "fragment_update_alpha"} & set(params)
    assert params["keywords"].kind is inspect.Parameter.VAR_KEYWORD
    assert "LocalSteps" in str(params["local_steps"].annotation)
    # the two spellings resolve to the same settings
    assert resolve_local_steps(8, fragments=4, fragment_sync_delay=1, fragment_update_alpha=0.5) == \
        LocalSteps(sync_every=8, fragments=4, fragment_sync_delay=1, fragment_update_alpha=0.5)
    assert resolve_local_steps(LocalSteps(sync_every=8)) == resolve_local_steps(8)
    assert resolve_local_steps(1, sync_every_s=3.0) == LocalSteps(sync_every_s=3.0)
    assert resolve_local_steps(1, outer_optim=len) == LocalSteps(sync_every=1, outer_optim=len)
    assert resolve_local_steps(1) is None and resolve_local_steps(1, fragments=1, fragment_sync_delay=0) is None


@pytest.mark.parametrize("args, kw, exc, text", [
    ((0,), {}, ValueError, "local_steps must be an int >= 1 (inner steps per outer step) or a decentpy.LocalSteps, got 0"),
    ((True,), {}, TypeError, "got True (bool)"),
    ((2.5,), {}, TypeError, "got 2.5 (float)"),
    ((1,), {"fragments": 2}, ValueError, "fragments=2 streams the outer steps of local steps: give local_steps=H"),
    ((1,), {"fragments": True}, ValueError, "fragments=True streams"),
    ((LocalSteps(sync_every=4),), {"fragments": 2}, ValueError, "in LocalSteps(...) or as keywords, not both"),
    ((LocalSteps(sync_every=4, fragments=3),), {}, ValueError, "local_steps=4 must be a multiple of the number of fragments"),
    ((4,), {"sync_every_s": 2.0}, ValueError, "give local_steps (inner steps) or sync_every_s (seconds), not both"),
    ((1,), {"fragment": 2}, TypeError, "unexpected keyword argument 'fragment' (did you mean 'fragments'?)"),
    ((LocalSteps(sync_every_s=2.0, sparse=decentpy.SparseOuter()),), {}, ValueError,
     "sparse (SparseLoCo's outer exchange) takes neither sync_every_s"),
    ((LocalSteps(sync_every=4, sparse=decentpy.SparseOuter(k=6)),), {}, ValueError, "k must be a multiple of 4"),
    ((LocalSteps(sync_every=4, sparse=64),), {}, TypeError, "sparse must be a decentpy.SparseOuter or None, got int"),
])
def test_bad_settings_are_named(args: tuple, kw: dict, exc: type, text: str) -> None:
    with pytest.raises(exc) as info:
        resolve_local_steps(*args, **kw)
    assert text in str(info.value), str(info.value)


def test_the_sparse_exchange_is_uncompressed_over_torch() -> None:
    opts = LocalSteps.sparseloco(sync_every=8)
    opts.check_exchange(None)  # fine
    LocalSteps(sync_every=8).check_exchange("int8", "nccl")  # (no sparse: no rule here)
    for args, text in [(("int8",), "give sparse= or compression='int8', not both"),
                       ((None, "nccl"), "use comm='torch' or 'auto', got comm='nccl'")]:
        with pytest.raises(ValueError, match=re.escape(text)):
            opts.check_exchange(*args)
    g = opts.outer_optimizer([torch.zeros(2, requires_grad=True)]).param_groups[0]
    assert (g["lr"], g["momentum"]) == (1.0, 0.0) and opts.sparse == decentpy.SparseOuter(k=64, chunk=4096, decay=0.95)


def test_every_combination_of_the_rules_agrees_with_the_period() -> None:
    """check() returns H / F for every valid (H, F, tau) and refuses every invalid one."""
    for h, f, tau in itertools.product(range(1, 9), range(1, 5), range(0, 5)):
        ok = h % f == 0 and tau < h // f
        if ok:
            assert LocalSteps(sync_every=h, fragments=f, fragment_sync_delay=tau).check() == h // f
        else:
            with pytest.raises(ValueError):
                LocalSteps(sync_every=h, fragments=f, fragment_sync_delay=tau).check()


# -- both faces, one configuration, bit for bit ----------------------------------------------------
# The engine (``DecentralizedDataParallel(local_steps=...)``, its optimizer built per bucket) and the
# torchft face (``decentpy.DiLoCo`` around the script's own optimizer) run the same DiLoCo: the same
# inner optimizer (RMSprop: an optimizer the engine steps as torch does, not through its fused
# kernels), the same window clock, the same outer exchange and outer step. On two ranks every
# exchange is a pair's (0.5 a + 0.5 b on both ends, whatever the buffers' split), so the two faces
# must agree to the bit (one bucket). A compressed exchange quantises in blocks of the flat buffer,
# whose order is the engine's bucket order (the gradients' arrival order) on one face and the model's
# on the other: the int8 cases train a model of one parameter, where the two orders are one.
FACE_CASES: Dict[str, Dict[str, Any]] = {
    "complete": dict(topology="complete"),
    "gossip": dict(topology="ring"),
    "delay-alpha": dict(topology="complete", fragment_sync_delay=1, fragment_update_alpha=0.5),
    "timed": dict(topology="complete", sync_every_s=2.5),
    "int8": dict(topology="complete", compression="int8"),
    "int8-gossip": dict(topology="ring", compression="int8"),
    # SparseLoCo's exchange: 3 chunks of 32 elements, 4 entries sent per chunk
    "sparse": dict(topology="complete", sparse=decentpy.SparseOuter(k=4, chunk=32, decay=0.95)),
    "sparse-delay-alpha": dict(topology="complete", sparse=decentpy.SparseOuter(k=8, chunk=16, decay=0.9),
                               fragment_sync_delay=1, fragment_update_alpha=0.5),
    # the sparse gossip outer step: [theta; delta] (192 elements) in 6 chunks against public copies
    "sparse-gossip": dict(topology="ring", sparse=decentpy.SparseOuter(k=4, chunk=32, gamma=0.5)),
}
FACE_H = 3
FACE_STEPS = 11


def _one_parameter() -> torch.nn.Module:
    from reference import IN, OUT

    torch.manual_seed(0)
    return torch.nn.Linear(IN, OUT, bias=False)


class _WideHead(torch.nn.Module):
    """One parameter of 96 elements (no padding in a bucket: a sparse buffer's chunks are then the
    same on both faces), of which the output reads 18."""

    def __init__(self) -> None:
        super().__init__()
        from reference import IN

        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(IN, 16) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from reference import OUT

        return x @ self.weight[:, :OUT]


def _rmsprop(params: Any) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-2, foreach=False)


def _faces_worker(rank: int, world: int) -> Dict[str, Any]:
    import decentpy.engine.local_steps as engine_local_steps
    from reference import batch, loss_fn

    torch.set_num_threads(1)
    now = [0.0]
    speed = 1.0 + rank  # rank 1's clock runs twice as fast: its windows hold fewer inner steps
    engine_local_steps.CLOCK = lambda: now[0]
    out: Dict[str, Any] = {}
    for name, case in FACE_CASES.items():
        kw = dict(case)
        timed = "sync_every_s" in kw
        topology = kw.pop("topology")
        # a time budget of 2.5 s: windows of 3 inner steps on rank 0 (1 s each), 2 on rank 1 (2 s each);
        # each rank stops after its third outer step (the pair exchanges the same number of times)
        steps = (3 * (3 if rank == 0 else 2)) if timed else FACE_STEPS
        # (one parameter where the layout matters: a compressed or sparse buffer is cut into blocks or chunks)
        model = (_WideHead if "sparse" in kw else _one_parameter if "compression" in kw
                 else functools.partial(make_mlp, 0))
        # the engine's face
        now[0] = 0.0
        m = model()
        ddp = decentpy.DecentralizedDataParallel(
            m, lambda named: _rmsprop([p for _, p in named]), topology=topology, bucket_size_in_mb=64,
            local_steps=decentpy.LocalSteps(sync_every=None if timed else FACE_H, **{
                k: v for k, v in kw.items() if k != "compression"}), compression=kw.get("compression"))
        order = [id(p) for b in ddp.buckets for p in b.params]
        for k in range(steps):
            x, y = batch(rank, k)
            loss = loss_fn(ddp(x), y)
            now[0] += speed  # an iteration's time passes between its forward and its backward (both faces alike)
            loss.backward()
        ddp.wait()
        engine = [p.detach().clone() for p in m.parameters()]
        engine_outer = ddp.outer_steps
        ddp.close()
        # the torchft face
        now[0] = 0.0
        m = model()
        inner = _rmsprop(m.parameters())
        outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with decentpy.DiLoCo(m, inner, outer, sync_every=None if timed else FACE_H, topology=topology,
                             clock=lambda: now[0], **kw) as d:
            for k in range(steps):
                x, y = batch(rank, k)
                inner.zero_grad()
                loss = loss_fn(m(x), y)
                now[0] += speed
                loss.backward()
                inner.step()
            face_outer = d.outer_steps
        out[name] = {"engine": engine, "face": [p.detach().clone() for p in m.parameters()],
                     "outer_steps": (engine_outer, face_outer), "model_order": order == [id(p) for p in m.parameters()],
                     "start": [p.detach().clone() for p in model().parameters()]}
    return out


@pytest.mark.timeout(300)
def test_one_configuration_through_both_faces_is_bit_equal() -> None:
    from dist_harness import run_workers

    results = run_workers(_faces_worker, 2, timeout=240)
    for rank, r in enumerate(results):
        for name in FACE_CASES:
            got = r[name]
            e, f = got["engine"], got["face"]
            assert got["outer_steps"][0] == got["outer_steps"][1] > 0, (rank, name, got["outer_steps"])
            diffs = [float((a - b).abs().max()) for a, b in zip(e, f)]
            assert all(torch.equal(a, b) for a, b in zip(e, f)), (rank, name, diffs, got["model_order"])
            assert not all(torch.equal(a, b) for a, b in zip(e, got["start"])), (rank, name)  # it trained


def test_settings_compare_partial_outer_optimizers_by_their_arguments() -> None:
    """The cross-rank agreement sees an outer optimizer given as ``functools.partial`` by its
    arguments (lr 0.7 on one rank and 0.5 on another must not pass as equal), as LocalSteps.noloco
    builds it."""
    from decentpy.comm.agreement import comparable

    a = decentpy.LocalSteps.noloco(sync_every=8)
    b = decentpy.LocalSteps.noloco(sync_every=8, outer_lr=0.5)
    assert comparable(a.settings()) == comparable(decentpy.LocalSteps.noloco(sync_every=8).settings())
    assert comparable(a.settings()) != comparable(b.settings())
    assert a.check() == 8 and a.outer_pull == 1.0
    opt = a.outer_optimizer([torch.zeros(3, requires_grad=True)])
    g = opt.param_groups[0]
    assert (type(opt), g["lr"], g["momentum"], g["nesterov"]) == (torch.optim.SGD, 0.7, 0.5, False)
    with pytest.raises(ValueError, match="outer_pull must be a number >= 0"):
        decentpy.LocalSteps(sync_every=4, outer_pull=float("nan")).check()
