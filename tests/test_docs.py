"""The documentation: the site builds with no warnings, and the code of README.md and the guides runs.

Code blocks are the fenced blocks of each page. A comment on the line before a block marks it:
``<!-- file: NAME -->`` writes the block to ``NAME`` in the page's working directory (a script or a
YAML file the next blocks use), ``<!-- no-run: REASON -->`` leaves it out (it needs several processes, a
server of your own, a GPU, or it is a fragment). Every other ``python`` block of a page runs, in order,
in one namespace, in a fresh directory, on CPU, in a subprocess that imports this checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

# the README and the guides, each with the modules its runnable blocks import beyond the core's dependencies
# (the page is skipped without them); pages without a runnable block are only checked for their markers
RUN_PAGES = {
    "README.md": (),
    "docs/quickstart.md": (),
    "docs/exact-resume.md": (),
    "docs/distributed.md": (),
    "docs/durable-tier.md": ("boto3", "s3fs", "moto.server"),
    "docs/clusters.md": (),
    "docs/memory-tier.md": (),
    "docs/incremental.md": (),
    "docs/scheduling.md": (),
    "docs/lightning.md": ("lightning",),
    "docs/accelerate.md": ("accelerate",),
    "docs/cli.md": (),
    "docs/interop.md": (),
    "docs/configuration.md": (),
    "docs/errors.md": (),
}
_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*(no-run|file):\s*(.*?)\s*-->\s*$")
_HISTORY = re.compile(r"\bsession \d|\bissue[ -]?\d|as on our build machines|the new naming|no GPU was available",
                      re.I)
_PRIVATE_PATH = re.compile(r"\btorch_ckpt(?:\.\w+)*\._(?!_)\w+")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    marker: str | None  # "no-run", "file" or None
    arg: str  # the marker's reason or file name


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, each with the marker comment right before it, if any."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        out.append(Block(lang=m.group(1), code=m.group(2), line=text.count("\n", 0, m.start()) + 1,
                         marker=marker.group(1) if marker else None, arg=marker.group(2) if marker else ""))
    return out


_RUNNER = r"""
import json, sys
page, blocks = sys.argv[1], json.load(open(sys.argv[2], encoding="utf-8"))
namespace = {"__name__": "__main__"}
for line, code in blocks:
    print(f"--- {page}:{line}", flush=True)
    exec(compile(code, f"{page}:{line}", "exec"), namespace)
"""


# pages whose blocks take over 30 s (2 ranks under torchrun): left to `make test`, out of `make test-fast`
SLOW_PAGES = {"docs/distributed.md"}


def _has_runnable(page: str) -> bool:
    return any(b.lang == "python" and b.marker is None for b in blocks_of(REPO / page))


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PAGES else p
                                  for p in sorted(RUN_PAGES) if _has_runnable(p)])
def test_code_blocks_run(page, tmp_path):
    """Every unmarked python block of the page runs (in order, one namespace) and exits cleanly."""
    for module in RUN_PAGES[page]:
        pytest.importorskip(module, reason=f"{page} needs {module}")
    runnable = []
    for block in blocks_of(REPO / page):
        if block.marker == "file":
            (tmp_path / block.arg).write_text(block.code, encoding="utf-8")
        elif block.marker is None and block.lang == "python":
            runnable.append((block.line, block.code))
    (tmp_path / "_blocks.json").write_text(json.dumps(runnable), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, page, str(tmp_path / "_blocks.json")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{page}: a code block failed\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def test_markers_name_a_reason_and_guides_mostly_run():
    """Every no-run marker says why; the quick start and most guide blocks run."""
    runnable = skipped = 0
    for page in RUN_PAGES:
        for block in blocks_of(REPO / page):
            if block.marker == "no-run":
                assert block.arg, f"{page}:{block.line}: no-run marker without a reason"
                skipped += block.lang == "python"
            elif block.marker == "file":
                assert re.fullmatch(r"[\w.-]+", block.arg), f"{page}:{block.line}: file marker {block.arg!r}"
            elif block.lang == "python":
                runnable += 1
    quick = [b for b in blocks_of(DOCS / "quickstart.md") if b.lang == "python" and b.marker is None]
    assert len(quick) >= 2 and runnable > skipped, (runnable, skipped)


def test_readme_is_an_entry_point():
    """README.md: at most 200 lines, no project history, links only to pages that exist."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert not _HISTORY.search(text), _HISTORY.search(text).group(0)
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (REPO / target).is_file(), target


def test_pages_use_public_names_and_no_history():
    """The docs name no private module path (``torch_ckpt.x._y``) and tell no project history."""
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        assert not _PRIVATE_PATH.search(text), (path.name, _PRIVATE_PATH.search(text).group(0))
        assert not _HISTORY.search(text), (path.name, _HISTORY.search(text).group(0))


def test_every_page_is_in_the_navigation():
    """mkdocs.yml's nav lists every page of docs/ (strict builds also warn about omitted pages)."""
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    for path in DOCS.glob("*.md"):
        assert f": {path.name}\n" in nav, path.name


def test_site_builds_strictly(tmp_path):
    """``mkdocs build --strict`` (what ``make docs`` runs) succeeds with no warning, and the API page is generated."""
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None
               or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing): pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-6000:]
    api = (site / "api.html").read_text(encoding="utf-8")
    for name in ("CheckpointManager", "TrainState", "CheckpointConfig"):
        assert f'id="torch_ckpt.{name}"' in api, name
