"""The layer table of the design: every import in ``src/torchrig`` points down, none up.

Each ``import`` / ``from … import`` statement counts, wherever it is: at the top of a module, inside a
function (lazy imports) or under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "torchrig"

# layer -> the layers it may import, as the design's table lists them. What those may import comes
# with them ("dependencies point down only"): recipes may use runtime and checkpoint through trainer.
TABLE: dict[str, set[str]] = {
    "cli": {"tune", "export", "recipes", "trainer", "optim", "observe", "parallel", "checkpoint", "metrics", "data", "models",
            "runtime", "config"},
    "tune": {"recipes", "trainer"},  # hyperparameter search: its trials are the recipes' runs
    "export": {"recipes", "trainer"},  # a checkpoint's model to other runtimes: loaded as a recipe's, then checked
    "recipes": {"trainer", "models", "data", "config"},
    "trainer": {"optim", "observe", "parallel", "checkpoint", "metrics", "data", "runtime", "config"},
    "optim": {"parallel", "checkpoint", "metrics", "data", "models", "runtime", "config"},
    "observe": {"parallel", "checkpoint", "metrics", "data", "models", "runtime", "config"},
    "parallel": {"runtime", "config"},
    "checkpoint": {"runtime", "config"},
    "metrics": {"runtime"},
    "data": {"runtime", "config"},
    "models": set(),
    "runtime": set(),
    "config": set(),
}
# The documented exceptions: errors.py (the base error class and suggest(), standard library only)
# may be imported by every layer; the package's own __init__.py / __main__.py are its front door.
ANYONE_MAY_IMPORT = {"errors"}
FRONT_DOOR = {"__init__", "__main__"}
# Layers held to the standard library, and the other libraries each may use.
STDLIB_ONLY = {"config": {"yaml"}, "errors": set()}


def allowed(layer: str) -> set[str]:
    seen: set[str] = set()
    todo = [layer]
    while todo:
        for below in TABLE[todo.pop()]:
            if below not in seen:
                seen.add(below)
                todo.append(below)
    return seen | {layer} | ANYONE_MAY_IMPORT


def layer_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module or ``torchrig.NAME``) for every import statement in ``path``."""
    package = list(path.relative_to(root.parent).parts[:-1])  # the package holding the module
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base == root.name:  # `from torchrig import config` / `from .. import runtime`
                out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, base))
    return out


def violations(root: Path) -> list[str]:
    """One line per import against the table: ``src/torchrig/FILE:LINE: what is wrong``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        layer, where = layer_of(path, root), path.relative_to(root.parent.parent)
        if layer in FRONT_DOOR:
            continue
        if layer not in TABLE and layer not in STDLIB_ONLY:
            found.append(f"{where}: '{layer}' is in no layer of the table")
            continue
        for line, module in imported(path, root):
            parts = module.split(".")
            if parts[0] == root.name and layer in TABLE:
                target = parts[1] if len(parts) > 1 else "__init__"
                if target not in allowed(layer):
                    below = ", ".join(sorted(allowed(layer) - {layer}))
                    found.append(f"{where}:{line}: layer '{layer}' imports '{module}' (layer '{target}'); "
                                 f"{layer} may import {below}")
            elif layer in STDLIB_ONLY and parts[0] not in sys.stdlib_module_names | STDLIB_ONLY[layer]:
                found.append(f"{where}:{line}: '{layer}' imports '{module}'; it may use only the standard library"
                             + "".join(f" and {m}" for m in sorted(STDLIB_ONLY[layer])))
    return found


def test_every_import_points_down_the_layer_table():
    assert SRC.is_dir()
    problems = violations(SRC)
    assert not problems, "imports against the layer table:\n" + "\n".join(problems)


def layer_graph(root: Path) -> dict[str, set[str]]:
    """layer -> the layers its modules import, read from the package itself."""
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        layer = layer_of(path, root)
        if layer in FRONT_DOOR:
            continue
        for _, module in imported(path, root):
            parts = module.split(".")
            if parts[0] == root.name and len(parts) > 1 and parts[1] != layer and parts[1] not in ANYONE_MAY_IMPORT:
                graph.setdefault(layer, set()).add(parts[1])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more nodes (or a node importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_package_is_a_stack_of_the_tables_layers():
    """Every folder and module of src/torchrig is a layer of the table (or errors / the front door), every
    layer of the table exists, and the layers the package really imports form no circle."""
    present = {layer_of(p, SRC) for p in SRC.rglob("*.py")} - FRONT_DOOR - ANYONE_MAY_IMPORT
    assert present == set(TABLE), f"in the package, not the table: {present - set(TABLE)}; " \
                                  f"in the table, not the package: {set(TABLE) - present}"
    assert cycles(layer_graph(SRC)) == []
    assert cycles(TABLE) == []


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(root: Path, lazy: bool = False) -> dict[str, dict[str, set[str]]]:
    """module -> {imported torchrig module: names imported from it}, for the import statements that run when the
    module is imported (``lazy``: those inside functions too). ``from . import x`` of a submodule counts as
    ``pkg.x``."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    out: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: dict[str, set[str]] = {}
        tree = ast.parse(path.read_text(), str(path))
        inside = set() if lazy else {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if id(node) in inside or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        deps.setdefault(a.name, set())
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                if target in modules:
                    deps.setdefault(target, set()).add(a.name)
        out[name] = deps
    return out


def test_no_import_circle_inside_a_layer():
    """Within a layer, modules import each other one way only (a circle works today by import order and
    breaks the day someone reorders an import)."""
    graph = {m: {d for d in deps if d != m and d.split(".")[1:2] == m.split(".")[1:2]
                 and not module_name_is_package(d)} for m, deps in module_imports(SRC).items()}
    assert cycles(graph) == []


def module_name_is_package(name: str) -> bool:
    return (SRC.parent / name.replace(".", "/") / "__init__.py").exists()


def test_no_private_name_is_imported_from_another_module():
    found = [f"{m} imports {d}.{n}" for m, deps in sorted(module_imports(SRC, lazy=True).items()) for d, names in deps.items()
             for n in sorted(names) if n.startswith("_") and not n.startswith("__") and d != m]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_the_checks_find_a_circle_and_a_private_import(tmp_path):
    root = tmp_path / "src" / "torchrig"
    for rel, text in {"__init__.py": "", "data/__init__.py": "", "data/a.py": "from .b import x\n",
                      "data/b.py": "from .a import _y\n\ndef lazy():\n    from .c import z\n",
                      "data/c.py": "from .b import x\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    deps = module_imports(root)
    assert deps["torchrig.data.b"] == {"torchrig.data.a": {"_y"}}  # the lazy import inside lazy() does not count
    assert cycles({m: set(d) for m, d in deps.items()}) == [["torchrig.data.a", "torchrig.data.b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert module_imports(root, lazy=True)["torchrig.data.b"] == {"torchrig.data.a": {"_y"}, "torchrig.data.c": {"z"}}


@pytest.fixture
def fake_package(tmp_path):
    root = tmp_path / "src" / "torchrig"
    for rel, text in {
        "__init__.py": "from torchrig import trainer\n",
        "errors.py": "import difflib\nimport torch\n",
        "config/__init__.py": "import yaml\nfrom ..errors import suggest\n",
        "data/loaders.py": "from ..runtime import x\n\ndef lazy():\n    from ..trainer import Trainer\n",
        "data/datasets/text.py": "from ...metrics import y\nfrom ..loaders import DataError\n",
        "checkpoint/sharded.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import recipes\n",
        "runtime/__init__.py": "import torch\nimport torchrig.models.small\n",
        "config/extra.py": "import torch\n",
        "recipes/base.py": "from .. import runtime, checkpoint\nfrom torchrig.cli import main\n",
        "plugins.py": "",
    }.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_finds_lazy_type_only_and_relative_imports(fake_package):
    found = violations(fake_package)
    assert [p.split(" (layer")[0] for p in found] == [
        "src/torchrig/checkpoint/sharded.py:3: layer 'checkpoint' imports 'torchrig.recipes'",
        "src/torchrig/config/extra.py:1: 'config' imports 'torch'; it may use only the standard library and yaml",
        "src/torchrig/data/datasets/text.py:1: layer 'data' imports 'torchrig.metrics'",
        "src/torchrig/data/loaders.py:4: layer 'data' imports 'torchrig.trainer'",
        "src/torchrig/errors.py:2: 'errors' imports 'torch'; it may use only the standard library",
        "src/torchrig/plugins.py: 'plugins' is in no layer of the table",
        "src/torchrig/recipes/base.py:2: layer 'recipes' imports 'torchrig.cli'",
        "src/torchrig/runtime/__init__.py:2: layer 'runtime' imports 'torchrig.models.small'",
    ]
    assert found[3].endswith("(layer 'trainer'); data may import config, errors, runtime")


def test_the_code_stays_small_and_readable():
    """No function over 60 lines anywhere in src/torchrig (a function that long is several steps to name)."""
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"src/torchrig/{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
