"""Stand-in for ``datasets.load_dataset("nyu-mll/glue", "mrpc")`` (see ``transformers.py`` beside it).

Sentence pairs made from a fixed seed; the label says whether both sentences start with the same word.
"""

from __future__ import annotations

import random

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


class Dataset:
    """Columns of equal length; rows by index."""

    def __init__(self, columns: dict[str, list]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.columns.items()}

    def map(self, fn, batched=True, remove_columns=(), load_from_cache_file=True):
        new = {k: v for k, v in self.columns.items() if k not in remove_columns}
        new.update(fn(self.columns))
        return Dataset(new)

    def rename_column(self, old: str, new: str) -> Dataset:
        return Dataset({new if k == old else k: v for k, v in self.columns.items()})


class DatasetDict(dict):
    def map(self, *args, **kwargs) -> DatasetDict:
        return DatasetDict({k: v.map(*args, **kwargs) for k, v in self.items()})

    def rename_column(self, old: str, new: str) -> DatasetDict:
        return DatasetDict({k: v.rename_column(old, new) for k, v in self.items()})


def _split(rng: random.Random, n: int) -> Dataset:
    cols: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i in range(n):
        a = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        b = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        if rng.random() < 0.5:
            b[0] = a[0]
        cols["sentence1"].append(" ".join(a))
        cols["sentence2"].append(" ".join(b))
        cols["label"].append(int(a[0] == b[0]))
        cols["idx"].append(i)
    return Dataset(cols)


def load_dataset(path: str, name: str | None = None, **kwargs) -> DatasetDict:
    rng = random.Random(0)
    return DatasetDict(train=_split(rng, 128), validation=_split(rng, 64))
