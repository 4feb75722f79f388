"""``python -m torch_ckpt``: the same as the ``torch-ckpt`` command."""

import sys

from torch_ckpt.tools.cli import main

if __name__ == "__main__":  # importing the module (the docs' API inspection) runs nothing
    sys.exit(main())
