import os

import pytest
import torch
import torch.distributed as dist

from tests._background import XDIST_WORKERS, BackgroundRuns, OnDemandRuns
from tests._distributed import free_port

if XDIST_WORKERS > 1:
    # the cores shared between workers: one thread each, in the workers and in the processes they start, so that no
    # worker's OpenMP threads spin waiting for a core while another worker computes on it
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if XDIST_WORKERS > 1:
        # the modules with `EARLY_RUNS` first (xdist hands files out in this order): the worker that takes one starts
        # its long command at the session's start, as one process does, not at the end of the queue
        items.sort(key=lambda item: not getattr(getattr(item, "module", None), "EARLY_RUNS", None))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def early_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The collected modules' `EARLY_RUNS`, one at a time from the session's start; under pytest-xdist each when its
    test asks (see tests/_background.py)."""
    modules = {item.module for item in request.session.items if hasattr(item, "module")}
    commands = {name: command for module in sorted(modules, key=lambda module: module.__name__)
                for name, command in getattr(module, "EARLY_RUNS", {}).items()}
    root, items = tmp_path_factory.mktemp("early"), request.session.items
    runs = (OnDemandRuns(commands, root, items) if XDIST_WORKERS > 1
            else BackgroundRuns(commands, root, items, workers=1))
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
