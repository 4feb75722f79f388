"""Stand-in for the parts of ``transformers`` that Accelerate's ``external_deps/test_checkpointing.py`` imports.

The script loads ``bert-base-cased`` from the Hugging Face hub, which this machine cannot reach; it runs
unmodified against these small local equivalents instead (``peer_suites.script`` puts this folder first on
``PYTHONPATH`` for the script only). The checkpointing the script tests (``save_state``, ``load_state``,
exact accuracy and learning rates after the resume) is Accelerate's and ours, not the model's.
"""

from __future__ import annotations

import random
import zlib
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

VOCAB = 512


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class BatchEncoding(dict):
    """A dict of tensors with ``.to(device)``, as the script uses it."""

    def to(self, device):
        for k, v in self.items():
            self[k] = v.to(device)
        return self


class _Tokenizer:
    """Words to ids by CRC-32 (0 is padding, 1 the separator)."""

    def _ids(self, text: str) -> list[int]:
        return [2 + zlib.crc32(w.encode()) % (VOCAB - 2) for w in text.split()]

    def __call__(self, first, second, truncation=True, max_length=None):
        ids = [self._ids(a) + [1] + self._ids(b) for a, b in zip(first, second)]
        return {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}

    def pad(self, examples, padding="longest", max_length=None, return_tensors="pt"):
        width = max_length if padding == "max_length" else max(len(e["input_ids"]) for e in examples)
        out = BatchEncoding()
        for key in examples[0]:
            if key in ("input_ids", "attention_mask"):
                out[key] = torch.tensor([e[key] + [0] * (width - len(e[key])) for e in examples])
            else:
                out[key] = torch.tensor([e[key] for e in examples])
        return out


class AutoTokenizer:
    @staticmethod
    def from_pretrained(name: str, **kwargs) -> _Tokenizer:
        return _Tokenizer()


class _Classifier(nn.Module):
    """Mean of the token embeddings, then a linear layer to two classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, 2)

    def forward(self, input_ids, attention_mask, labels=None, **kwargs):
        mask = attention_mask.unsqueeze(-1).float()
        logits = self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits)


class AutoModelForSequenceClassification:
    @staticmethod
    def from_pretrained(name: str, **kwargs) -> _Classifier:
        return _Classifier()  # initialised from torch's RNG, which the script seeds first


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps: int, num_training_steps: int):
    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
