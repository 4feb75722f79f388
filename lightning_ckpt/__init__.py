"""lightning-ckpt: torch-ckpt's asynchronous, atomic DCP checkpoints for PyTorch Lightning.

``Trainer(plugins=[AsyncDCPCheckpointIO()], callbacks=[MTBFCheckpoint("ckpts")])``; see
``docs/lightning.md``. A thin adapter: all checkpoint logic lives in :mod:`torch_ckpt`.
"""

from lightning_ckpt import _compat
from lightning_ckpt._callback import MTBFCheckpoint
from lightning_ckpt._checkpoint_io import AsyncDCPCheckpointIO
from lightning_ckpt._load import is_remote_checkpoint, load_from_checkpoint, read_for_lightning

# once per process, narrow (see each docstring): Lightning's own loader reads our directories; links wait for the
# commit with the plugin attached or alone; a fresh fit(model) with MTBFCheckpoint warns nothing misleading;
_compat.install_load_hook(read_for_lightning, is_remote_checkpoint)
_compat.install_cli_hook(read_for_lightning)  # LightningCLI --ckpt_path DIR parses the directory's hyper-parameters
_compat.install_link_hook()
_compat.install_fresh_fit_hook(lambda callback: isinstance(callback, MTBFCheckpoint))
# trainer.save_checkpoint outside a run returns committed (also in ddp_spawn's main process); uploading loggers warn
_compat.install_save_hook(lambda io: isinstance(io, AsyncDCPCheckpointIO),
                          lambda io, names: io.warn_uploading_loggers(names))

__all__ = ["AsyncDCPCheckpointIO", "MTBFCheckpoint", "load_from_checkpoint"]
