"""The layout's rules, read from the source: layers of packages, no import cycles, no mixins, a small surface."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torch_ckpt

PKG = Path(torch_ckpt.__file__).parent

#: low to high: a module may import torch_ckpt modules of its own layer or a lower one (function-local imports too)
LAYERS = [
    {"errors", "_logging", "durations", "_values", "handle", "_lifecycle"},
    {"policy"},
    {"config"},
    {"distributed"},
    {"storage"},
    {"format"},
    {"root"},
    {"tiers"},
    {"restore"},
    {"state"},
    {"save"},
    {"manager"},
    {"tools"},
    {"__init__", "__main__"},
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1] if len(parts) > 2 else parts
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    """Every torch_ckpt module ``path`` imports, at any depth of the file (function-local imports included)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torch_ckpt"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("torch_ckpt"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
    modules = _modules()
    return {m for m in found if m in modules and m != name}


def _unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _graph() -> dict[str, set[str]]:
    return {name: _imports(path, name) for name, path in _modules().items()}


def test_every_unit_has_a_layer():
    """Every top-level module and subpackage of torch_ckpt is placed in LAYERS."""
    units = {_unit(m) for m in _modules()}
    assert units - set(LAYER_OF) == set()


def test_imports_go_down_the_layers():
    """No module imports a module of a higher layer, nor one of another package in its own layer."""
    bad = []
    for name, deps in _graph().items():
        for dep in deps:
            a, b = _unit(name), _unit(dep)
            if dep == "torch_ckpt" or a == b or a in ("__init__", "__main__"):
                continue
            if LAYER_OF[b] > LAYER_OF[a] or (LAYER_OF[b] == LAYER_OF[a] and LAYER_OF[a] != 0):
                bad.append(f"{name} -> {dep}")
    assert bad == []


def test_no_import_cycles():
    """The module import graph, function-local imports included, has no cycle."""
    graph = _graph()
    seen: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for dep in graph.get(node, ()):
            if dep.count(".") == 1 and dep.split(".")[1] in LAYER_OF and (PKG / dep.split(".")[1]).is_dir():
                continue  # a package's __init__: its own surface, checked through its modules
            if seen.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]) if dep in stack else f"{node} -> {dep}")
            elif dep not in seen:
                visit(dep, stack + [dep])
        seen[node] = 2

    for name in graph:
        if name not in seen:
            visit(name, [name])
    assert cycles == []


def test_no_mixin_classes():
    """No class of torch_ckpt is a mixin: the manager and the engine are composed of objects."""
    mixins = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and "Mixin" in node.name:
                mixins.append(f"{name}.{node.name}")
    assert mixins == []


def test_few_top_level_modules():
    """At most 12 modules at the top of torch_ckpt, at least 6 subpackages."""
    assert len(list(PKG.glob("*.py"))) <= 12
    assert len([p for p in PKG.iterdir() if (p / "__init__.py").is_file()]) >= 6


@pytest.mark.parametrize("name", torch_ckpt.__all__)
def test_public_names_are_documented(name):
    """Each name of torch_ckpt.__all__ resolves and has a docstring."""
    assert (getattr(torch_ckpt, name).__doc__ or "").strip()


def test_small_public_surface():
    """torch_ckpt exports at most 30 names."""
    assert len(torch_ckpt.__all__) <= 30
