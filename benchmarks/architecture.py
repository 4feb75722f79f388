"""How wide the code is, measured: modules and Python calls inside torch_ckpt for one save and one restore.

One ``CheckpointManager.save`` of a small ``TrainState`` (to commit, every thread) and one ``restore`` into fresh
objects (each by a manager constructed before the count starts) are profiled with ``sys.setprofile`` and
``threading.setprofile``; a call
counts when its code object lives in a file of ``torch_ckpt/``. Also printed: core and adapter line counts
(``wc -l`` of every ``.py``), top-level modules, subpackages. Prints JSON (``--json PATH`` also writes it).

    python benchmarks/architecture.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import torch_ckpt  # noqa: E402

PKG = Path(torch_ckpt.__file__).resolve().parent


class _Calls:
    """Counts calls whose code lives in torch_ckpt, per module, across every thread."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg):  # noqa: ANN001 (profile hook signature)
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(str(PKG)):
            rel = Path(path).resolve().relative_to(PKG.parent).with_suffix("")
            with self._lock:
                self.calls[".".join(rel.parts)] += 1

    def __enter__(self) -> _Calls:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def summary(self) -> dict:
        return {"modules": len(self.calls), "calls": sum(self.calls.values()),
                "per_module": dict(self.calls.most_common())}


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return torch_ckpt.TrainState(model=model, optimizer=opt, step=1)


def _lines(*dirs: str) -> int:
    return sum(len(p.read_text().splitlines(True)) for d in dirs for p in (ROOT / d).rglob("*.py"))


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        warm = torch_ckpt.CheckpointManager(Path(tmp) / "warm")  # imports and first-use caches outside the count
        warm.save(1, _state()).committed.result()
        warm.restore(_state())
        warm.close()
        mgr = torch_ckpt.CheckpointManager(Path(tmp) / "run")
        state = _state()
        with _Calls() as save_calls:
            mgr.save(1, state).committed.result()
        mgr.close()
        mgr = torch_ckpt.CheckpointManager(Path(tmp) / "run")
        fresh = _state()
        with _Calls() as restore_calls:
            mgr.restore(fresh)
        mgr.close()
    return {
        "save": save_calls.summary(),
        "restore": restore_calls.summary(),
        "lines": {"core": _lines("torch_ckpt"), "adapters": _lines("lightning_ckpt", "accelerate_ckpt")},
        "top_level_modules": len(list(PKG.glob("*.py"))),
        "subpackages": sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()),
        "public_names": len(torch_ckpt.__all__),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--per-module", action="store_true", help="also print the calls of each module")
    args = p.parse_args()
    out = measure()
    if not args.per_module:
        for k in ("save", "restore"):
            out[k] = {**out[k], "per_module": sorted(out[k]["per_module"])}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
