"""``python -m torch_ckpt``: the same as the ``torch-ckpt`` command."""

import sys

from torch_ckpt.tools.cli import main

sys.exit(main())
