#!/usr/bin/env python
"""Train the character-level GPT of ``examples/train_gpt.py`` with Lightning, checkpointed by torch-ckpt.

The same model and the same real data (the Python standard library's own source), imported from
``train_gpt.py``; configured entirely from YAML with LightningCLI. ``examples/lightning/config.yaml``
enables the checkpoint plugin under ``trainer.plugins`` and the MTBF callback under
``trainer.callbacks``. Lines that use the checkpoint library are marked ``# ckpt:``.

    python examples/lightning_gpt.py fit --config examples/lightning/config.yaml
    python examples/lightning_gpt.py fit --config examples/lightning/config.yaml --ckpt_path last   # resume

Two data-parallel CPU processes (Lightning starts the second one by re-running this script):

    python examples/lightning_gpt.py fit --config examples/lightning/config.yaml \\
        --trainer.strategy ddp --trainer.devices 2

Preempt a run with SIGTERM (``kill -TERM <pid>``): it saves at the next step boundary, waits until
that checkpoint is committed and stops; ``--ckpt_path last`` then continues bit for bit. For tests:
``--interrupt_at_step N`` sends that signal to itself after step N (``--interrupt_signal SIGKILL``
crashes instead), and ``--loss_log FILE`` appends one JSON line per optimizer step (rank 0; the
loss is the mean over ranks).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_gpt
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # torch_ckpt, lightning_ckpt in a source checkout
from train_gpt import GPT, CharWindows, encode, load_corpus, warmup_cosine  # noqa: E402

import lightning_ckpt  # noqa: E402,F401  ckpt: the YAML names lightning_ckpt.AsyncDCPCheckpointIO and MTBFCheckpoint


class GPTData(L.LightningDataModule):
    """Windows of the stdlib corpus, shuffled by a stateful sampler so a resumed run continues mid-epoch.

    Args:
        corpus_chars: Characters of standard-library source to train on.
        block_size: Tokens per training window.
        batch_size: Windows per batch and rank.
        max_windows: Cap the dataset at this many windows (short epochs); None uses the whole corpus.
        seed: Seed of the shuffling.
    """

    def __init__(self, corpus_chars: int = 1_000_000, block_size: int = 64, batch_size: int = 16,
                 max_windows: int | None = None, seed: int = 1234) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokens, vocab = encode(load_corpus(corpus_chars))
        self.vocab_size = len(vocab)
        self.dataset = CharWindows(self.tokens, block_size, max_windows)

    def train_dataloader(self) -> StatefulDataLoader:
        hp, world = self.hparams, self.trainer.world_size
        if world > 1:  # each rank a shard of one shuffled order; Lightning calls set_epoch every epoch
            sampler = StatefulDistributedSampler(self.dataset, num_replicas=world, rank=self.trainer.global_rank,
                                                 shuffle=True, seed=hp.seed, drop_last=True)
        else:  # a sampler that owns its generator, so the shuffle order is part of the loader's state
            sampler = RandomSampler(self.dataset, generator=torch.Generator().manual_seed(hp.seed))
        return StatefulDataLoader(self.dataset, batch_size=hp.batch_size, sampler=sampler, drop_last=True,
                                  num_workers=0, generator=torch.Generator().manual_seed(hp.seed + 1))


class GPTModule(L.LightningModule):
    """The GPT of ``train_gpt.py`` with AdamW and warmup + cosine decay per step.

    Args:
        vocab_size: Vocabulary size (linked from the data module).
        block_size: Context length.
        n_layer: Transformer blocks.
        n_head: Attention heads.
        n_embd: Embedding width.
        dropout: Dropout probability.
        lr: Peak learning rate.
        weight_decay: AdamW weight decay.
        warmup: Warmup steps.
        total_steps: Steps of the cosine schedule (set it to ``trainer.max_steps``).
        min_lr_ratio: Final learning rate as a fraction of ``lr``.
    """

    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 2, n_head: int = 4, n_embd: int = 64,
                 dropout: float = 0.1, lr: float = 3e-3, weight_decay: float = 0.1, warmup: int = 20,
                 total_steps: int = 300, min_lr_ratio: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=hp.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(hp.warmup, hp.total_steps,
                                                                               hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LossLog(L.Callback):
    """Append ``{"step", "loss"}`` per optimizer step to a JSON-lines file (rank 0; mean loss over ranks)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        if trainer.world_size > 1:
            loss = trainer.strategy.reduce(loss, reduce_op="sum") / trainer.world_size
        if trainer.is_global_zero:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(loss)}) + "\n")


class Interrupt(L.Callback):
    """After optimizer step ``step``: SIGTERM to this process on rank 0 (preemption), or SIGKILL on every rank."""

    def __init__(self, step: int, signame: str) -> None:
        self.step, self.signum = step, signal.Signals[signame]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and (self.signum == signal.SIGKILL or trainer.is_global_zero):
            os.kill(os.getpid(), self.signum)


class GPTCLI(LightningCLI):
    """LightningCLI with the data module's vocabulary linked to the model and the test knobs."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.add_argument("--loss_log", type=str | None, default=None, help="append per-step losses (JSON lines)")
        parser.add_argument("--interrupt_at_step", type=int | None, default=None, help="interrupt after this step")
        parser.add_argument("--interrupt_signal", type=str, default="SIGTERM", help="SIGTERM (preempt) or SIGKILL")

    def before_fit(self) -> None:
        config = self.config[self.subcommand]
        if config.loss_log:
            self.trainer.callbacks.insert(0, LossLog(config.loss_log))
        if config.interrupt_at_step is not None:
            self.trainer.callbacks.insert(0, Interrupt(config.interrupt_at_step, config.interrupt_signal))


def main(args: list[str] | None = None) -> None:
    """Run the CLI (``args`` defaults to ``sys.argv[1:]``)."""
    torch.set_num_threads(1)  # one intra-op thread per process keeps CPU runs bitwise reproducible
    GPTCLI(GPTModule, GPTData, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
