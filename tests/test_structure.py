"""The package's shape, read from its source with `ast` (no Megatron, no GPU): no import circles, the floors of
DESIGN.md (a room imports only rooms on its own floor or lower), the ground-floor leaves and the `_compat` leaf,
the lazy export table, rooms under 500 lines, one stage-then-rename, and the rooms that must import neither
Lightning nor Megatron-Core.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_megatron"
TOP = "lightning_megatron"
MAX_LINES = 500

# Floors from the top down; a module's floor is that of its longest matching prefix. Every module must match one.
FLOORS: dict[str, int] = {
    # 5: commands and the recipes that drive them
    "lightning_megatron.cli": 5,
    "lightning_megatron.recipes": 5,
    # apart: tiny HF checkpoints made locally; only the commands and recipes (and tests) use them
    "lightning_megatron.testing": 5,
    # the public facade: its `_EXPORTS` table names rooms up to the callbacks, so nothing in the package imports it
    "lightning_megatron": 5,
    # 4: thin Lightning adapters
    "lightning_megatron.callbacks": 4,
    # `LoRACallback` is a Lightning callback (and asks whether an `MTPOnlyCallback` is among the trainer's
    # callbacks): it sits with the callbacks, not with the strategy as DESIGN.md's sketch has it
    "lightning_megatron.lora": 4,
    # 3: the strategy and what it drives
    "lightning_megatron.strategy": 3,
    "lightning_megatron.checkpoint": 3,
    "lightning_megatron.background_save": 3,
    "lightning_megatron.preemption": 3,
    "lightning_megatron.schedule": 3,
    "lightning_megatron.cuda_graphs": 3,
    "lightning_megatron.module": 3,
    "lightning_megatron.vl": 3,
    # the VL bridge glue (VL model types and option checks) lives in vl/ as DESIGN.md says, but the bridges'
    # capability checks call it: it stands on the bridges' floor (it imports only attention and options)
    "lightning_megatron.vl.bridge": 2,
    # 2: bridges, MTP, serving, speculative decoding and their helpers
    "lightning_megatron.bridges": 2,
    "lightning_megatron.mtp": 2,
    "lightning_megatron.serving": 2,
    "lightning_megatron.speculative": 2,
    "lightning_megatron.moe": 2,
    "lightning_megatron.optimizer": 2,
    "lightning_megatron.safe_load": 2,
    "lightning_megatron.generate": 2,
    # 1: the attention core, data, tree rotary
    "lightning_megatron.attention": 1,
    "lightning_megatron.attention_layout": 1,
    "lightning_megatron.data": 1,
    "lightning_megatron.tree_rotary": 1,
    # 0: ground-floor leaves
    "lightning_megatron.microbatch": 0,
    "lightning_megatron.options": 0,
    "lightning_megatron.distributed": 0,
    "lightning_megatron.atomic": 0,
    "lightning_megatron.hf_io": 0,
    "lightning_megatron.staged_write": 0,
    "lightning_megatron.families": 0,
    # apart: the compatibility leaf, which any floor may use (it imports only `families`, see
    # test_compat_is_a_leaf); DESIGN.md keeps the module and the callbacks off it
    # (test_module_and_callbacks_never_touch_compat)
    "lightning_megatron._compat": 0,
}
GROUND = {f"{TOP}.{name}" for name in ("microbatch", "options", "distributed", "atomic", "hf_io", "staged_write",
                                                "families")}
# (importer, imported, the function it may do so in): the only imports a ground-floor leaf makes upwards
GROUND_EXCEPTIONS = {(f"{TOP}.distributed", f"{TOP}._compat", "init_single_process")}

# (file, why): the files that may rename a file or folder themselves
RENAMES_ALLOWED = {
    "atomic.py": "the one stage-then-rename",
}


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


def floor(name: str) -> int:
    prefixes = [prefix for prefix in FLOORS if name == prefix or name.startswith(prefix + ".")]
    if not prefixes:
        raise KeyError(f"{name} has no floor: add its room to FLOORS in tests/test_structure.py")
    return FLOORS[max(prefixes, key=len)]


def test_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle (lazy and TYPE_CHECKING imports count): " + " -> ".join(cycle)


def test_find_cycle_sees_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_exports_name_modules_that_define_them() -> None:
    tree = syntax(PACKAGE / "__init__.py")
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(target, ast.Name) and target.id == "_EXPORTS" for target in node.targets))
    exports = ast.literal_eval(table)
    problems = []
    for attribute, module in exports.items():
        if module not in modules():
            problems.append(f"_EXPORTS[{attribute!r}] = {module!r}: no such module")
        elif attribute not in top_level_names(syntax(modules()[module])):
            problems.append(f"_EXPORTS[{attribute!r}] = {module!r}: that module does not define {attribute}")
    assert not problems, "\n".join(problems)


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


def test_every_module_has_a_floor() -> None:
    missing = []
    for name in modules():
        try:
            floor(name)
        except KeyError as error:
            missing.append(str(error))
    assert not missing, "\n".join(missing)


def test_imports_go_to_the_same_floor_or_lower() -> None:
    violations = [f"{edge.importer} (floor {floor(edge.importer)}) imports {edge.imported} "
                  f"(floor {floor(edge.imported)}) at line {edge.line}"
                  for edge in imports() if floor(edge.imported) > floor(edge.importer)]
    assert not violations, "imports up a floor:\n" + "\n".join(violations)


def test_ground_floor_imports_only_the_ground_floor() -> None:
    violations = [f"{edge.importer}:{edge.line} imports {edge.imported}" for edge in imports()
                  if edge.importer in GROUND and edge.imported not in GROUND
                  and (edge.importer, edge.imported, edge.function) not in GROUND_EXCEPTIONS]
    assert not violations, "a ground-floor leaf imports above the ground floor:\n" + "\n".join(violations)
    ground = {name: {edge.imported for edge in imports() if edge.importer == name and edge.imported in GROUND}
              for name in GROUND}
    cycle = find_cycle(ground)
    assert cycle is None, "ground-floor circle: " + " -> ".join(cycle)


def test_compat_is_a_leaf() -> None:
    inside = f"{TOP}._compat"
    violations = [f"{edge.importer}:{edge.line} imports {edge.imported}" for edge in imports()
                  if (edge.importer == inside or edge.importer.startswith(inside + "."))
                  and not (edge.imported == inside or edge.imported.startswith(inside + "."))
                  and edge.imported != f"{TOP}.families"]
    assert not violations, "_compat imports the package outside _compat (only families is allowed):\n" + "\n".join(
        violations)


def test_module_and_callbacks_never_touch_compat() -> None:
    rooms = (f"{TOP}.module", f"{TOP}.vl.module", f"{TOP}.callbacks")
    violations = [f"{edge.importer}:{edge.line} imports {edge.imported}" for edge in imports()
                  if edge.importer.startswith(rooms) and edge.imported.startswith(f"{TOP}._compat")]
    assert not violations, "\n".join(violations)


def test_no_room_over_500_lines() -> None:
    counts = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
              for path in modules().values()}
    offenders = {path: count for path, count in sorted(counts.items()) if count > MAX_LINES}
    assert not offenders, f"split by what it does; over {MAX_LINES} lines: " + ", ".join(
        f"{path} ({count})" for path, count in offenders.items())


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


def test_renames_only_in_atomic() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in modules().values()
             if str(path.relative_to(PACKAGE)) not in RENAMES_ALLOWED for line in renames(syntax(path))]
    assert not found, ("stage-then-rename by hand; use lightning_megatron.atomic (write_atomically, "
                       "write_file_atomically, write_text_atomically):\n" + "\n".join(found))


def test_renames_finds_them() -> None:
    tree = ast.parse("import os, shutil\nos.replace(a, b)\nPath(a).rename(b)\nshutil.move(a, b)\n"
                     "s.replace('x', 'y')\ndataclasses.replace(o)\n")
    assert renames(tree) == [2, 3, 4]


@pytest.mark.parametrize("module", [f"{TOP}.serving", f"{TOP}.mtp.restore", f"{TOP}.cli.restore_mtp"])
def test_imports_neither_lightning_nor_megatron_core(module: str) -> None:
    probe = (f"import json, sys; import {module}; "
             "print(json.dumps(sorted(name for name in sys.modules if name in ('lightning', 'lightning.pytorch') "
             "or name == 'megatron.core' or name.startswith('megatron.core.'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [], f"import {module} imports {result.stdout.strip()}"
