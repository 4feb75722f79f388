"""Helpers shared by the benchmark scripts (run them as ``python benchmarks/NAME.py``).

What two or more scripts do the same way lives here: the timestamped log line, the ``--methods``
list, the disk floor (chunked write + fsync), DCP's reused ``DefaultStager``, closing the methods,
a local moto S3 server, spawning gloo ranks, and writing the JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHUNK = 16 << 20  # bytes per os.write of the disk floor


def git_info() -> dict[str, Any]:
    """Commit of the checkout and whether the library has uncommitted changes (results depend on it)."""

    def git(*a):
        try:
            return subprocess.run(
                ["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "torch_ckpt")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "library_dirty": bool(status) if status is not None else None,
    }


def make_log(name: str) -> Callable[[str], None]:
    """A ``log(msg)`` writing ``[name HH:MM:SS] msg`` to stderr (stdout stays the JSON summary)."""

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def select_methods(parser: argparse.ArgumentParser, given: list[str] | None, known: Sequence[str],
                   also: Sequence[str] = ()) -> list[str]:
    """The ``--methods`` items (comma or space separated) in ``known`` order; all of ``known`` if none given.

    Names in ``also`` are accepted but not returned (e.g. floors that always run); any other name
    ends the run through ``parser.error`` with the list of choices.
    """
    if given is None:
        return list(known)
    names = [n for item in given for n in item.split(",") if n]
    unknown = [n for n in names if n not in known and n not in also]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {tuple(also) + tuple(known)}")
    return [n for n in known if n in names]


def disk_floor_s(path: Path, buf: memoryview, nbytes: int, *, write_behind: bool = False) -> float:
    """Seconds to ``os.write`` ``nbytes`` to ``path`` in :data:`CHUNK` pieces and ``fsync``; ``path`` is removed.

    ``buf`` holds the bytes; when it is shorter than ``nbytes`` it is written again from its start.
    With ``write_behind``, torch-ckpt's write-behind runs alongside (writeback started per 64 MiB
    window, written pages dropped): the best plain sequential write this machine does, an
    informative second floor (a plain write + ``fsync`` of several GiB hits the kernel's dirty-page
    throttling here and can take longer than writing with write-behind).
    """
    from torch_ckpt.format._dcp_write import WriteBehind

    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        behind, off = WriteBehind(fd, path, enabled=write_behind), 0
        while off < nbytes:
            start = off % len(buf)
            off += os.write(fd, buf[start : start + min(CHUNK, nbytes - off, len(buf) - start)])
            behind.advance(off)
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def dcp_default_stager(cuda: bool, shared: bool):
    """DCP's ``DefaultStager`` at its best on this machine: pinned, non-blocking, async staging with CUDA."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=shared, use_async_staging=cuda,
                                        use_non_blocking_copy=cuda))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a one-rank gloo group or a local server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server() -> Iterator[tuple[str, Any]]:
    """A moto S3 server in its own process on 127.0.0.1 (in memory), answering: ``(endpoint URL, boto3 client)``;
    stopped on exit."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                              region_name="us-east-1")
        for _ in range(100):
            try:
                client.list_buckets()
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                time.sleep(0.1)
        yield endpoint, client
    finally:
        server.terminate()
        server.wait(10)


def remove(path: Path) -> None:
    """Delete a file or a directory tree; a missing path is fine."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def close_all(methods: Iterable[Any], log: Callable[[str], None]) -> None:
    """``close()`` every method; a failure is logged with the method's ``name`` and the rest still close."""
    for m in methods:
        try:
            m.close()
        except Exception as exc:  # noqa: BLE001 - cleaning up after a run: report, never hide the result
            log(f"{m.name}: close failed: {exc}")


def spawn_ranks(target: Callable[..., None], world: int, make_args: Callable[[int, int, Any], tuple]) -> Any:
    """Run ``target(*make_args(rank, port, results))`` in ``world`` spawned processes (``port``: a free
    127.0.0.1 port for their gloo group) and return the one object a rank put on ``results``.

    Raises:
        SystemExit: a rank exited non-zero or nothing was put (its exit codes named).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=target, args=make_args(rank, port, results)) for rank in range(world)]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs) or results.empty():
            raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
        return results.get()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()


def emit_json(result: dict[str, Any], path: Path | None) -> None:
    """Print ``result`` as indented JSON on stdout and, with ``path``, write it there too."""
    text = json.dumps(result, indent=2)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)


def start_run(prefix: str, threads: int, parent: Path | None) -> Path:
    """Quiet warnings and INFO logs, set torch's intra-op ``threads``; return a new temporary directory.

    The directory (named ``prefix...``) is made under ``parent`` or ``$TMPDIR``; the caller removes it.
    """
    import torch

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=str(parent) if parent else None))
