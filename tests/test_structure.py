"""The shape of the package: no import circle anywhere (imports inside functions included), one table of backbones,
every module importable on its own, and no module or function too long to hold in one's head."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import capserve
from capserve.model.backbones import BACKBONES

PACKAGE = Path(capserve.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path) -> set[str]:
    """The capserve modules ``name`` imports, at any depth of its code: ``from capserve.a import b`` is an edge to
    the module ``capserve.a.b`` when there is one, else to ``capserve.a`` (whose ``__init__`` then runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle():
    graph = {name: imported_modules(name, path) for name, path in MODULES.items()}
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph) or [])


def test_predict_and_the_pipeline_import_nothing_from_the_server():
    """Offline prediction and the image -> answer pipeline run without the HTTP service: neither imports
    ``capserve.serving`` (function-level imports included), so the server cannot drift from them unseen."""
    below = [name for name in MODULES if name.split(".")[1:2] in (["predict"], ["pipeline"])]
    assert below
    for name in below:
        server = {m for m in imported_modules(name, MODULES[name]) if m.split(".")[1:2] == ["serving"]}
        assert not server, f"{name} imports {sorted(server)}"


def test_the_cycle_finder_finds_a_circle_through_a_function_level_import(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import capserve.configs\n")
    b.write_text("def f():\n    from capserve.model import factory\n")
    graph = {"capserve.configs": {"capserve.model.factory"}, "capserve.model.factory": {"capserve.configs"}}
    assert find_cycle(graph) == ["capserve.configs", "capserve.model.factory", "capserve.configs"]
    assert "capserve.model.factory" in imported_modules("x.b", b)


# One fresh interpreter loads the third-party libraries once, then forks a child per capserve module that imports
# that module first, with no capserve module loaded yet: a circle shows up as an ImportError in its child.
IMPORT_EACH_FIRST = """
import importlib, os, sys, traceback
import numpy, torch, PIL.Image, safetensors.torch  # loaded once, before the fork
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1]:
        failed.append(name)
print("failed:", " ".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_every_module_imports_first_in_a_fresh_interpreter():
    """A circle hides until a module is the first one imported: import each one first, alone."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_FIRST, *sorted(MODULES)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-500:] + result.stderr[-3000:]


def test_one_backbone_table_names_every_configs_backbone():
    used = {capserve.get_config(name).backbone for name in capserve.list_models()}
    assert used <= set(BACKBONES), used - set(BACKBONES)
    with pytest.raises(ValueError, match="resnet"):  # the error lists the valid ones
        capserve.create_model("cifar10-resnet", backbone="vgg")


def test_one_copy_of_each_shared_helper():
    """softmax/sigmoid, sha256, image suffixes and the worker-thread runner each live in one module (their callers
    import them)."""
    sources = {name: path.read_text() for name, path in MODULES.items()}
    helpers = [
        ("def softmax(", "capserve.runtime.outputs"),
        ("def sigmoid(", "capserve.runtime.outputs"),
        ("def file_sha256(", "capserve.hashing"),
        ("IMAGE_SUFFIXES =", "capserve.data.images"),
        ("def in_worker_thread(", "capserve.runtime.base"),
    ]
    for definition, home in helpers:
        homes = [name for name, text in sources.items() if definition in text]
        assert homes == [home], (definition, homes)
    assert importlib.import_module("capserve.errors").UsageError is importlib.import_module("capserve.cli").UsageError


def only_reexports(path: Path) -> bool:
    """A module whose body is a docstring and imports: a shim that keeps an old import path alive."""
    body = ast.parse(path.read_text()).body
    code = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return bool(code) and all(isinstance(n, ast.Import | ast.ImportFrom) for n in code)


def test_no_module_only_reexports():
    """Every module outside a package's ``__init__`` does work of its own; moved names move, they leave no shim."""
    shims = [name for name, path in MODULES.items() if path.name != "__init__.py" and only_reexports(path)]
    assert shims == []


def test_the_shim_finder_finds_a_reexporting_module(tmp_path):
    shim, real = tmp_path / "shim.py", tmp_path / "real.py"
    shim.write_text('"""Moved."""\n\nfrom capserve.data.images import *  # noqa: F403\n')
    real.write_text("from capserve.data.images import load_image\n\nSIZE = 3\n")
    assert only_reexports(shim) and not only_reexports(real)


@pytest.mark.parametrize("package", sorted(name for name, path in MODULES.items() if path.name == "__init__.py"))
def test_every_package_states_its_public_names(package):
    """Each package's ``__init__`` lists what it offers (``__all__``), and each listed name is there."""
    module = importlib.import_module(package)
    assert isinstance(getattr(module, "__all__", None), list), f"{package} has no __all__"
    assert [name for name in module.__all__ if not hasattr(module, name)] == []


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80


def too_long(path: Path) -> list[str]:
    """``path`` if it is over ``MAX_MODULE_LINES`` lines, and each of its functions over ``MAX_FUNCTION_LINES``."""
    source = path.read_text()
    found = [f"{path.name}: {n} lines"] if (n := len(source.splitlines())) > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        if is_function and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
            found.append(f"{path.name}:{node.lineno} {node.name}: {n} lines")
    return found


def test_every_module_and_function_fits_in_a_readers_head():
    assert [line for path in MODULES.values() for line in too_long(path)] == []


def test_the_size_finder_finds_a_long_module_and_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text(f"def f():\n{body[: body.rindex(chr(10))]}\n")
    long.write_text(f"def f():\n{body}\n" + "\n" * MAX_MODULE_LINES)
    assert too_long(short) == []
    assert too_long(long) == [
        f"long.py: {MAX_FUNCTION_LINES + 1 + MAX_MODULE_LINES} lines",
        f"long.py:1 f: {MAX_FUNCTION_LINES + 1} lines",
    ]
