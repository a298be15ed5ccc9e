"""The tests' preloaded server (`lightning_megatron.recipes.preloaded`, where its design is): the libraries the
benchmarks import, once per test module, so that a module of a dozen tiny benchmark commands does not spend most of
its time importing them (~9 s of one core each)."""

from __future__ import annotations

from pathlib import Path

from lightning_megatron.recipes.preloaded import Preloaded

# what the benchmarks import before megatron-bridge (`bench.common.import_megatron_bridge_first`, which the server
# imports after these), not the modules they run as `__main__`: runpy would run a second copy of one imported here
PRELOAD = ("lightning.pytorch", "transformers", "lightning_megatron.strategy", "lightning_megatron.module",
           "lightning_megatron.callbacks", "bench.common", "bench.flops")


def preloaded_server(folder: Path, env: dict[str, str], cwd: Path) -> Preloaded:
    """The server for one module's commands, started at once; `run` waits for its imports the first time."""
    return Preloaded(folder, env, cwd, modules=PRELOAD)
