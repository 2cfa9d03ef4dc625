"""The house's own rules, held by a test so that they stay true (STYLE.md, DESIGN.md's layers):
rooms as folders, one way for data to flow, sizes a reader can hold, torch's privates and
``sys.modules`` in one module.

Read from the source alone (ast), nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "accumkernels"
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 400, 300, 80
MAX_MODULES = 12  # per folder: accumkernels/ and accumkernels/optim/ (the rest in subfolders)


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (at any depth of its code)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                out.add(full if full in known else module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}


def test_no_file_class_or_function_is_too_long_to_read():
    too_long = []
    for name, path in modules().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                too_long.append(f"{name}.{node.name}: class of {size} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION:
                too_long.append(f"{name}.{node.name}: function of {size} lines")
    assert not too_long, too_long


@pytest.mark.parametrize("folder", [PACKAGE, PACKAGE / "optim"], ids=["accumkernels", "optim"])
def test_a_folder_holds_few_modules_and_the_rest_in_rooms(folder):
    top = sorted(p.name for p in folder.glob("*.py"))
    assert len(top) <= MAX_MODULES, f"{folder.name}/ has {len(top)} modules: {top}"


def test_the_import_graph_has_no_circle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    # a package's face imports its own rooms: not an arrow between rooms
    graph = {n: {m for m in deps if not m.startswith(n + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(
                    path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_op_layer_never_imports_the_wrapper():
    """Data flows one way: wrapper -> buffer -> op -> backend kernel."""
    known = modules()
    back = [(n, m) for n, p in known.items() if n.startswith("accumkernels.ops")
            for m in imports(n, p, known)
            if m.startswith(("accumkernels.optim", "accumkernels.integrations",
                             "accumkernels.buffer", "accumkernels.optimizers"))]
    assert not back, back


def test_sys_modules_is_read_only_in_torch_private():
    """What the wrapper does never depends on what else was imported (DESIGN: no guessing from
    outside); where torch's own optional parts must be looked up, _torch_private does it."""
    readers = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "modules" and \
                    isinstance(node.value, ast.Name) and node.value.id == "sys":
                readers.append(name)
    assert set(readers) <= {"accumkernels._torch_private"}, sorted(set(readers))


def test_no_room_imports_another_rooms_private_names():
    """``from accumkernels.x import _name`` only for the package's shared private modules."""
    shared = ("accumkernels._util", "accumkernels._torch_private", "accumkernels._engines",
              "accumkernels._version", "accumkernels")
    known = modules()
    reaches = []
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.startswith("accumkernels") and node.module not in shared:
                reaches += [f"{name}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and a.name != "_C"]
    assert not reaches, reaches
