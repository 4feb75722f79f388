"""JUnit XML of the plain and injected runs -> per-file results, each plugin-only failure tagged.

A failure is tagged by the first rule that matches (``tag`` below):

* ``KNOWN``: the test id is in :data:`peer_suites.known_differences.KNOWN_DIFFERENCES` (a documented,
  deliberate difference; the reason is shown).
* ``LOST``: a save returned (the script exited 0) but its checkpoint is not there.
* ``HANG``: pytest-timeout stopped the test.
* ``ZOMBIE``: Lightning's thread police found a thread left alive.
* ``LOCK_CONFLICT``: torch-ckpt refused a root as "in use by another run".
* ``FORMAT``: the test itself reads or mocks the checkpoint file: the test's own frame nearest to the error
  reads a path (``torch.load``, ``pl_load``, ``open``, fsspec, ``zipfile``, ``getsize``) and the error is what
  reading a directory as a file gives (``IsADirectoryError``, ``UnpicklingError``, a bad zip, ...); or the test
  patches ``torch.save`` / Lightning's file writer / ``TorchCheckpointIO`` and asserts on the calls; or the test's
  own failing line asserts the path is a file (``isfile``/``is_file``) and the plugin saw a directory there when
  it failed (nothing there is a break: the checkpoint is missing). A read inside Lightning or a logger is
  not FORMAT: Lightning's own code must handle our checkpoints.
* ``OUR_FILES``: an assertion shows our ``.lock``/``.lock.owner`` or an in-flight ``.NAME.tmp.<id>`` entry, or
  one of them is an argument of a frame outside our packages (picked as "the first file of the folder").
* ``BREAK``: anything else, grouped by error type and message (paths, numbers and addresses replaced).

Everything but ``FORMAT`` and ``KNOWN`` counts as a drop-in break.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from peer_suites.known_differences import KNOWN_DIFFERENCES

NOT_BREAKS = ("FORMAT", "KNOWN")

_LOCATION = re.compile(r"^(?P<path>[^\s:>E][^:\n]*):(?P<line>\d+): ?(?P<rest>.*)$")
_FORMAT_ERROR = re.compile(r"IsADirectoryError|UnpicklingError|BadZipFile|PytorchStreamReader|is not a zip file|"
                           r"Is a directory|invalid load key|NotADirectoryError|Not a directory")
_READ_CALL = re.compile(r"torch\.load\(|\bpl_load\(|\b_load\(|\bload\(|fsspec|\bopen\(|getsize\(|zipfile|"
                        r"read_bytes\(|read_text\(|\.stat\(\)|safe_open\(")
_MOCKED_SAVE = re.compile(r"(patch|[Mm]ock)[^\n]*(torch\.save|[\"']save[\"']|_atomic_save|TorchCheckpointIO|"
                          r"cloud_io)")
_CALL_ASSERT = re.compile(r"call|[Cc]alled|Expected")
_IS_FILE = re.compile(r"isfile\(|is_file\(")
_OUR_FILES = re.compile(r"'\.lock(\.owner)?'|\.lock\.owner|'\.[^'/]+\.tmp\.[0-9a-f]+'")
_OUR_PATH_ARG = re.compile(r"^\w+ = .*(/\.lock(\.owner)?'|/\.[^/']+\.tmp\.[0-9a-f]+')")


@dataclass
class Case:
    """One test case of one run."""

    nodeid: str
    outcome: str  # passed | failed | error | skipped
    message: str = ""
    text: str = ""


@dataclass
class Tag:
    """Why a test fails only with the plugin."""

    kind: str  # KNOWN | LOST | HANG | ZOMBIE | LOCK_CONFLICT | FORMAT | OUR_FILES | BREAK
    detail: str

    @property
    def is_break(self) -> bool:
        return self.kind not in NOT_BREAKS

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class FileResult:
    """A file's two runs: counts, the tests failing only with the plugin (tagged), the records' counts."""

    file: str
    plain: dict[str, int] = field(default_factory=dict)
    injected: dict[str, int] = field(default_factory=dict)
    plugin_only: dict[str, str] = field(default_factory=dict)  # nodeid -> str(tag)
    plain_only: list[str] = field(default_factory=list)  # fail plain, pass injected
    notes: list[str] = field(default_factory=list)
    zombies: int = 0  # injected tests leaving torch-ckpt threads alive
    lost: int = 0  # injected tests with a lost checkpoint the plain run did not lose
    lock_conflicts: int = 0
    hangs: int = 0
    own_io: int = 0  # injected-run tests where a Trainer kept the test's own CheckpointIO
    not_injected: int = 0  # injected-run tests (not skipped) that built nothing to inject into


def parse_junit(path: str | Path) -> dict[str, Case]:
    """Test cases of a JUnit XML file (``junit_family=xunit1``, which names each case's file), by node id."""
    cases: dict[str, Case] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        file, classname, name = tc.get("file", ""), tc.get("classname", ""), tc.get("name", "")
        if not file and not classname and name:  # a collection error: the case is the module
            file, name = name.replace(".", "/") + ".py", ""
        module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
        cls = classname[len(module) + 1:] if module and classname.startswith(module + ".") else ""
        nodeid = "::".join(p for p in (file or classname, *cls.split("."), name) if p)
        outcome, message, text = "passed", "", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" or outcome == "failed" else "error"
                message = message or child.get("message", "")
                text += (child.text or "") + "\n"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        cases[nodeid] = Case(nodeid, outcome, message, text)
    return cases


def counts(cases: dict[str, Case]) -> dict[str, int]:
    """passed / failed (failures and errors) / skipped counts."""
    c = Counter("failed" if case.outcome == "error" else case.outcome for case in cases.values())
    return {k: c.get(k, 0) for k in ("passed", "failed", "skipped")}


def _entries(text: str) -> list[tuple[str, str, list[str]]]:
    """Traceback entries of pytest's long format: (path, what follows ``path:line:``, source lines)."""
    entries, chunk = [], []
    for line in text.splitlines():
        m = _LOCATION.match(line)
        if m:
            entries.append((m["path"], m["rest"], chunk))
            chunk = []
        else:
            chunk.append(line)
    return entries


def _is_test_frame(path: str) -> bool:
    """A frame of the suite's own files: relative to the rootdir, or absolute after a test changed directory."""
    if path.startswith("<"):
        return False
    return (not path.startswith("/") or "/tests_pytorch/" in path
            or re.search(r"/tests/test_[^/]+\.py$", path) is not None)


def known_reason(nodeid: str) -> str | None:
    """The documented reason of a deliberate difference for ``nodeid`` (exact id, or the id without params)."""
    return KNOWN_DIFFERENCES.get(nodeid) or KNOWN_DIFFERENCES.get(nodeid.split("[", 1)[0])


def normalise(message: str) -> str:
    """First line of ``message`` with paths, addresses and numbers replaced, at most 140 characters."""
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    line = re.sub(r"(/[\w.\-=@+]+)+/?", "<path>", line)
    line = re.sub(r"0x[0-9a-f]+", "<addr>", line)
    line = re.sub(r"\b[0-9a-f]{8,}\b", "<hex>", line)
    line = re.sub(r"\d+(\.\d+)?", "N", line)
    return line[:140]


def tag(case: Case, record: dict[str, Any] | None = None) -> Tag:
    """Why ``case`` failed (see the module docstring for the rules); ``record`` is the plugin's line for it."""
    reason = known_reason(case.nodeid)
    if reason:
        return Tag("KNOWN", reason)
    text = f"{case.message}\n{case.text}"
    if case.message.startswith("LostCheckpoint"):
        return Tag("LOST", normalise(case.message.split(":", 1)[1]))
    if "Timeout (>" in text and "pytest-timeout" in text:
        return Tag("HANG", normalise(case.message))
    if "left zombie thread" in text:
        m = re.search(r"zombie thread: <\w+\(([^,)]+)", text)
        return Tag("ZOMBIE", m[1] if m else normalise(case.message))
    if "is in use by another run" in text:
        return Tag("LOCK_CONFLICT", normalise(case.message))
    entries = _entries(case.text)
    tests = [e for e in entries if _is_test_frame(e[0])]
    if tests:
        failing = " ".join(line for line in tests[-1][2] if line.startswith(">"))
        source = "\n".join(line for e in tests for line in e[2])
        if _FORMAT_ERROR.search(text) and _READ_CALL.search(failing):
            return Tag("FORMAT", "the test reads the checkpoint file itself")
        if _MOCKED_SAVE.search(source) and case.message.startswith("AssertionError") and _CALL_ASSERT.search(
                case.message):
            return Tag("FORMAT", "the test mocks the file writer and counts its calls")
        if case.message.startswith("AssertionError") and _IS_FILE.search(failing) and tests[-1] is entries[-1]:
            if record and record.get("dirs_at_failure"):
                return Tag("FORMAT", "the test asserts the checkpoint path is a file")
            return Tag("BREAK", "the test asserts a checkpoint file exists: nothing at that path when it failed")
    if _OUR_FILES.search(case.message) or _OUR_FILES.search(" ".join(line for line in case.text.splitlines()
                                                                       if line.startswith("E "))):
        return Tag("OUR_FILES", ".lock / .lock.owner / in-flight .tmp entry seen by the test")
    if any("_ckpt/" not in path and any(_OUR_PATH_ARG.match(line) for line in chunk) for path, _, chunk in entries):
        return Tag("OUR_FILES", ".lock / in-flight .tmp entry handed to the test's or Lightning's code as a checkpoint")
    return Tag("BREAK", normalise(case.message))


def compare(file: str, plain: dict[str, Case] | None, injected: dict[str, Case] | None,
            records: dict[str, dict[str, Any]] | None = None,
            plain_records: dict[str, dict[str, Any]] | None = None) -> FileResult:
    """One file's result from its two runs (None: the run produced no XML) and the plugin's records."""
    res = FileResult(file, counts(plain or {}), counts(injected or {}))
    plain, injected = plain or {}, injected or {}
    records, plain_records = records or {}, plain_records or {}
    for nodeid, case in injected.items():
        before = plain.get(nodeid)
        ok_plain = before is not None and before.outcome in ("passed", "skipped")
        if case.outcome in ("failed", "error") and ok_plain:
            res.plugin_only[nodeid] = str(tag(case, records.get(nodeid)))
        elif case.outcome == "passed" and before is not None and before.outcome in ("failed", "error"):
            res.plain_only.append(nodeid)
    for t in res.plugin_only.values():
        res.hangs += t.startswith("HANG")
    for nodeid, rec in records.items():
        if rec.get("event") != "done":
            res.hangs += nodeid not in injected  # started, never finished: the process was killed in it
            continue
        res.zombies += bool(rec["zombies"])
        res.lock_conflicts += bool(rec["lock_conflict"])
        res.lost += bool(rec["lost"]) and not plain_records.get(nodeid, {}).get("lost")
        res.own_io += bool(rec["own_io"])
        res.not_injected += not rec["injected"] and not rec["own_io"] and rec["outcome"] != "skipped"
    return res


def read_records(path: str | Path) -> dict[str, dict[str, Any]]:
    """The plugin's JSON lines by node id: the ``done`` record, or the ``start`` one of a test that never ended."""
    out: dict[str, dict[str, Any]] = {}
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec["event"] == "done" or rec["nodeid"] not in out:
                out[rec["nodeid"]] = rec
    return out


def totals(results: list[FileResult]) -> dict[str, Any]:
    """Sums over files and the count of each tag kind and break reason."""
    kinds: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for r in results:
        for t in r.plugin_only.values():
            kinds[t.split(":", 1)[0]] += 1
            if t.split(":", 1)[0] not in NOT_BREAKS:
                reasons[t] += 1
    out: dict[str, Any] = {}
    for run in ("plain", "injected"):
        out[run] = {k: sum(r.__dict__[run].get(k, 0) for r in results) for k in ("passed", "failed", "skipped")}
    for k in ("zombies", "lost", "lock_conflicts", "hangs", "own_io", "not_injected"):
        out[k] = sum(getattr(r, k) for r in results)
    out["plugin_only"] = sum(len(r.plugin_only) for r in results)
    out["breaks"] = sum(n for k, n in kinds.items() if k not in NOT_BREAKS)
    out["kinds"] = dict(kinds.most_common())
    out["break_reasons"] = dict(reasons.most_common())
    return out


def _cell(c: dict[str, int]) -> str:
    return f"{c.get('passed', 0)} / {c.get('failed', 0)} / {c.get('skipped', 0)}" if c else "-"


def markdown(results: list[FileResult], extra: dict[str, Any]) -> str:
    """The report: a table per file, the totals, then every plugin-only failure with its tag."""
    t = totals(results)
    lines = ["# Peer test suites: plain vs. with the plugin injected", ""]
    lines += [f"- {k}: {v}" for k, v in extra.items()]
    lines += ["", "Counts are passed / failed (failures and errors) / skipped.", "",
              "| file | plain | injected | plugin-only failures | breaks | zombies | lost | lock | hangs | notes |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        breaks = sum(1 for v in r.plugin_only.values() if v.split(":", 1)[0] not in NOT_BREAKS)
        notes = "; ".join(r.notes + ([f"{r.own_io} kept their own CheckpointIO"] if r.own_io else []) +
                          ([f"fail plain only: {len(r.plain_only)}"] if r.plain_only else []))
        lines.append(f"| {r.file} | {_cell(r.plain)} | {_cell(r.injected)} | {len(r.plugin_only)} | {breaks} | "
                     f"{r.zombies} | {r.lost} | {r.lock_conflicts} | {r.hangs} | {notes} |")
    lines.append(f"| **total** | {_cell(t['plain'])} | {_cell(t['injected'])} | {t['plugin_only']} | {t['breaks']} |"
                 f" {t['zombies']} | {t['lost']} | {t['lock_conflicts']} | {t['hangs']} | |")
    lines += ["", "## Tags", "", "| tag | tests |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in t["kinds"].items()]
    lines += ["", "## Breaks by reason", "", "| reason | tests |", "|---|---|"]
    lines += [f"| {k.replace('|', '/')} | {n} |" for k, n in t["break_reasons"].items()]
    lines += ["", "## Tests failing only with the plugin", ""]
    for r in results:
        for nodeid, tg in sorted(r.plugin_only.items()):
            lines.append(f"- `{nodeid}`: {tg}")
    return "\n".join(lines) + "\n"


def to_json(results: list[FileResult], extra: dict[str, Any]) -> str:
    return json.dumps({"run": extra, "totals": totals(results), "files": [asdict(r) for r in results]}, indent=1)
