"""accelerate_ckpt: asynchronous, atomic, sharded ``Accelerator.save_state``/``load_state`` through torch-ckpt.

``ckpt = accelerate_ckpt.attach(accelerator, config="ckpt.yaml")`` after creating the ``Accelerator``: then
``save_state()`` returns once the state is staged and ``load_state()`` restores everything exactly
(``docs/accelerate.md``).
"""

from accelerate_ckpt._checkpointer import ENV_VAR, NAMING, AccelerateCheckpointer, CkptSettings, attach, load_settings
from accelerate_ckpt._state import AcceleratorTrainState

__all__ = ["ENV_VAR", "NAMING", "AccelerateCheckpointer", "AcceleratorTrainState", "CkptSettings", "attach",
           "load_settings"]
