"""What a checkpoint is on disk: the manifest, listed files, the values codec, DCP metadata, records, and the DCP
writer and reader."""

from torch_ckpt.format._files import Manifest, read_manifest
from torch_ckpt.format._typed_values import TypedValues

__all__ = ["Manifest", "TypedValues", "read_manifest"]
