"""decentpy.integrations.lightning on 2 gloo CPU processes: each strategy against the same training
written without Lightning (a plain loop over decentpy's wrapper, or over decentpy.DiLoCo), to the bit;
``fit``, ``validate`` and a resume from a Lightning checkpoint (``fit(ckpt_path=...)``) against the
uninterrupted run; the checkpoint file's model is the replicas' average.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("pytorch_lightning")

STEPS = 8       # two epochs of 4 batches
EPOCH = 4
LR = 0.05
H = 3           # DiLoCo's inner steps per outer step


def _lr_at(step: int) -> float:
    """The schedule both sides follow (a LambdaLR stepped after every optimizer step)."""
    return 1.0 if step < 3 else 0.5


def _module(kind: str) -> Any:
    import pytorch_lightning as pl

    from reference import batch, loss_fn, make_mlp

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp(0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, _batch: Any, idx: int) -> torch.Tensor:
            # the data by the global step (restored by a resume), not by the loader's position (which
            # Lightning does not restore for a plain DataLoader resumed at an epoch's end)
            x, y = batch(self.global_rank, self.global_step)
            return loss_fn(self(x), y)

        def validation_step(self, batch: Any, idx: int) -> None:
            x, y = batch
            self.log("val_loss", loss_fn(self(x), y), sync_dist=True)

        def configure_optimizers(self) -> Any:
            if kind == "gossip":
                opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_at)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Net()


class _Batches(torch.utils.data.Dataset):
    """This rank's batches: index i is ``reference.batch(rank, i)`` (each epoch the same 4)."""

    def __init__(self, rank: int, n: int = EPOCH) -> None:
        self.rank, self.n = rank, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        from reference import batch

        return batch(self.rank, i)


def _trainer(strategy: Any, ckpt_dir: str = "", max_steps: int = STEPS) -> Any:
    import pytorch_lightning as pl

    callbacks = []
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1,
                                                      save_on_train_epoch_end=True, filename="{epoch}"))
    return pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, max_steps=max_steps,
                      logger=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      num_sanity_val_steps=0)


def _strategy(kind: str) -> Any:
    from decentpy.integrations.lightning import DecentralizedStrategy, DiLoCoStrategy

    if kind == "gossip":
        return DecentralizedStrategy(topology="ring", process_group_backend="gloo")
    return DiLoCoStrategy(sync_every=H, process_group_backend="gloo")


def _plain(kind: str, rank: int) -> List[torch.Tensor]:
    """The same training without Lightning."""
    import decentpy
    from reference import batch, loss_fn, make_mlp

    model = make_mlp(0)
    if kind == "gossip":
        ddp = decentpy.DecentralizedDataParallel(
            model, lambda named: torch.optim.SGD([p for _, p in named], lr=LR, momentum=0.9), topology="ring")
        for k in range(STEPS):
            for opt in ddp.optimizers:
                for g in opt.param_groups:
                    g["lr"] = LR * _lr_at(k)
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
        ddp.wait()
        ddp.close()
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with decentpy.DiLoCo(model, inner, outer, sync_every=H):
            for k in range(STEPS):
                x, y = batch(rank, k)
                inner.zero_grad()
                loss_fn(model(x), y).backward()
                inner.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # torchrun's environment: Lightning then takes the processes as launched (no launcher of its own)
    os.environ.update({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
                       "WORLD_SIZE": str(world), "TORCHELASTIC_RUN_ID": "decentpy-test"})
    out: Dict[str, Any] = {}
    loader = torch.utils.data.DataLoader(_Batches(rank), batch_size=None, shuffle=False)
    for kind in ("gossip", "diloco"):
        ckpt = os.path.join(root, kind)
        module = _module(kind)
        trainer = _trainer(_strategy(kind), ckpt)
        trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
        got = {"fit": [p.detach().clone() for p in module.parameters()], "plain": _plain(kind, rank)}
        got["val"] = trainer.validate(module, dataloaders=loader, verbose=False)[0]["val_loss"]
        # the checkpoint after the first epoch (4 steps): its model, and a resume from it
        path = os.path.join(ckpt, "epoch=0.ckpt")
        dist.barrier()
        saved = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        got["file_model"] = [saved[k] for k in sorted(saved)]
        mine = torch.load(path + f".decentpy-rank{rank}", map_location="cpu", weights_only=True)["model"]
        got["own_at_4"] = [mine[k] for k in sorted(mine)]
        module = _module(kind)
        _trainer(_strategy(kind)).fit(module, train_dataloaders=loader, ckpt_path=path)
        got["resumed"] = [p.detach().clone() for p in module.parameters()]
        out[kind] = got
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    from dist_harness import run_workers

    with tempfile.TemporaryDirectory() as root:
        return run_workers(_worker, 2, root, timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("kind", ["gossip", "diloco"])
def test_the_strategy_equals_the_plain_loop(results: List[Dict[str, Any]], kind: str) -> None:
    """Trainer.fit with the strategy ends on the parameters of the same training without Lightning
    (gossip: the wrapper stepping inside backward, the LR schedule followed; DiLoCo around
    Lightning's own AdamW), bit for bit; the replicas differ (gossip, or 2 steps after an outer step)."""
    for rank, r in enumerate(results):
        got = r[kind]
        for a, b in zip(got["fit"], got["plain"]):
            assert torch.equal(a, b), (kind, rank, float((a - b).abs().max()))
    assert not all(torch.equal(a, b) for a, b in zip(results[0][kind]["fit"], results[1][kind]["fit"]))


@pytest.mark.parametrize("kind", ["gossip", "diloco"])
def test_a_lightning_checkpoint_resumes_every_rank_bit_for_bit(results: List[Dict[str, Any]], kind: str) -> None:
    """fit(ckpt_path=the epoch-0 checkpoint) on a fresh module and strategy ends where the
    uninterrupted fit ended; the checkpoint file's model is the average of the ranks' own."""
    for rank, r in enumerate(results):
        got = r[kind]
        for a, b in zip(got["fit"], got["resumed"]):
            assert torch.equal(a, b), (kind, rank, float((a - b).abs().max()))
        assert torch.isfinite(torch.tensor(got["val"]))
    own = [r[kind]["own_at_4"] for r in results]
    for k, avg in enumerate(results[0][kind]["file_model"]):
        torch.testing.assert_close(avg, (own[0][k] + own[1][k]) / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["gossip", "diloco"])
def test_the_example_runs_as_documented(strategy: str, tmp_path: Any) -> None:
    """examples/lightning_strategies.py under torchrun (the docs' command, fewer steps): it trains,
    writes the checkpoint and validates the averaged model from it."""
    import json

    from dist_harness import torchrun

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = torchrun(os.path.join(root, "examples", "lightning_strategies.py"), 2, {}, timeout=240,
                    args=["--strategy", strategy, "--steps", "20", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert line["strategy"] == strategy and 0.0 < line["val_loss_averaged"] < 1.39  # below chance (ln 4)
    assert os.path.exists(os.path.join(tmp_path, "last.ckpt.decentpy-rank1"))
