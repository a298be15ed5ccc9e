"""A training step through Lightning makes the host wait for the device no more often than the plain Megatron-Core
loop does (issue 41: Lightning / plain <= 1.01x; host-bound steps pay for every wait).

On the CPU nothing waits, so `HostSyncs` counts the calls that would wait on a CUDA device, each by the code that
made it: a host read of a tensor the step computed (`item`, `tolist`, `bool`/`int`/`float`/`index`, `numpy`, `cpu`)
and a tensor made from Python numbers straight on the training device (`torch.tensor(data, device=...)`: a copy from
pageable memory that synchronises). Tensors the DataLoader made are host data: reading them waits for nothing, and
their copy to the training device (Lightning's `non_blocking` copy, from page-locked memory on a CUDA run:
`GlobalBatches`' `HostWork`) is simulated by a new tensor, so that the step's own reads of them count.
Not counted: `.to("cpu")` of a device tensor, which the CPU cannot tell from a copy to the training device (the
training path has none: `.cpu()` is counted, and `moe.py`'s was the last).
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from bench.megatron_loop import LoopConfig
from bench.megatron_loop import run as run_reference_loop
from lightning_megatron.data.packing import collate_packed, pack_examples
from lightning_megatron.data.tokenize import TokenizedExample
from lightning_megatron.module import SFTModule
from lightning_megatron.schedule import GlobalBatches, HostCheckedBatch, HostWork
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

SEQ, VOCAB, ROWS, STEPS = 64, 384, 2, 3
COUNTED_STEP = 1  # steady state: the first step makes what later steps reuse; none of the three is logged
ROOT = Path(__file__).resolve().parents[1]
GRAD_NORM = "megatron/core/optimizer/clip_grads.py:get_grad_norm_fp32"  # Megatron-Core's gradient norm read
READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu)


class HostSyncs(TorchFunctionMode):
    """Per call site (file and function), the calls of the current window that would wait for a CUDA device."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.sites: collections.Counter[str] = collections.Counter()
        self._host_data: dict[int, torch.Tensor] = {}  # by id, kept alive so that no id is reused

    def host_data(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Mark the tensors of a collated microbatch as the DataLoader's (host memory)."""
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                self._host_data[id(value)] = value
        return batch

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and id(args[0]) in self._host_data:
            return args[0].clone()  # the copy to the device: a new (device) tensor
        if self.counting and self._waits(func, args, kwargs):
            self.sites[_caller()] += 1
        return func(*args, **kwargs)

    def _waits(self, func: Any, args: tuple, kwargs: dict) -> bool:
        if func in READS:
            return id(args[0]) not in self._host_data
        if func in (torch.tensor, torch.as_tensor):
            return not isinstance(args[0], torch.Tensor) and kwargs.get("device") is not None
        return False


def _caller() -> str:
    """The innermost frame outside this file, `path/to/file.py:function`: from site-packages (also a virtual
    environment inside the repository, as `make` builds it) or else the repository."""
    frame = next(frame for frame in reversed(traceback.extract_stack()) if frame.filename != __file__)
    path = Path(frame.filename)
    parts = path.parts[path.parts.index("site-packages") + 1:] if "site-packages" in path.parts else \
        path.relative_to(ROOT).parts if path.is_relative_to(ROOT) else path.parts[-2:]
    return f"{'/'.join(parts)}:{frame.name}"


class CountOneStep(pl.Callback):
    """Counts from the end of the step before `COUNTED_STEP` to its end: its batch's fetch and copy, the step, the
    optimizer step, every hook and the logger connector."""

    def __init__(self, syncs: HostSyncs) -> None:
        self.syncs = syncs

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.syncs.counting = trainer.global_step == COUNTED_STEP


def _packed_rows() -> list[dict[str, Any]]:
    """Packed rows of SFT-like sequences (a 2-token prompt, then the response) as the data module packs them."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(ROWS):
        examples = []
        for length in torch.randint(6, 20, (4,), generator=generator).tolist():
            response = torch.arange(length) >= 2
            examples.append(TokenizedExample("rows:0", torch.randint(1, VOCAB, (length,), generator=generator),
                                             response))
        rows.append(pack_examples(examples, SEQ, pad_id=0))
    return rows


def _collate(syncs: HostSyncs):
    """`collate_packed`, its samples (the dataset's) and its microbatch marked as host data."""
    return lambda samples: syncs.host_data(collate_packed([syncs.host_data(sample) for sample in samples]))


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("host_syncs") / "qwen3_mtp", "qwen3", mtp=True)


def _lightning_step(checkpoint: Path, rows: list[dict[str, Any]], root: Path) -> collections.Counter[str]:
    syncs = HostSyncs()
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", micro_batch_size=1,
                                global_batch_size=ROWS, precision="fp32")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, log_every_n_steps=50, callbacks=[CountOneStep(syncs)])
    loader = DataLoader(rows * STEPS, batch_size=1, collate_fn=_collate(syncs))
    with syncs:
        trainer.fit(SFTModule(enable_mtp=True, lr=1e-3), loader)
    return syncs.sites


def _plain_step(checkpoint: Path, rows: list[dict[str, Any]]) -> collections.Counter[str]:
    syncs = HostSyncs()

    def count(step: int) -> _Window:
        return _Window(syncs, step == COUNTED_STEP)

    config = LoopConfig(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", micro_batch_size=1,
                        global_batch_size=ROWS, lr=1e-3, steps=STEPS, mtp=True, shuffle=False)
    with syncs:
        run_reference_loop(config, rows * STEPS, collate_fn=_collate(syncs), step_context=count)
    return syncs.sites


class _Window:
    """The plain loop's step context: counting during the counted step's body."""

    def __init__(self, syncs: HostSyncs, counted: bool) -> None:
        self.syncs, self.counted = syncs, counted

    def __enter__(self) -> None:
        self.syncs.counting = self.counted

    def __exit__(self, *exc: Any) -> None:
        self.syncs.counting = False


def test_a_joint_mtp_step_waits_for_the_device_no_more_than_the_plain_loop(process_group, mtp_checkpoint, tmp_path):
    """Joint SFT + MTP on packed rows, a step whose metrics are not logged: every wait left is one the plain loop
    makes at the same place, none is Lightning's or this package's own.

    What remains (per step, in both): Megatron-Core's gradient norm (`get_grad_norm_fp32`'s `.item()`: its
    clipping branches on it on the host), torch's CPU Adam reading its step counts (`_get_value`; host tensors on a
    GPU too) and the CPU attention path's membership check (`dense_output_scale`; the GPU takes flex_attention). The
    plain loop also reads its loss and MTP loss every step (`float(...)`), which Lightning leaves on the device
    until it logs them. Before this test the step also read `cu_seqlens` of every microbatch (`check_microbatch`),
    the untrained MTP depths (`tolist`), and made tensors on the device from `mtp_depth_weights`, `grad_norm` and
    `lr` (Lightning's `self.log` of a Python number)."""
    rows = _packed_rows()
    lightning = _lightning_step(mtp_checkpoint, rows, tmp_path)
    plain = _plain_step(mtp_checkpoint, rows)
    print(f"per step: Lightning {dict(lightning)}, plain {dict(plain)}")
    assert lightning - plain == collections.Counter(), (lightning, plain)
    assert sum(lightning.values()) < sum(plain.values())
    own = {site for site in lightning if site.startswith(("lightning_megatron/", "lightning/"))}
    assert own == {"lightning_megatron/attention_layout.py:dense_output_scale"}, own  # the CPU attention path's
    assert lightning[GRAD_NORM] == 1 == plain[GRAD_NORM]


def test_global_batches_check_on_the_host_and_run_schedule_trusts_them(process_group):
    """A bad packed row fails in the DataLoader's iteration, before any device copy; a good one comes as a
    `HostCheckedBatch`, a type Lightning's batch copy keeps."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    good = _packed_rows()
    bad = dict(good[0], cu_seqlens=good[0]["cu_seqlens"].flip(0))
    host = HostWork(context_parallel_size=1, sequence_parallel_size=1)
    batches = list(GlobalBatches(DataLoader(good, batch_size=1, collate_fn=collate_packed), ROWS, host=host))
    assert len(batches) == 1 and isinstance(batches[0], HostCheckedBatch)
    assert isinstance(move_data_to_device(batches[0], torch.device("cpu")), HostCheckedBatch)
    leaves, spec = torch.utils._pytree.tree_flatten(batches[0])  # a callback mapping over the batch sees its tensors
    assert [leaf for leaf in leaves if torch.is_tensor(leaf)] == [value for microbatch in batches[0]
                                                                  for value in microbatch.values()
                                                                  if torch.is_tensor(value)] != []
    assert isinstance(torch.utils._pytree.tree_unflatten(leaves, spec), HostCheckedBatch)
    unchecked = list(GlobalBatches(DataLoader(good, batch_size=1, collate_fn=collate_packed), ROWS))
    assert type(unchecked[0]) is list
    with pytest.raises(ValueError, match="cu_seqlens: must"):
        list(GlobalBatches(DataLoader([bad, *good[1:]], batch_size=1, collate_fn=collate_packed), ROWS, host=host))


@pytest.mark.gpu
def test_global_batches_pin_host_tensors_for_a_cuda_run():
    """Lightning copies a batch to a CUDA device with `non_blocking=True`: from page-locked memory that copy does not
    make the host wait."""
    rows = _packed_rows()
    host = HostWork(context_parallel_size=1, sequence_parallel_size=1, pin=True)
    (batch,) = GlobalBatches(DataLoader(rows, batch_size=1, collate_fn=collate_packed), ROWS, host=host)
    for microbatch, row in zip(batch, rows, strict=True):
        assert all(value.is_pinned() for value in microbatch.values() if isinstance(value, torch.Tensor))
        assert microbatch["max_seqlen"] == int(row["max_seqlen"])
        assert torch.equal(microbatch["cu_seqlens"], row["cu_seqlens"])
