"""Check ``contract.SYMBOLS`` against SGLang *source* (parsed with ``ast``, never imported).

Works on an unpacked wheel (CI) and on the installed package (runtime self-check): both are a
directory that contains ``sglang/``. Importing sglang would need CUDA; reading it does not.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path

from serving.sglang.contract import SGLANG_VERSION, SYMBOLS, SGLangContractError, Symbol

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def module_file(root: Path, module: str) -> Path | None:
    """``root/a/b/c.py`` or ``root/a/b/c/__init__.py`` for module ``a.b.c``."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=64)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _find_in_body(body: list[ast.stmt], name: str) -> ast.AST | None:
    for node in body:
        if isinstance(node, _DEFS) and node.name == name:
            return node
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == name):
            return node
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
    return None


def _find_self_attribute(cls: ast.ClassDef, name: str) -> ast.AST | None:
    """``self.<name> = ...`` inside the class's ``__init__``."""
    init = _find_in_body(cls.body, "__init__")
    if not isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for node in ast.walk(init):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            if (isinstance(t, ast.Attribute) and t.attr == name
                    and isinstance(t.value, ast.Name) and t.value.id == "self"):
                return node
    return None


def _resolve(tree: ast.Module, dotted: str) -> ast.AST | None:
    node: ast.AST | None = None
    body = tree.body
    for i, part in enumerate(dotted.split(".")):
        found = _find_in_body(body, part)
        if found is None and isinstance(node, ast.ClassDef) and i == len(dotted.split(".")) - 1:
            found = _find_self_attribute(node, part)
        if found is None:
            return None
        node = found
        body = node.body if isinstance(node, ast.ClassDef) else []
    return node


def _param_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], set[str]]:
    """(leading positional names without self/cls, all accepted names)."""
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    return positional, set(positional) | {p.arg for p in a.kwonlyargs}


def _mentions(node: ast.AST) -> set[str]:
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            names.add(sub.value)
        elif isinstance(sub, ast.alias):
            names.add(sub.asname or sub.name.rsplit(".", 1)[-1])
    return names


def _last_return_names(fn: ast.AST) -> tuple[str, ...] | None:
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if not returns:
        return None
    last = max(returns, key=lambda r: r.lineno).value
    if not isinstance(last, ast.Tuple):
        return None
    return tuple(e.id if isinstance(e, ast.Name) else ast.unparse(e) for e in last.elts)


def check_symbol(root: Path, sym: Symbol) -> str | None:
    """None if ``sym`` holds in the source under ``root``, else what is wrong."""
    path = module_file(root, sym.module)
    if path is None:
        return f"{sym.qualified}: module {sym.module} not found"
    node = _resolve(_parse(path), sym.name)
    if node is None:
        return f"{sym.qualified}: not defined in {path.relative_to(root)}"
    if sym.params:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{sym.qualified}: expected a function with parameters {sym.params}"
        leading, accepted = _param_names(node)
        missing = [p for p in sym.params if p not in accepted]
        if missing:
            return f"{sym.qualified}: missing parameter(s) {missing} (has {sorted(accepted)})"
        if sym.positional and tuple(leading[: len(sym.params)]) != sym.params:
            return (f"{sym.qualified}: leading parameters are {leading[: len(sym.params)]}, "
                    f"expected {list(sym.params)}")
    if sym.mentions:
        missing = [m for m in sym.mentions if m not in _mentions(node)]
        if missing:
            return f"{sym.qualified}: no longer mentions {missing}"
    if sym.returns:
        got = _last_return_names(node)
        if got != sym.returns:
            return f"{sym.qualified}: last return is {got}, expected {sym.returns}"
    return None


def check_source(root: Path, symbols: tuple[Symbol, ...] = SYMBOLS) -> list[str]:
    """Every broken symbol under ``root`` (a directory containing ``sglang/``)."""
    return [p for p in (check_symbol(Path(root), s) for s in symbols) if p is not None]


def installed_sglang_root() -> Path:
    """Directory holding the installed ``sglang`` package, located without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SGLangContractError(
            "sglang is not installed: install the production extra on a CUDA machine, "
            "`pip install 'specloop[sglang]'`")
    return Path(next(iter(spec.submodule_search_locations))).parent


def require_sglang(symbols: tuple[Symbol, ...] = SYMBOLS, root: Path | None = None) -> None:
    """Raise SGLangContractError naming every missing or changed symbol."""
    root = installed_sglang_root() if root is None else root
    problems = check_source(root, symbols)
    if problems:
        raise SGLangContractError(
            "the installed SGLang does not provide what specloop relies on "
            f"(pinned: sglang=={SGLANG_VERSION}):\n  " + "\n  ".join(problems))
