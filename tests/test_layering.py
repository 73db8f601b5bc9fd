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



# ---- the import graph: cycles and layers --------------------------------------------------
# Every import of the package counts, module-level and function-level alike: a function-level
# import defers a dependency to run time, it does not remove it.

def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(module: str, is_package: bool, node: ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules of the package that ``from X import a, b`` reaches (``a`` when it is a
    submodule of ``X``, else ``X`` itself)."""
    if node.level:
        parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Each module of specularch -> the modules of specularch it imports."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "workloads" not in p.parts}
    graph = {}
    for module, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                targets |= set(_imported(module, path.name == "__init__.py", node, set(paths)))
        graph[module] = {t for t in targets if t in paths and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                found.append(component)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


SYMBOLIC_SUBPACKAGES = ("ops", "values", "library", "rolled", "speculation")


def package_of(module: str) -> str:
    """``specularch.symbolic.ops`` for a module of one of symbolic's sub-packages,
    ``specularch.symbolic`` for symbolic's own modules (its core); ``specularch.X`` for every
    other module under X/; a top-level module is its own."""
    parts = module.split(".")
    if parts[1:2] == ["symbolic"] and len(parts) > 2 and parts[2] in SYMBOLIC_SUBPACKAGES:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


# Known cycles across packages, each with its reason; the list may only shrink.
CROSS_PACKAGE_CYCLES: dict = {}

# Processing order, highest first; a module may import its own layer or lower ones only.
LAYERS = [("frames",), ("dispatch", "eager_run", "entry_function", "templates", "tiering"),
          ("symbolic",),
          ("guards", "shadow_heap", "fx_lower")]
UPWARD_IMPORTS: dict = {}  # (importer package, imported package): why; the list may only shrink


# Inside symbolic/, highest first: the driver of a capture; the opcode handlers; the models
# of library callables; the core (the tracer, the symbolic frame, calls, attributes, Python
# operators, exceptions); rolled loops; speculation; values; and the tables and leaf modules
# any layer may use (the core reaches handlers and models only through the tables
# ``opcodes.py`` and ``models.py``). A unit is a sub-package or one of symbolic's own modules.
# ``rolled/`` is reached as ``speculation/`` is (from the core, ``ops/``, ``library/``,
# ``capture.py``) and shares no import with it either way; it sits above it because a rolled
# loop is itself a speculation (iteration 1's shape assumed for every iteration, checked per
# iteration) and may build on speculation's pieces, while these never need a rolled loop.
SYMBOLIC_LAYERS = [
    ("capture", "__init__"),
    ("ops",),
    ("library",),
    ("tracer", "frame", "calls", "attrs", "operators", "exceptions", "inputs", "op_args",
     "alias_guards", "lookup_guards", "commit_inplace"),
    ("rolled",),
    ("speculation",),
    ("values",),
    ("models", "opcodes", "hooks", "assumptions", "bytecode", "library_files", "budget",
     "static_sizes", "_torch_dispatch"),
]


def _symbolic_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[1:2] != ["symbolic"]:
        return None
    unit = parts[2] if len(parts) > 2 else "__init__"
    return next((i for i, layer in enumerate(SYMBOLIC_LAYERS) if unit in layer), None)


def _layer(module: str) -> int | None:
    name = module.split(".")[1] if "." in module else None
    return next((i for i, layer in enumerate(LAYERS) if name in layer), None)


def test_no_import_cycle_spans_two_packages():
    spanning = {}
    for cycle in cycles(import_graph()):
        packages = frozenset(map(package_of, cycle))
        if len(packages) > 1 and packages not in CROSS_PACKAGE_CYCLES:
            spanning[packages] = sorted(cycle)
    assert not spanning, ("import cycles across packages (a cycle is allowed inside one "
                          f"package only; register the lower side in a table instead): {spanning}")


def test_no_import_runs_up_the_layers():
    upward = []
    for module, targets in import_graph().items():
        for target in targets:
            low, high = _layer(module), _layer(target)
            pair = (package_of(module), package_of(target))
            if low is not None and high is not None and high < low and pair not in UPWARD_IMPORTS:
                upward.append(f"{module} -> {target}")
    assert not upward, ("imports back up the layers frames -> dispatch -> symbolic -> "
                        f"guards/shadow_heap/fx_lower: {sorted(upward)}")


def test_every_module_of_symbolic_has_a_layer():
    unplaced = sorted(m for m in import_graph() if m.startswith("specularch.symbolic")
                      and _symbolic_layer(m) is None)
    assert not unplaced, f"place these modules in SYMBOLIC_LAYERS: {unplaced}"


def test_no_import_runs_up_the_layers_inside_symbolic():
    upward = sorted(f"{module} -> {target}" for module, targets in import_graph().items()
                    for target in targets
                    if _symbolic_layer(module) is not None and _symbolic_layer(target) is not None
                    and _symbolic_layer(target) < _symbolic_layer(module))
    assert not upward, ("imports back up the layers of symbolic/ (capture -> ops -> library -> "
                        f"core -> rolled -> speculation -> values -> tables): {upward}")


def test_symbolic_core_reaches_library_models_through_the_table():
    """Only ``capture.py``, which drives a capture, imports symbolic/library/ from the core of
    symbolic/; the rest of the core looks models up in ``symbolic/models.py``, so the library
    sits above the core it is written against."""
    library = "specularch.symbolic.library"
    core = {m for m in import_graph() if m.startswith("specularch.symbolic.") and m.count(".") == 2
            and m.split(".")[2] not in SYMBOLIC_SUBPACKAGES}
    offending = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
                       if m in core - {"specularch.symbolic.capture"}
                       and (t == library or t.startswith(library + ".")))
    assert not offending, f"core modules of symbolic/ importing library/ (use models.MODELS): {offending}"


def test_every_declared_model_is_registered():
    from specularch.symbolic.models import DECLARED, MODELS
    import specularch.symbolic.library  # noqa: F401  (what capture imports)
    assert {name for name in DECLARED if name not in MODELS._table} == set()


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [{"a", "b"}]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [{"a", "b", "c"}]),
])
def test_the_cycle_finder(graph, expected):
    assert cycles(graph) == expected


def test_the_import_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "specularch.symbolic.calls" in graph["specularch.symbolic.ops.exceptions"]  # in a function
    assert "specularch.symbolic.ops.loads" in graph["specularch.symbolic.ops"]  # from . import
    assert "specularch.guards.sources" in graph["specularch.symbolic.values"]  # from ...guards.sources
