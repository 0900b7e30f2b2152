"""The package's floors (docs/design.md): each part imports only from the floors below it, and no module imports
itself back through others, type-only and function-level imports included."""

import ast
from pathlib import Path

import hf_budgetdraft

PACKAGE = Path(hf_budgetdraft.__file__).parent
# floor of each top-level part; a part may import from strictly lower floors only
FLOORS = {
    "compat": 0,
    "quiet": 0,
    "loading": 0,
    "attention": 0,
    "cache": 1,
    "cpu": 1,
    "generation": 2,
    "integration": 3,
    "export_drafter": 3,
    "trainer": 3,
    "demo": 4,
    "runs": 5,
    "eval": 6,
    "app": 7,
    "commands": 8,
    "cli": 9,
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its file (resolved to a submodule where one is named)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("hf_budgetdraft")
        ):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
    return (found & modules.keys()) - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_part_has_a_floor():
    parts = {_part(module) for module in _graph()} - {None}
    assert parts == FLOORS.keys(), (
        f"parts without a floor: {parts - FLOORS.keys()}, gone: {FLOORS.keys() - parts}"
    )


def test_parts_import_only_from_lower_floors():
    upward = []
    for module, imported in _graph().items():
        if _part(module) is None or module.endswith("__main__"):  # the package's facade; entry points
            continue
        for other in imported:
            if _part(other) not in (None, _part(module)) and FLOORS[_part(other)] >= FLOORS[_part(module)]:
                upward.append(f"{module} -> {other}")
    assert not upward, "imports that do not go down a floor:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(path[path.index(module) :] + [module])
            return
        if module in done:
            return
        for other in sorted(graph[module]):
            visit(other, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)
