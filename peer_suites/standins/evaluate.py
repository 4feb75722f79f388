"""Stand-in for ``evaluate.load("glue", "mrpc")``: accuracy (see ``transformers.py`` beside it)."""

from __future__ import annotations


class _Accuracy:
    def __init__(self) -> None:
        self.correct = self.total = 0

    def add_batch(self, predictions, references) -> None:
        self.correct += int((predictions == references).sum())
        self.total += len(references)

    def compute(self) -> dict:
        accuracy = self.correct / max(1, self.total)
        self.correct = self.total = 0
        return {"accuracy": accuracy}


def load(path: str, config_name: str | None = None, **kwargs) -> _Accuracy:
    return _Accuracy()
