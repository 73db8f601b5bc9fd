"""Layering rules checked on the source: private torch APIs (``torch._C``, ``torch._ops``,
``torch._foreach_norm``, ``torch.utils._python_dispatch``, ...) are used only in the
``_torch_*`` compat modules, so that a torch upgrade touches only those files."""
from __future__ import annotations

import ast
import pathlib

import pytest

import specularch

PACKAGE = pathlib.Path(specularch.__file__).parent


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch path it stands for (``nn`` -> ``torch.nn``), from every
    import in the module (function-level ones included)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "torch":
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``torch._C.TensorBase`` for an attribute chain rooted at a torch alias, else None."""
    names = []
    if isinstance(node, ast.Name) and node.id in aliases:
        return aliases[node.id]
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(names)])


def _literal_prefix(node: ast.AST) -> str | None:
    """The name a ``getattr`` looks up, as far as the source spells it (``f"_foreach_{op}"``
    gives ``_foreach_``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    return None


def private_torch_uses(source: str) -> list[str]:
    """Every reference in ``source`` to a private torch name, as ``line: dotted.path``."""
    tree = ast.parse(source)
    _with_parents(tree)  # an attribute chain is reported once, at its outermost node
    aliases = _torch_aliases(tree)
    found = []
    for node in ast.walk(tree):
        paths = []
        if isinstance(node, ast.Import):
            paths = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "torch":
            paths = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            path = _dotted(node, aliases)
            paths = [path] if path else []
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
            base, name = _dotted(node.args[0], aliases), _literal_prefix(node.args[1])
            paths = [f"{base}.{name}"] if base and name is not None else []
        found += [f"{node.lineno}: {p}" for p in paths if any(_private(s) for s in p.split("."))]
    return sorted(set(found), key=lambda s: (int(s.split(":")[0]), s))


def _with_parents(tree: ast.AST) -> None:
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent


def _package_modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not p.name.startswith("_torch_"))


@pytest.mark.parametrize("path", _package_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_private_torch_apis_only_in_compat_modules(path):
    uses = private_torch_uses(path.read_text())
    assert not uses, (f"{path.relative_to(PACKAGE)} uses private torch APIs outside a _torch_* "
                      f"compat module (move them into the compat module of their concern): {uses}")


@pytest.mark.parametrize("snippet, expected", [
    ("import torch\nx = torch._C.TensorBase", ["2: torch._C.TensorBase"]),
    ("import torch\ntorch._foreach_norm([a], 2)", ["2: torch._foreach_norm"]),
    ("import torch.nn as nn\nnn.modules.module._global_forward_hooks", [
        "2: torch.nn.modules.module._global_forward_hooks"]),
    ("def f():\n    from torch.utils._python_dispatch import _get_current_dispatch_mode\n",
     ["2: torch.utils._python_dispatch._get_current_dispatch_mode"]),
    ("import torch._dynamo\n", ["1: torch._dynamo"]),
    ("import torch\ngetattr(torch._C, 'X')", ["2: torch._C", "2: torch._C.X"]),
    ("import torch\ngetattr(torch, f'_foreach_{op}')", ["2: torch._foreach_"]),
    ("import torch\ngetattr(torch, '_foreach_add')", ["2: torch._foreach_add"]),
    ("import torch\nimport os\nos.path.dirname(torch.__file__); torch.nn.functional.relu(x)", []),
    ("import torch\nx._version; y._modules", []),  # private attributes of objects: not seen
])
def test_the_check_finds_private_torch_names(snippet, expected):
    assert private_torch_uses(snippet) == expected

