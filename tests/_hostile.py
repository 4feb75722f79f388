"""Plant a malicious DCP ``.metadata`` pickle in a committed checkpoint (manifest fixed up to match)."""

from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path


class _Payload:
    """Unpickling this runs ``touch MARKER``: proof that code from a checkpoint was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_malicious_metadata(step_dir: Path, marker: Path) -> None:
    """Overwrite ``step_dir/.metadata`` with a code-running pickle and make the manifest agree with it."""
    data = pickle.dumps(_Payload(marker))
    (step_dir / ".metadata").write_bytes(data)
    manifest_path = step_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    manifest_path.write_text(json.dumps(manifest))
