"""Operator tools, off the save/restore path: the ``torch-ckpt`` command line, listing, inspection,
verification, export and import of checkpoints, and the interval sizing and simulation behind
``plan``, ``simulate`` and ``bench``. They read checkpoints only through :mod:`torch_ckpt.format`,
the validation path a restore uses. Names load on first use (``plan`` starts without torch).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    **dict.fromkeys(("export_safetensors", "export_torch", "import_dcp", "load_full_state", "prepare_dcp_load"),
                    "convert"),
    **dict.fromkeys(("find_checkpoint", "list_root", "verify_checkpoint", "verify_path", "verify_root"), "listing"),
    "inspect_checkpoint": "listing",
    **dict.fromkeys(("checkpoint_size", "interval_plan", "measure_floors", "recommend"), "sizing"),
    **dict.fromkeys(("simulate_overhead", "sweep", "plot_sweep"), "simulate"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'torch_ckpt.tools' has no attribute {name!r}")
    return getattr(import_module(f"torch_ckpt.tools.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
