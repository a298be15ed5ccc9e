import os

import pytest
import torch
import torch.distributed as dist

from tests._background import BackgroundRuns
from tests._distributed import free_port


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def early_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The collected modules' `EARLY_RUNS`, one at a time from the session's start (see tests/_background.py)."""
    modules = {item.module for item in request.session.items if hasattr(item, "module")}
    commands = {name: command for module in sorted(modules, key=lambda module: module.__name__)
                for name, command in getattr(module, "EARLY_RUNS", {}).items()}
    runs = BackgroundRuns(commands, tmp_path_factory.mktemp("early"), request.session.items, workers=1)
    try:
        yield runs
    finally:
        runs.close()


@pytest.fixture(scope="session")
def process_group() -> None:
    """A one-process gloo group with Megatron-Core made runnable here: what a single-process run sets up."""
    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)


@pytest.fixture
def model_parallel(process_group: None):
    """Megatron parallel state for one process (TP=PP=1), seeded.

    Made once and kept: Megatron never frees the process groups it creates, so a fresh state per test would leave
    thousands of gloo threads behind and slow the whole suite down.
    """
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    torch.manual_seed(1234)
