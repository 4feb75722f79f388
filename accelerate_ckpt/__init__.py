"""accelerate_ckpt: asynchronous, atomic, sharded ``Accelerator.save_state``/``load_state`` through torch-ckpt.

One line after creating the ``Accelerator``::

    ckpt = accelerate_ckpt.attach(accelerator, config="ckpt.yaml")

From then on ``accelerator.save_state()`` returns once the state is staged and writes in the
background, and ``accelerator.load_state()`` restores everything exactly. See ``docs/accelerate.md``.
"""

from accelerate_ckpt._checkpointer import NAMING, AccelerateCheckpointer, attach
from accelerate_ckpt._config import ENV_VAR, CkptSettings, load_settings
from accelerate_ckpt._state import AcceleratorTrainState

__all__ = ["ENV_VAR", "NAMING", "AccelerateCheckpointer", "AcceleratorTrainState", "CkptSettings", "attach",
           "load_settings"]
