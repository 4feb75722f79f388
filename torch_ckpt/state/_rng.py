"""Capture and restore every random-number generator of this process (one rank).

Covered: Python ``random``, NumPy's global generator, torch's CPU generator, and the generator of
every CUDA device (and MPS / XPU when present). The result is plain data (ints, numpy arrays,
uint8 tensors) that :mod:`torch_ckpt.format._codec` stores without pickling.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from torch_ckpt.errors import CheckpointCorruptError

__all__ = ["capture_rng_state", "check_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """Return the state of every RNG this process uses.

    Returns:
        ``{"python": {...}, "numpy": {...}, "torch_cpu": uint8 tensor, "cuda": [uint8 tensor per
        device], ...}``. Accelerator entries are present only when that backend is initialised.
    """
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "mt": list(mt), "gauss": gauss},
        "numpy": {
            "kind": np_state[0],
            "keys": np.asarray(np_state[1], dtype=np.uint32),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        state["xpu"] = list(torch.xpu.get_rng_state_all())
    if hasattr(torch, "mps") and torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def _host_states(state: Any) -> tuple[tuple, tuple, torch.Tensor]:
    py = state["python"]
    npst = state["numpy"]
    py_state = (int(py["version"]), tuple(int(x) for x in py["mt"]), py["gauss"])
    np_state = (npst["kind"], np.asarray(npst["keys"], dtype=np.uint32), int(npst["pos"]), int(npst["has_gauss"]),
                float(npst["cached_gaussian"]))
    cpu = state["torch_cpu"]
    if not isinstance(cpu, torch.Tensor):
        raise TypeError(f"torch_cpu is a {type(cpu).__name__}, not a tensor")
    return py_state, np_state, cpu.to(torch.uint8).cpu()


def check_rng_state(state: Any) -> None:
    """Check that :func:`restore_rng_state` would accept ``state``, on scratch generators (nothing live changes).

    Raises:
        CheckpointCorruptError: a required entry is missing or malformed.
    """
    try:
        py_state, np_state, cpu = _host_states(state)
        random.Random().setstate(py_state)
        np.random.RandomState().set_state(np_state)
        torch.Generator().set_state(cpu)
        for kind in ("cuda", "xpu"):
            devices = state.get(kind)
            if devices is not None and not all(isinstance(s, torch.Tensor) for s in devices):
                raise TypeError(f"{kind} generator states are not tensors")
    except (KeyError, IndexError, OverflowError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"RNG state in checkpoint is malformed ({exc!r})") from exc


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture_rng_state`.

    Accelerator states are restored for as many devices as both the checkpoint and this process
    have; a checkpoint from a CPU-only run leaves accelerator generators untouched.

    Raises:
        CheckpointCorruptError: a required entry is missing or malformed.
    """
    check_rng_state(state)  # nothing is set unless every host generator accepts its state
    py_state, np_state, cpu = _host_states(state)
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), device)
    xpu = state.get("xpu")
    if xpu and hasattr(torch, "xpu") and torch.xpu.is_available():
        for device, s in enumerate(xpu[: torch.xpu.device_count()]):
            torch.xpu.set_rng_state(s.cpu(), device)
    mps = state.get("mps")
    if mps is not None and hasattr(torch, "mps") and torch.backends.mps.is_available():
        torch.mps.set_rng_state(mps.cpu())
