"""Contract tests: the pinned sglang wheel's *source* provides every symbol in contract.SYMBOLS.

The wheel is fetched without dependencies (it would pull a CUDA stack) and cached under
~/.cache/specloop/wheels; its Python files are unpacked next to it and parsed, never imported.
Skipped only when the package registry cannot be reached.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from serving.sglang import contract
from serving.sglang.contract import SGLANG_VERSION, SYMBOLS, SGLangContractError, Symbol
from serving.sglang.source_check import check_source, module_file, require_sglang

ROOT = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("SPECLOOP_WHEEL_CACHE", Path.home() / ".cache/specloop/wheels"))
# One fixed wheel whatever the interpreter running the tests: the source is what we read.
WHEEL_TAGS = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
              "--platform", "manylinux_2_34_x86_64"]
UNREACHABLE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
               "ConnectTimeout", "ReadTimeout", "ProxyError", "Max retries exceeded",
               "Could not fetch URL", "No route to host", "Connection refused")


def fetch_wheel() -> Path:
    found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           *WHEEL_TAGS, "--retries", "2", "--timeout", "30", "-d", str(CACHE),
           f"sglang=={SGLANG_VERSION}"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if proc.returncode == 0 and found:
        return found[0]
    output = proc.stdout + proc.stderr
    marker = next((m for m in UNREACHABLE if m in output), None)
    if marker:
        pytest.skip(f"package registry unreachable ({marker}), cannot fetch "
                    f"sglang=={SGLANG_VERSION}")
    raise AssertionError(f"pip download sglang=={SGLANG_VERSION} failed:\n{output}")


@pytest.fixture(scope="session")
def sglang_source() -> Path:
    """Directory holding the wheel's ``sglang/`` Python sources (unpacked once, then reused)."""
    wheel = fetch_wheel()
    root = CACHE / f"{wheel.stem}-src"
    done = root / ".unpacked"
    if not done.exists():
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("sglang/") and name.endswith(".py"):
                    zf.extract(name, root)
        done.touch()
    return root


def test_pinned_wheel_provides_every_contract_symbol(sglang_source):
    assert check_source(sglang_source) == []


def test_runtime_check_accepts_the_pinned_wheel(sglang_source):
    require_sglang(root=sglang_source)


def mutated_root(tmp_path: Path, sglang_source: Path, module: str, old: str, new: str) -> Path:
    """A copy of one module of the wheel with one edit, as a later SGLang might ship it."""
    src = module_file(sglang_source, module)
    text = src.read_text()
    assert old in text, f"{old!r} not in {module}: update the test"
    dst = tmp_path / src.relative_to(sglang_source)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text.replace(old, new))
    return tmp_path


@pytest.mark.parametrize("module, old, new, symbol", [
    ("sglang.srt.speculative.eagle_utils", "    return predict, accept_lens, accept_index\n",
     "    return predict, num_correct_drafts, accept_index\n", "eagle_utils.eagle_sample"),
    ("sglang.srt.speculative.eagle_utils", "def eagle_sample(\n    verify_input",
     "def eagle_sample(\n    spec_input", "eagle_utils.eagle_sample"),
    ("sglang.srt.speculative.eagle_info", "    retrieve_next_token: torch.Tensor\n", "",
     "EagleVerifyInput.retrieve_next_token"),
    ("sglang.srt.managers.io_struct", 'selector: Literal["target", "draft", "all"] = "all"',
     "pass", "BeginWeightUpdateReqInput.selector"),
    ("sglang.srt.plugins", 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"',
     'GENERAL_PLUGINS_GROUP = "sglang.plugins"', "GENERAL_PLUGINS_GROUP"),
])
def test_a_moved_hook_point_is_named(tmp_path, sglang_source, module, old, new, symbol):
    root = mutated_root(tmp_path, sglang_source, module, old, new)
    symbols = tuple(s for s in SYMBOLS if s.module == module)
    problems = check_source(root, symbols)
    assert len(problems) >= 1 and any(symbol in p for p in problems), problems
    with pytest.raises(SGLangContractError, match=symbol.split(".")[-1]):
        require_sglang(symbols, root=root)


def test_a_missing_module_is_named(tmp_path):
    problems = check_source(tmp_path, (Symbol("sglang.srt.gone", "f"),))
    assert problems == ["sglang.srt.gone.f: module sglang.srt.gone not found"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_runtime_check_without_sglang_says_how_to_install():
    with pytest.raises(SGLangContractError, match=r"specloop\[sglang\]"):
        require_sglang()


def test_pin_matches_the_optional_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang=={SGLANG_VERSION}"]


def sglang_imports_in_our_code() -> set[tuple[str, str]]:
    """(module, name) for every ``from sglang... import name`` in serving/sglang/."""
    found = set()
    for path in (ROOT / "serving" / "sglang").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
                found |= {(node.module, alias.name) for alias in node.names}
    return found


def test_every_sglang_import_in_our_code_is_in_the_contract():
    listed = {(s.module, s.name.split(".")[0]) for s in SYMBOLS}
    imports = sglang_imports_in_our_code()
    assert imports, "expected lazy sglang imports in serving/sglang"
    assert imports <= listed, sorted(imports - listed)


def test_hook_target_is_a_contract_function():
    module, name = contract.HOOK_TARGET.rsplit(".", 1)
    assert any(s.module == module and s.name == name and s.params for s in SYMBOLS)


def test_importing_our_modules_does_not_import_sglang():
    code = ("import sys, serving.sglang.engine, serving.sglang.plugin, serving.sglang.source_check;"
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
