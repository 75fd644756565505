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
    "cli": {"recipes", "trainer", "checkpoint", "metrics", "data", "models", "runtime", "config"},
    "recipes": {"trainer", "models", "data", "config"},
    "trainer": {"parallel", "runtime", "checkpoint", "metrics", "data", "config"},
    "parallel": {"runtime", "config"},
    "checkpoint": {"runtime", "config"},
    "metrics": {"runtime"},
    "data": {"runtime"},
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


def test_the_table_is_a_stack():
    order = ["config", "runtime", "models", "data", "metrics", "checkpoint", "parallel", "trainer", "recipes", "cli"]
    assert set(order) == set(TABLE)
    for i, layer in enumerate(order):
        assert allowed(layer) - ANYONE_MAY_IMPORT <= set(order[:i + 1]), layer


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
    assert found[3].endswith("(layer 'trainer'); data may import errors, runtime")


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
