"""Writing a checkpoint: staging into host memory, the asynchronous engine, persist (thread or writer process)
and the commit."""

from torch_ckpt.handle import SaveStats
from torch_ckpt.save._after_commit import AfterCommit
from torch_ckpt.save._checkpointer import AsyncCheckpointer
from torch_ckpt.save._reports import SaveReports

__all__ = ["AfterCommit", "AsyncCheckpointer", "SaveStats", "SaveReports"]
