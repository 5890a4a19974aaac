"""The package's import graph (every import statement, inside functions too) has no cycles, and the
layers stay apart: the runtime imports nothing from planning, the API or Megatron; planning imports
only the runtime besides itself; nothing outside ``megatron/`` imports the Megatron integration."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import megatron_mesh_cp

PKG = Path(megatron_mesh_cp.__file__).parent
ROOT = "megatron_mesh_cp"


def _modules() -> Dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> Dict[str, Set[str]]:
    """module -> package modules it imports (``from pkg import name`` counts as the submodule when
    ``name`` is one, else as ``pkg`` itself)."""
    mods = _modules()
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base[: len(base) - (node.level - 1)]
                    src = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a name inside a module -> that module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle as a list of modules (first repeated at the end), or [] if none."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(m: str) -> List[str]:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_graph_sees_relative_and_function_level_imports():
    g = import_graph()
    assert f"{ROOT}.runtime.plan" in g[f"{ROOT}.runtime.execute"]
    assert f"{ROOT}.megatron.attention" in g[f"{ROOT}.megatron.arguments"]  # imported inside a function
    assert f"{ROOT}.runtime.kernels" in g[f"{ROOT}.runtime.execute"]  # a subpackage
    assert len(g) >= 40


def test_package_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def _layer(mod: str) -> str:
    """runtime / planning / megatron for modules of those subpackages, else api (the package's top level)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("runtime", "planning", "megatron") else "api"


ALLOWED = {"runtime": {"runtime"}, "planning": {"runtime", "planning"},
           "api": {"runtime", "planning", "api"}, "megatron": {"runtime", "planning", "api", "megatron"}}


def layer_violations(graph: Dict[str, Set[str]]) -> List[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if _layer(t) not in ALLOWED[_layer(m)])


def test_layer_check_flags_an_upward_import():
    assert layer_violations({f"{ROOT}.runtime.execute": {f"{ROOT}.planning.schedule", f"{ROOT}.runtime.plan"},
                             f"{ROOT}.planning.cluster": {ROOT}}) == [
        f"{ROOT}.planning.cluster -> {ROOT}", f"{ROOT}.runtime.execute -> {ROOT}.planning.schedule"]


def test_layers_import_only_downwards():
    bad = layer_violations(import_graph())
    assert not bad, "layer violations:\n" + "\n".join(bad)


#: the namespaces the Megatron integration and the scripts import the runtime and planning through
PUBLIC = {f"{ROOT}.runtime", f"{ROOT}.runtime.kernels", f"{ROOT}.runtime.masks", f"{ROOT}.planning"}


def internal_imports(paths) -> List[str]:
    """Imports of runtime / planning names from anything but their public namespaces (``PUBLIC``), or of
    names those namespaces do not export (their ``__all__``)."""
    import importlib

    exported = {m: set(importlib.import_module(m).__all__) for m in PUBLIC}
    bad = []
    for path in paths:
        rel = path.relative_to(PKG.parent)
        base = list(rel.with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            if not src.startswith((f"{ROOT}.runtime", f"{ROOT}.planning")):
                continue
            names = [a.name for a in node.names]
            if src not in PUBLIC:
                bad.append(f"{rel}:{node.lineno}: from {src} import {', '.join(names)}")
            else:
                missing = [n for n in names if n not in exported[src]]
                if missing:
                    bad.append(f"{rel}:{node.lineno}: {src} does not export {', '.join(missing)}")
    return bad


def test_public_import_check_flags_an_internal_import(tmp_path):
    pkg = PKG / "megatron"
    probe = pkg / "_probe_internal_import.py"
    probe.write_text("from ..runtime.execute import Executor\nfrom ..planning import not_exported\n")
    try:
        found = internal_imports([probe])
    finally:
        probe.unlink()
    assert len(found) == 2 and "runtime.execute" in found[0] and "not_exported" in found[1], found


#: diagnostics that count or patch the runtime's internals (graph keys, per-shape caches): they read
#: what no public name exposes, by design
INSTRUMENTS = {"bench_graph_keys.py", "gpu_check_documents.py"}


def test_megatron_and_scripts_use_the_public_namespaces():
    """megatron/ and scripts/ reach the runtime and planning layers through what they export."""
    scripts = [p for p in sorted((PKG.parent / "scripts").rglob("*.py")) if p.name not in INSTRUMENTS]
    paths = sorted((PKG / "megatron").glob("*.py")) + scripts
    bad = internal_imports(paths)
    assert not bad, "imports past the public namespaces:\n" + "\n".join(bad)
