"""Operator tools, off the save/restore path: the ``torch-ckpt`` command line, listing, inspection,
verification and export of checkpoints, and the interval sizing/simulation behind ``plan``,
``simulate`` and ``bench``.

They read checkpoints only through the storage/format layer (:mod:`torch_ckpt.format._read` and the
modules it names), the same validation path a restore uses.
"""
