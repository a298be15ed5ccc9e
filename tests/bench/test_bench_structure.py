"""The floor plan of `bench/`: no import circle among its scripts (lazy imports count), a row in `bench/README.md`
for every script, and no stage-then-rename by hand (the scripts write through `lightning_megatron.atomic`)."""

import ast
import re
from pathlib import Path

from tests._source import find_cycle, renames

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_imports(folder: Path) -> dict[str, set[str]]:
    """Script -> the scripts of `folder` it imports, at module level or inside a function (`bench.x` names)."""
    scripts = {path.stem: path for path in sorted(folder.glob("*.py")) if path.stem != "__init__"}
    graph: dict[str, set[str]] = {name: set() for name in scripts}
    for name, path in scripts.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "bench":
                targets = [f"bench.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            graph[name] |= {target.split(".")[1] for target in targets
                            if target.startswith("bench.") and target.split(".")[1] in scripts} - {name}
    return graph


def scripts_without_a_row(folder: Path, readme: str) -> list[str]:
    """The scripts of `folder` that the README's table (rows starting with | `name` |) does not name."""
    rows = set(re.findall(r"^\| `([^`]+)` \|", readme, flags=re.MULTILINE))
    return sorted(path.name for path in folder.glob("*.py") if path.name != "__init__.py" and path.name not in rows)


def test_bench_has_no_import_circle() -> None:
    cycle = find_cycle(bench_imports(BENCH))
    assert cycle is None, ("import circle in bench/ (lazy imports count); move what both need into one of them: "
                           + " -> ".join(cycle))


def test_bench_imports_sees_a_circle(tmp_path: Path) -> None:
    (tmp_path / "one.py").write_text("from bench.two import helper\n")
    (tmp_path / "two.py").write_text("def helper():\n    from bench import one\n")
    (tmp_path / "three.py").write_text("import bench.one\n")
    assert bench_imports(tmp_path) == {"one": {"two"}, "three": {"one"}, "two": {"one"}}
    assert find_cycle(bench_imports(tmp_path)) == ["one", "two", "one"]


def test_every_bench_script_has_a_readme_row() -> None:
    missing = scripts_without_a_row(BENCH, (BENCH / "README.md").read_text(encoding="utf-8"))
    assert not missing, ("add a row to bench/README.md's table (what it measures, the command, where its results "
                         "go) for: " + ", ".join(missing))


def test_scripts_without_a_row_sees_a_missing_one(tmp_path: Path) -> None:
    for name in ("listed.py", "unlisted.py"):
        (tmp_path / name).write_text("")
    readme = "| script | what it measures |\n|---|---|\n| `listed.py` | something |\n"
    assert scripts_without_a_row(tmp_path, readme) == ["unlisted.py"]


def test_bench_renames_nothing_by_hand() -> None:
    found = [f"{path.name}:{line}" for path in sorted(BENCH.glob("*.py"))
             for line in renames(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, ("stage-then-rename by hand; use lightning_megatron.atomic (write_atomically, "
                       "write_file_atomically, write_text_atomically):\n" + "\n".join(found))
