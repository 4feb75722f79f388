"""Every private attribute of Accelerate the adapter touches (no public accessors exist for the prepared objects or
the hook tables), checked against accelerate 1.0.1 and 1.15.0 (the ``accelerate`` extra's range);
:func:`check_supported` fails at ``attach()`` when one is missing."""

from __future__ import annotations

from typing import Any

from torch_ckpt import ConfigError

# Accelerator._models/_optimizers/_schedulers/_dataloaders/_custom_objects: the prepared objects in order;
# _save_model_state_pre_hook/_load_model_state_pre_hook: {handle id: hook} of register_*_state_pre_hook
_ATTRS = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects",
          "_save_model_state_pre_hook", "_load_model_state_pre_hook")


def check_supported(acc: Any) -> None:
    """Raise ConfigError for engines that save models themselves, or an Accelerate without these attributes."""
    kind = str(getattr(acc, "distributed_type", ""))
    for name in ("DEEPSPEED", "MEGATRON_LM", "XLA"):
        if kind.endswith(name):
            raise ConfigError(f"accelerate_ckpt does not support distributed_type {name}: its engine saves the model "
                              "and optimizer itself. Use Accelerate's own save_state for it (enabled: false).")
    missing = [a for a in _ATTRS if not hasattr(acc, a)]
    if missing or not hasattr(acc.project_configuration, "iteration"):
        raise ConfigError(f"this Accelerate version has no Accelerator.{(missing or ['iteration'])[0]}; "
                          "accelerate_ckpt supports accelerate 1.0.1 to 1.15 (the pyproject extra)")


def prepared(acc: Any, kind: str) -> list[Any]:
    """The prepared ``models``, ``optimizers``, ``schedulers``, ``dataloaders`` or ``custom_objects``."""
    return list(getattr(acc, f"_{kind}"))


def hooks(acc: Any, kind: str) -> dict[int, Any]:
    """The ``save`` or ``load`` state pre-hooks the user registered, ``{handle id: hook}``."""
    return getattr(acc, f"_{kind}_model_state_pre_hook")


def hooked_models(acc: Any) -> list[Any]:
    """The prepared models the save/load pre-hooks see: none under FSDP (Accelerate saves those before the hooks)."""
    return [] if str(acc.distributed_type).endswith("FSDP") else prepared(acc, "models")


def save_iteration(acc: Any) -> int:
    """``accelerator.save_iteration``, a read-only property over ``project_configuration.iteration``."""
    return int(acc.project_configuration.iteration)


def set_save_iteration(acc: Any, value: int) -> None:
    acc.project_configuration.iteration = int(value)  # the attribute behind save_iteration


def plain_load_state(acc: Any, folder: str, load_kwargs: Any, kwargs: dict) -> None:
    """Accelerate's own ``load_state`` (the class method); ``load_kwargs`` exists since 1.1 (1.0.1 lacks it)."""
    extra = {} if load_kwargs is None else {"load_kwargs": load_kwargs}
    type(acc).load_state(acc, folder, **extra, **kwargs)


def loader_state(loader: Any) -> dict[str, Any]:
    """A prepared loader's epoch (``DataLoaderShard``/``DataLoaderDispatcher.iteration``) and, for a stateful one,
    its ``state_dict()``."""
    epoch = getattr(loader, "iteration", None)
    out: dict[str, Any] = {"epoch": epoch} if isinstance(epoch, int) else {}
    if getattr(loader, "use_stateful_dataloader", False):
        out["state"] = loader.state_dict()
    return out


def load_loader_state(loader: Any, entry: dict[str, Any]) -> None:
    """Put back what :func:`loader_state` took (``dl_state_dict``: what ``state_dict()`` returns until the next
    batch)."""
    if "epoch" in entry and callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(int(entry["epoch"]))  # public; also sets a seedable sampler's epoch
    elif "epoch" in entry:
        loader.iteration = int(entry["epoch"])
    if "state" in entry:
        loader.load_state_dict(entry["state"])
        if hasattr(loader, "dl_state_dict"):
            loader.dl_state_dict = entry["state"]
