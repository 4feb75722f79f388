"""Reading a checkpoint back: planning, the checked read into new buffers, the copy into live tensors and the
choice of the step to resume. Used through :meth:`torch_ckpt.CheckpointManager.restore`; nothing public here."""

__all__: list[str] = []
