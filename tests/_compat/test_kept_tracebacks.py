"""A module that keeps the exception of an optional import it could not make (pulp's solver classes, imported by
megatron-bridge) keeps every frame on the stack at the time: imported inside `trainer.fit`, the whole run."""

from __future__ import annotations

import gc
import importlib
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest

from lightning_megatron._compat.kept_tracebacks import imports_keeping_no_frames

KEEPS_ITS_IMPORT_ERROR = """
try:
    import a_module_that_is_not_installed
except ImportError as error:
    failed = error

    class Solver:
        err = error
"""


class Run:
    """Stands for what a fit's frames hold."""


def _import_inside_a_run(name: str, keeping_no_frames: bool) -> weakref.ref:
    run = Run()
    if keeping_no_frames:
        with imports_keeping_no_frames():
            importlib.import_module(name)
    else:
        importlib.import_module(name)
    return weakref.ref(run)


@pytest.mark.parametrize("keeping_no_frames", [True, False], ids=["forgotten", "upstream"])
def test_an_import_error_a_module_keeps_holds_its_importers_frames_unless_forgotten(tmp_path, monkeypatch,
                                                                                    keeping_no_frames):
    name = f"keeps_its_import_error_{keeping_no_frames}"
    (tmp_path / f"{name}.py").write_text(KEEPS_ITS_IMPORT_ERROR)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    run = _import_inside_a_run(name, keeping_no_frames)
    gc.collect()
    assert (run() is None) == keeping_no_frames
    module = sys.modules[name]
    assert isinstance(module.Solver.err, ImportError) and module.failed is module.Solver.err  # the error stays


def test_megatron_bridges_first_import_keeps_no_frame_of_its_caller() -> None:
    """In a fresh interpreter, where this import is megatron-bridge's first (it cannot be undone)."""
    code = textwrap.dedent("""
        import gc, weakref
        from lightning_megatron._compat import import_megatron_bridge

        class Run:
            pass

        def fit():
            run = Run()
            import_megatron_bridge()
            return weakref.ref(run)

        run = fit()
        gc.collect()
        print("freed" if run() is None else "kept")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.split()[-1:] == ["freed"], result.stderr[-2000:]
