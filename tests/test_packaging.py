"""The package works from a wheel as from a checkout: nothing finds files by climbing out of the installed package.

A wheel is built from the checkout's sources and installed (not editable) into a temporary target; from a folder
outside the checkout, with only that target on `PYTHONPATH` (the venv's site-packages give the dependencies; its
editable finder comes after the path finders, so the target wins), the quickstart's first step runs and reads the
packaged prompts, every file of `lightning_megatron/configs` is there, and `lightning-megatron-restore-mtp --help`
answers.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightning_megatron
from lightning_megatron.serving import receiver

ROOT = Path(__file__).resolve().parents[1]
PACKAGED_CONFIGS = ROOT / "lightning_megatron" / "configs"

# run in the installed package's process: where it was imported from, and which configs it can read
CHECK_INSTALL = """
import sys
from importlib.resources import files
from pathlib import Path
import lightning_megatron
site = Path(sys.argv[1]).resolve()
assert Path(lightning_megatron.__file__).resolve().is_relative_to(site), lightning_megatron.__file__
def walk(node, prefix=""):
    for child in node.iterdir():
        yield from walk(child, f"{prefix}{child.name}/") if child.is_dir() else [f"{prefix}{child.name}"]
print("\\n".join(sorted(walk(files("lightning_megatron") / "configs"))))
from lightning_megatron.cli import quickstart
sys.exit(quickstart.main(["--stop-after", "1", "--workdir", sys.argv[2]]))
"""


def _packaged_config_files() -> list[str]:
    return sorted(str(path.relative_to(PACKAGED_CONFIGS)) for path in PACKAGED_CONFIGS.rglob("*") if path.is_file())


def _run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert completed.returncode == 0, f"{command}\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    return completed


@pytest.fixture(scope="module")
def installed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package built as a wheel from a copy of the checkout's sources (the build leaves `build/` and
    `*.egg-info` beside them) and installed with pip into a fresh target folder."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "lightning_megatron", source / "lightning_megatron", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(tmp / "dist"),
          str(source)])
    (wheel,) = (tmp / "dist").glob("lightning_megatron-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        prefix = "lightning_megatron/configs/"
        in_wheel = sorted(name[len(prefix):] for name in archive.namelist() if name.startswith(prefix))
    assert in_wheel == _packaged_config_files()
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(tmp / "site"), str(wheel)])
    return tmp / "site"


def _outside_env(site_dir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(site_dir)}


def test_the_quickstart_runs_from_a_wheel_install(installed_site: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    completed = _run([sys.executable, "-c", CHECK_INSTALL, str(installed_site), str(work)],
                     cwd=tmp_path, env=_outside_env(installed_site))
    listed = [line for line in completed.stdout.splitlines() if not line.startswith(("[1/5]", "stopped"))]
    assert listed == _packaged_config_files()
    assert "stopped after step 1 of 5" in completed.stdout
    assert (work / "tiny-qwen3-mtp" / "config.json").is_file()
    prompts = (work / "prompts.jsonl").read_text().splitlines()
    packaged = PACKAGED_CONFIGS / "data"
    expected = [*(packaged / "tiny_prompts_train.jsonl").read_text().splitlines(),
                *(packaged / "tiny_prompts_heldout.jsonl").read_text().splitlines()]
    assert len(prompts) == len([line for line in expected if line.strip()]) > 0


def test_restore_mtp_help_from_a_wheel_install(installed_site: Path, tmp_path: Path) -> None:
    completed = _run([sys.executable, "-m", "lightning_megatron.cli.restore_mtp", "--help"],
                     cwd=tmp_path, env=_outside_env(installed_site))
    assert "usage:" in completed.stdout


def test_a_receiver_child_imports_the_package_from_where_this_process_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """From a checkout the child gets the checkout's folder ahead of the inherited PYTHONPATH; installed in a site
    directory it gets nothing (the child has the site directories, and one on PYTHONPATH would shadow the standard
    library)."""
    import_root = str(Path(lightning_megatron.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(site, "getsitepackages", lambda: ["/a/site-packages"])
    assert receiver.child_pythonpath() == os.pathsep.join([import_root, "/elsewhere"])
    monkeypatch.setattr(site, "getsitepackages", lambda: ["/a/site-packages", import_root])
    assert receiver.child_pythonpath() == "/elsewhere"


def test_the_entry_point_table_is_what_pyproject_installs() -> None:
    """`cli.COMMANDS` is the one table of commands: its console scripts are exactly `[project.scripts]`, and every
    target names a function that exists (the modules are imported here, which loads Lightning: fine in a test)."""
    import importlib
    import tomllib

    from lightning_megatron.cli import COMMANDS

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {command.script: command.target for command in COMMANDS if command.script is not None}
    for command in COMMANDS:
        module, function = command.target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), command.target
