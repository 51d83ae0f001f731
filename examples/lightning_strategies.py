# lightning_strategies.py -- a LightningModule trained with decentpy's Lightning strategies; see
# docs/howto/lightning.md. Needs pytorch_lightning (pip install pytorch-lightning). On one host:
#   .venv/bin/torchrun --standalone --nproc_per_node=2 examples/lightning_strategies.py --strategy gossip
#   .venv/bin/torchrun --standalone --nproc_per_node=2 examples/lightning_strategies.py --strategy diloco
# Rank 0 prints one JSON line: the validation loss of the averaged model (the checkpoint file's) and
# the checkpoint it wrote.
import argparse
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import pytorch_lightning as pl

from decentpy.integrations.lightning import DecentralizedStrategy, DiLoCoStrategy

p = argparse.ArgumentParser(description="decentpy's Lightning strategies on a small classification task")
p.add_argument("--strategy", choices=("gossip", "diloco"), default="gossip")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--out", default=None, help="checkpoint directory, the same for every rank (default: "
               "decentpy-lightning-<strategy> in the temporary directory)")
args = p.parse_args()


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


g = torch.Generator().manual_seed(0)
x, w = torch.randn(4096, 20, generator=g), torch.randn(20, 4, generator=g)
data = torch.utils.data.TensorDataset(x, (x @ w).argmax(1))
train, val = torch.utils.data.random_split(data, [3584, 512], generator=g)
train_loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True)  # Lightning adds the sampler
val_loader = torch.utils.data.DataLoader(val, batch_size=128)

if args.strategy == "gossip":
    strategy = DecentralizedStrategy(topology="ring", process_group_backend="gloo")
else:
    strategy = DiLoCoStrategy(sync_every=10, process_group_backend="gloo")
out = args.out or os.path.join(tempfile.gettempdir(), f"decentpy-lightning-{args.strategy}")
trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")), strategy=strategy,
                     max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[pl.callbacks.ModelCheckpoint(dirpath=out, filename="last")])
model = Classifier()
trainer.fit(model, train_loader, val_loader)
# the checkpoint file holds the replicas' average: validate that model
averaged = Classifier.load_from_checkpoint(os.path.join(out, "last.ckpt"))
result = trainer.validate(averaged, val_loader, verbose=False)[0]
if trainer.is_global_zero:
    print(json.dumps({"strategy": args.strategy, "val_loss_averaged": round(result["val_loss"], 4),
                      "checkpoint": os.path.join(out, "last.ckpt")}))
