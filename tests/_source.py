"""The package read from its source with `ast` (no Megatron, no GPU), for the floor-plan rules of
`tests/test_structure.py` and `tests/bench/test_bench_structure.py`: modules, their imports (lazy and type-only
ones included), circles, renames, private names and attributes read by name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_megatron"
TOP = "lightning_megatron"


@dataclass(frozen=True)
class Import:
    """One import statement's target module, where it is, and the function it sits in (None: module level)."""

    importer: str
    imported: str
    line: int
    function: str | None

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}

@cache
def syntax(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

def _functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node inside a function, with the name of its outermost function."""
    inside: dict[ast.AST, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node not in inside:
            for child in ast.walk(node):
                inside.setdefault(child, node.name)
    return inside

@cache
def imports() -> tuple[Import, ...]:
    """Every import of a package module: module level, inside functions and under `if TYPE_CHECKING:`.

    `from P import x` imports the module `P.x` when there is one, else `P`; relative forms are resolved.
    """
    known = modules()
    found: list[Import] = []
    for name, path in known.items():
        tree = syntax(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        inside = _functions(tree)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            for target in dict.fromkeys(targets):
                if target in known and target != name:
                    found.append(Import(name, target, node.lineno, inside.get(node)))
    return tuple(found)

def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]

def import_graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs. Importing `a.b.c` runs `a/__init__` and `a/b/__init__` first, so
    an import of `a.b.c` is also an edge to those packages, except the importer's own packages: they are already
    running when it runs (a package whose `__init__` imports its own modules is no circle)."""
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for edge in imports():
        own = {edge.importer, *ancestors(edge.importer)}
        graph[edge.importer] |= {edge.imported, *(pkg for pkg in ancestors(edge.imported) if pkg not in own)}
    return graph

def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as a path that returns to its start, or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph[node]):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None

def top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names

def private_imports(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from module import _name` (dunder names aside): another module's private
    name, which should be public where it is shared."""
    return [(node.lineno, node.module or "", alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) for alias in node.names
            if alias.name.startswith("_") and not alias.name.startswith("__")]

def renames(tree: ast.Module) -> list[int]:
    """Lines that rename a file or folder: `os.replace`/`os.rename`/`os.renames`, `shutil.move`, and a one-argument
    `.replace(target)`/`.rename(target)` call (a `Path`'s; `str.replace` takes two)."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        attribute = node.func.attr
        if owner == "os" and attribute in ("replace", "rename", "renames") or (owner, attribute) == ("shutil", "move"):
            lines.append(node.lineno)
        elif (attribute in ("replace", "rename") and owner not in ("os", "dataclasses") and len(node.args) == 1
              and not node.keywords):
            lines.append(node.lineno)
    return sorted(lines)


def defines_class(tree: ast.Module, class_name: str) -> bool:
    return any(isinstance(node, ast.ClassDef) and node.name == class_name for node in tree.body)

def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node `start` reaches in `graph` (itself excluded unless on a circle)."""
    seen: set[str] = set()
    pending = list(graph[start])
    while pending:
        node = pending.pop()
        if node not in seen:
            seen.add(node)
            pending.extend(graph[node])
    return seen

def attributes_by_name(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, attribute) of every `getattr(x, "attribute", ...)` and `hasattr(x, "attribute")`."""
    return sorted((node.lineno, node.args[1].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))
