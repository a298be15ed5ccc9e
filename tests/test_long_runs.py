"""Long runs, 2 gloo processes: asynchronous saves equal synchronous ones, a rank killed mid-save or a failed
background write leaves nothing resume would pick, and a SIGTERM stops every rank with a checkpoint and status 143
from which the run resumes bit for bit.

One module fixture runs everything that needs processes (two interrupted runs started as separate processes, then
one spawned pair that fits, resumes and fails); the tests below only read what it found.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_megatron import checkpoint as megatron_checkpoint
from lightning_megatron.callbacks.preemption import PREEMPTED_EXIT_CODE
from lightning_megatron.safe_load import load_torch_file
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import free_port, run_distributed
from tests._long_run import STEPS
from tests.test_strategy import _fit

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def fit(workdir: Path, hf_checkpoint: str, steps: int, callbacks: tuple = (), ckpt_path: str | None = None,
        **strategy_kwargs: Any) -> dict[str, Any]:
    """A 2-process data-parallel fit of the tiny model (every rank calls it)."""
    return _fit(Path(workdir), Path(hf_checkpoint), steps, devices=2, callbacks=callbacks, ckpt_path=ckpt_path,
                trainer_kwargs=dict(enable_checkpointing=True), **strategy_kwargs)


def _launch(mode: str, workdir: Path, hf_checkpoint: Path) -> list[subprocess.Popen]:
    port = str(free_port())
    workdir.mkdir(parents=True)
    return [subprocess.Popen([sys.executable, "-m", "tests._long_run", mode, str(workdir), str(hf_checkpoint),
                              str(rank), port], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=(workdir / f"rank{rank}.log").open("w"), stderr=subprocess.STDOUT,
                             start_new_session=True) for rank in range(2)]


def _wait(runs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    try:
        for run in runs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for run in runs:  # the rank left waiting for a killed peer, and dist_checkpointing's helper processes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
    return [run.returncode for run in runs]


def _killed_mid_save(workdir: Path, hf_checkpoint: Path) -> list[int | None]:
    runs = _launch("kill", workdir, hf_checkpoint)
    runs[1].wait(timeout=300)
    return _wait(runs, timeout=20)  # rank 0 then fails (or hangs) in its next collective


def _sigterm_mid_epoch(workdir: Path, hf_checkpoint: Path) -> list[int | None]:
    runs = _launch("sigterm", workdir, hf_checkpoint)
    marker, deadline = workdir / "rank1.step", time.monotonic() + 300
    while not (marker.is_file() and marker.read_text() and int(marker.read_text()) >= 2):
        assert time.monotonic() < deadline and runs[1].poll() is None, (workdir / "rank1.log").read_text()[-3000:]
        time.sleep(0.2)
    runs[1].send_signal(signal.SIGTERM)  # one rank only: the ranks must agree among themselves
    return _wait(runs, timeout=300)


class FailWritesOnRank0(pl.Callback):
    """From step 4 on, rank 0 (the one writing shards here: DP replicas are written once) cannot write a file over
    256 KiB (a full disk, as far as the writer sees): the background writer of the step-4 checkpoint fails, the
    small synchronous files still get written; the failure must reach rank 1 too."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 4 and trainer.global_rank == 0:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


class RecordStaging(pl.Callback):
    """At the start of each step and at the end of training: (step, bytes the last background save staged, the
    staging memory's size, how many times it was allocated)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int | None, int, int]] = []

    def _note(self, trainer: pl.Trainer) -> None:
        staging = trainer.strategy._saves.staging
        self.seen.append((trainer.global_step, staging.last_stage.get("bytes"), staging.capacity,
                          staging.segments_made))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._note(trainer)

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._note(trainer)


def _spawned(rank: int, world_size: int, root: str, hf_checkpoint: str, sigterm_step: int) -> dict[str, Any]:
    tmp = Path(root)
    every_2 = dict(every_n_train_steps=2, save_top_k=-1)
    sync = fit(tmp / "sync", hf_checkpoint, STEPS,
               callbacks=(pl.callbacks.ModelCheckpoint(dirpath=tmp / "sync_ckpts", **every_2),))
    # top 2 by step with `last`: step 2 is removed while step 6 is in flight, and `last` waits for step 6
    top_k = pl.callbacks.ModelCheckpoint(dirpath=tmp / "async_ckpts", every_n_train_steps=2, save_top_k=2,
                                         monitor="step", mode="max", save_last=True)
    staging = RecordStaging()
    background = fit(tmp / "async", hf_checkpoint, STEPS, callbacks=(top_k, staging), async_save=True)
    resumed = {
        "async_step4": fit(tmp / "r_async", hf_checkpoint, STEPS, async_save=True,
                           ckpt_path=str(tmp / "async_ckpts" / "epoch=0-step=4.ckpt")),
        "killed": fit(tmp / "r_killed", hf_checkpoint, STEPS, ckpt_path=str(tmp / "killed" / "ckpts" / "last.ckpt")),
        "sigterm": fit(tmp / "r_sigterm", hf_checkpoint, STEPS, ckpt_path=str(tmp / "sigterm" / "ckpts" / "last.ckpt")),
    }
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        fit(tmp / "fail", hf_checkpoint, STEPS, async_save=True,
            callbacks=(FailWritesOnRank0(), pl.callbacks.ModelCheckpoint(dirpath=tmp / "fail_ckpts", **every_2)))
        failure = None
    except megatron_checkpoint.CheckpointError as error:
        failure = str(error)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    return {
        "sync": sync["losses"], "async": background["losses"], "failure": failure, "staging": staging.seen,
        "resumed": {name: run["losses"] for name, run in resumed.items()},
        "sigterm_weights_equal": all(torch.equal(tensor, resumed["sigterm"]["weights"][name])
                                     for name, tensor in sync["weights"].items()),
        "sigterm_step": sigterm_step,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("long_runs")
    hf_checkpoint = make_tiny_checkpoint(root / "qwen3", "qwen3")
    killed = _killed_mid_save(root / "killed", hf_checkpoint)
    sigterm = _sigterm_mid_epoch(root / "sigterm", hf_checkpoint)
    last = root / "sigterm" / "ckpts" / "last.ckpt"
    assert megatron_checkpoint.is_complete(last), (root / "sigterm" / "rank0.log").read_text()[-4000:]
    sigterm_step = load_torch_file(last / "lightning.pt")["global_step"]
    results = run_distributed(_spawned, root, str(root), str(hf_checkpoint), sigterm_step)
    return {"root": root, "killed": killed, "sigterm": sigterm, "ranks": results}


def _dcp_tensors(folder: Path, out: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder / "megatron", out)
    return torch.load(out, weights_only=False)


def test_async_checkpoints_equal_the_synchronous_ones_and_resume_the_same(runs: dict[str, Any]) -> None:
    root = runs["root"]
    for result in runs["ranks"]:
        assert len(result["sync"]) == STEPS
        assert result["async"] == result["sync"]
        assert result["resumed"]["async_step4"] == result["sync"][4:]
    ckpts = root / "async_ckpts"
    # top-2 removed step 2 once step 6 was published; `last` is a full checkpoint of step 6
    assert sorted(path.name for path in ckpts.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt",
                                                             "last.ckpt"]
    for name, reference in [("epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt"), ("epoch=0-step=6.ckpt",
                            "epoch=0-step=6.ckpt"), ("last.ckpt", "epoch=0-step=6.ckpt")]:
        ours, theirs = ckpts / name, root / "sync_ckpts" / reference
        assert megatron_checkpoint.is_complete(ours)
        ours_tensors, their_tensors = _dcp_tensors(ours, root / "a.pt"), _dcp_tensors(theirs, root / "b.pt")
        assert ours_tensors.keys() == their_tensors.keys()
        for key, value in their_tensors.items():
            assert torch.equal(ours_tensors[key], value) if isinstance(value, torch.Tensor) else \
                ours_tensors[key] == value, key
        for rank in range(2):
            assert (ours / "rng" / f"rank{rank}.pt").read_bytes() == (theirs / "rng" / f"rank{rank}.pt").read_bytes()
        ours_loops = load_torch_file(ours / "lightning.pt")
        their_loops = load_torch_file(theirs / "lightning.pt")
        assert ours_loops["loops"] == their_loops["loops"] and ours_loops["global_step"] == their_loops["global_step"]


def test_background_saves_stage_into_memory_allocated_once_and_reused(runs: dict[str, Any]) -> None:
    writer, other = (result["staging"] for result in runs["ranks"])  # saves after steps 2, 4, 6 (and `last`)
    assert [step for step, *_ in writer] == [step for step, *_ in other] == [0, 1, 2, 3, 4, 5, 6]
    # rank 0 writes every shard here (DP replicas are written once); rank 1 stages and reserves nothing
    assert other == [(step, None, 0, 0) for step in range(7)]
    reserved = writer[0][2]
    assert reserved > 0 and writer[:2] == [(0, None, reserved, 1), (1, None, reserved, 1)]  # the model's, at start
    staged = {staged for _, staged, *_ in writer[2:]}
    assert len(staged) == 1 and staged.pop() > 0  # every save staged the same shards
    after_first_save = {(capacity, made) for _, _, capacity, made in writer[2:]}
    assert len(after_first_save) == 1  # allocated by then, reused by every later save
    capacity, made = after_first_save.pop()
    assert capacity >= max(reserved, writer[-1][1]) and made <= 2  # the reservation, plus the optimizer's shards


def test_a_rank_killed_during_a_background_save_leaves_only_the_previous_checkpoint(runs: dict[str, Any]) -> None:
    assert runs["killed"][1] == -signal.SIGKILL, (runs["root"] / "killed" / "rank1.log").read_text()[-3000:]
    ckpts = runs["root"] / "killed" / "ckpts"
    # step 4 was published before `last` (step 4) started; that `last` was in flight when rank 1 died: rank 0's
    # next agreement failed, named it, and removed its staging folder (had rank 0 died too, the hidden staging
    # folder would be left, which no pattern picks and `load` refuses)
    assert "saving " + str(ckpts / "last.ckpt") in (runs["root"] / "killed" / "rank0.log").read_text()
    assert sorted(path.name for path in ckpts.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                             "last.ckpt"]
    assert all(megatron_checkpoint.is_complete(path) for path in ckpts.iterdir())
    assert load_torch_file(ckpts / "last.ckpt" / "lightning.pt")["global_step"] == 2  # the previous `last`
    for result in runs["ranks"]:
        assert result["resumed"]["killed"] == result["sync"][2:]


def test_a_failed_background_write_raises_on_every_rank_naming_the_checkpoint(runs: dict[str, Any]) -> None:
    for result in runs["ranks"]:
        assert result["failure"] is not None and "epoch=0-step=4.ckpt" in result["failure"]
    ckpts = runs["root"] / "fail_ckpts"
    assert sorted(path.name for path in ckpts.iterdir()) == ["epoch=0-step=2.ckpt"]  # no staging folder either


def test_sigterm_to_one_rank_saves_exits_143_and_resumes_bit_for_bit(runs: dict[str, Any]) -> None:
    assert runs["sigterm"] == [PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE] == [143, 143], \
        (runs["root"] / "sigterm" / "rank0.log").read_text()[-3000:]
    step = runs["ranks"][0]["sigterm_step"]
    assert 2 <= step < STEPS  # mid-epoch (8 steps per epoch), after the step that was running
    for result in runs["ranks"]:
        assert result["resumed"]["sigterm"] == result["sync"][step:]
        assert result["sigterm_weights_equal"]


def test_a_one_process_fit_preempted_raises_system_exit_that_the_caller_may_catch_and_go_on(tmp_path: Path) -> None:
    """Ending the process before finalization is for the ranks of a job; a one-process fit (a notebook, a script)
    that catches the `SystemExit(143)` keeps its own exit status."""
    hf_checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    workdir = tmp_path / "one"
    workdir.mkdir()
    run = subprocess.run([sys.executable, "-m", "tests._long_run", "sigterm_one_process", str(workdir),
                          str(hf_checkpoint), "0", str(free_port())], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert (workdir / "went_on").read_text() == str(PREEMPTED_EXIT_CODE)
    assert megatron_checkpoint.is_complete(workdir / "checkpoints" / "last.ckpt")


def test_background_writers_describe_their_shards_so_publishing_reads_only_the_rest(process_group: None,
                                                                                   tmp_path: Path) -> None:
    import json
    import zlib

    staging = megatron_checkpoint.staging_folder(tmp_path / "step=1.ckpt")
    (staging / "megatron").mkdir(parents=True)
    shard = staging / "megatron" / "__0_0.distcp"
    megatron_checkpoint._write_then_describe(lambda: shard.write_bytes(b"a" * 100), staging, 0)
    (staging / "lightning.pt").write_bytes(b"x")
    shard.write_bytes(b"b" * 100)  # changed after its writer described it: publishing must not read it again
    megatron_checkpoint.publish(staging, tmp_path / "step=1.ckpt")
    published = tmp_path / "step=1.ckpt"
    manifest = json.loads((published / megatron_checkpoint.MANIFEST).read_text())["files"]
    assert manifest == {"megatron/__0_0.distcp": {"size": 100, "crc32": zlib.crc32(b"a" * 100)},
                        "lightning.pt": {"size": 1, "crc32": zlib.crc32(b"x")}}
    assert not (published / megatron_checkpoint.DESCRIBED).exists() and not staging.exists()
