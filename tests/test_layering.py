"""The house rules on who may import whom, checked on the source (every import, also those inside
functions), plus the absence of import cycles between our modules (module-level imports).

    kernels/   imports nothing of ours
    feedback/  imports only kernels
    serving/   feedback, kernels            (never trainer: they meet only in feedback/)
    trainer/   feedback, kernels            (never serving)
    infra/     the composition root: anything but benchmarks
    benchmarks/ anything; nothing imports it
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "feedback", "serving", "trainer", "infra", "benchmarks")
ALLOWED = {
    "kernels": set(),
    "feedback": {"kernels"},
    "serving": {"feedback", "kernels"},
    "trainer": {"feedback", "kernels"},
    "infra": {"feedback", "kernels", "serving", "trainer"},
    "benchmarks": set(PACKAGES),
}
EXCEPTIONS: set[tuple[str, str]] = set()
"""(file, package) pairs allowed despite the rules; none today (`specloop bench`'s commands come
in through entry points, infra/cli_commands.py)."""


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: Path, top_level_only: bool) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


MODULES = _modules()


@pytest.mark.parametrize("pkg", PACKAGES)
def test_package_imports_only_what_the_layering_allows(pkg):
    bad = []
    for mod, path in MODULES.items():
        if mod.split(".")[0] != pkg:
            continue
        rel = str(path.relative_to(ROOT))
        for name in _imports(path, top_level_only=False):
            other = name.split(".")[0]
            allowed = other not in PACKAGES or other == pkg or other in ALLOWED[pkg]
            if not allowed and (rel, other) not in EXCEPTIONS:
                bad.append(f"{rel} imports {name}")
    assert not bad, "layering violations:\n" + "\n".join(sorted(set(bad)))


def test_no_import_cycles_between_our_modules():
    graph = {}
    for mod, path in MODULES.items():
        deps = set()
        for name in _imports(path, top_level_only=True):
            while name and name not in MODULES:  # `from a.b import c` names a.b.c or a.b
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        graph[mod] = deps
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_a_violation(tmp_path):
    """The rule above can fail: a trainer module importing serving is reported."""
    p = tmp_path / "x.py"
    p.write_text("def f():\n    from serving.engine import torch_engine\n")
    assert "serving.engine" in _imports(p, top_level_only=False)
