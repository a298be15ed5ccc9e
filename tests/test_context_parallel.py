"""Context parallelism without Transformer Engine: fits with CP > 1 equal the CP=1 fits of the same global batches.

Each spawned process group runs the CP=1 reference (data parallelism over the same ranks) and the CP > 1 run one
after the other, through the real Lightning Trainer, MegatronStrategy, bridges, SFTModule and MTP layer, on packed
and padded rows. CP=1 over two ranks is DP=2, one microbatch each; CP=2 is DP=1 with both microbatches cut over the
two ranks: the same global batch, so every token-weighted loss and every gradient must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

from lightning_megatron._compat.context_parallel import ADJUSTMENTS as CONTEXT_PARALLEL_ADJUSTMENTS
from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.data.packing import collate_packed, pack_examples, pad_example
from lightning_megatron.data.tokenize import TokenizedExample
from lightning_megatron.hf_io import safetensors_files
from lightning_megatron.microbatch import check_microbatch
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.parameters import is_mtp_parameter
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._adam import comparable_adam_eps
from tests._distributed import run_distributed

VOCAB, ROW, STEPS, LR = 384, 32, 5, 1e-2
(MTP_TOKEN_COUNTS,) = CONTEXT_PARALLEL_ADJUSTMENTS


class SequencesDataset(Dataset):
    """Random SFT sequences of random lengths, one per padded row or first-fit packed into rows of `ROW` tokens
    (each sequence padded to a multiple of `alignment`, as SFTDataModule does for CP)."""

    def __init__(self, packed: bool, alignment: int, rows: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.packed, self.alignment, self.items = packed, alignment, []
        for _ in range(rows):
            if packed:
                lengths = [int(n) for n in torch.randint(1, ROW // 4, (3,), generator=generator)]
            else:
                lengths = [int(torch.randint(ROW // 2, ROW + 1, (1,), generator=generator))]
            self.items.append([TokenizedExample("random", torch.randint(0, VOCAB, (n,), generator=generator),
                                                torch.rand(n, generator=generator) < 0.8) for n in lengths])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.packed:
            return pack_examples(self.items[index], ROW, pad_id=0, alignment=self.alignment)
        return pad_example(self.items[index][0], ROW, pad_id=0)


class Recorder(pl.Callback):
    """Per step: the logged metrics and the MTP gradients; the weights before and after the fit."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.mtp_grads: list[dict[str, torch.Tensor]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = _parameters(pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.mtp_grads.append({name: p.main_grad.detach().clone() for name, p in _parameters(pl_module, keep=True)
                               .items() if is_mtp_parameter(name) and p.requires_grad})

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.metrics.append({key: float(value) for key, value in trainer.callback_metrics.items()})

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after = _parameters(pl_module)


def _parameters(pl_module: pl.LightningModule, keep: bool = False) -> dict[str, torch.Tensor]:
    from megatron.core.utils import unwrap_model

    return {f"{index}.{name}": (param if keep else param.detach().clone())
            for index, chunk in enumerate(pl_module.model) for name, param in unwrap_model(chunk).named_parameters()}


def _fit(workdir: Path, hf_checkpoint: str, dataset: Dataset, *, steps: int = STEPS, mtp: bool = True,
         mtp_only: bool = False, export: bool = True, **strategy_kwargs: Any) -> dict[str, Any]:
    world_size = torch.distributed.get_world_size()
    options = dict(bridge_type="megatron-bridge" if mtp else "mbridge", micro_batch_size=1, global_batch_size=2,
                   precision="fp32", use_distributed_optimizer=False) | strategy_kwargs
    strategy = MegatronStrategy(hf_checkpoint=hf_checkpoint, **options)
    recorder = Recorder()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=workdir,
                         callbacks=[recorder, *([MTPOnlyCallback()] if mtp_only else [])])
    collate = collate_packed if getattr(dataset, "packed", False) else None
    # Adam's steps Lipschitz in the gradients, which CP sums in another order: the weights stay comparable at 1e-5
    # (tests/_adam.py)
    module = SFTModule(enable_mtp=mtp, lr=LR, adam_eps=comparable_adam_eps(LR))
    trainer.fit(module, DataLoader(dataset, batch_size=1, collate_fn=collate))
    exported = strategy.export_hf(workdir / "export") if export else None
    return {"metrics": recorder.metrics, "mtp_grads": recorder.mtp_grads, "before": recorder.before,
            "after": recorder.after,
            "export": _tensors(exported) if exported and torch.distributed.get_rank() == 0 else None}


def _tensors(hf_checkpoint: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for file in safetensors_files(hf_checkpoint) for name, tensor in load_file(file).items()}


def _compare_fits(reference: dict, ours: dict, keys: tuple[str, ...], steps: int = STEPS) -> None:
    assert len(ours["metrics"]) == len(reference["metrics"]) == steps
    for step, (theirs, mine) in enumerate(zip(reference["metrics"], ours["metrics"])):
        for key in keys:
            assert mine[key] == pytest.approx(theirs[key], abs=1e-5), (step, key)
    if reference["export"] is not None:
        assert reference["export"].keys() == ours["export"].keys()
        for name, tensor in reference["export"].items():
            torch.testing.assert_close(ours["export"][name], tensor, rtol=0, atol=1e-5, msg=name)


def _joint_fits(workdir: Path, hf_checkpoint: str, alignment: int, steps: int = STEPS, **strategy_kwargs: Any
                ) -> dict:
    """Joint (MTP) fits of `steps` steps at CP 1 and 2, padded and packed: `{("joint", packed, cp): result}`."""
    results = {}
    for packed in (False, True):
        dataset = SequencesDataset(packed, alignment=alignment, rows=2 * steps)
        for cp in (1, 2):
            results["joint", packed, cp] = _fit(workdir / f"joint{packed}{cp}", hf_checkpoint, dataset, steps=steps,
                                                context_parallel_size=cp, **strategy_kwargs)
    return results


def _two_rank_fits(rank: int, world_size: int, tmp: str, checkpoints: dict[str, str]) -> dict:
    workdir = Path(tmp) / f"rank{rank}"
    results: dict[Any, Any] = _joint_fits(workdir, checkpoints["mtp"], alignment=4)
    dataset = SequencesDataset(True, alignment=4, rows=2 * STEPS)
    # without the MTP token-count adjustment each CP rank normalises by its own tokens: the MTP loss is off
    # (kept off while the fit's own prepare_megatron_core runs)
    with MTP_TOKEN_COUNTS.suspended(), mock.patch.object(MTP_TOKEN_COUNTS, "needed", lambda: False):
        results["upstream_mtp_counts"] = _fit(workdir / "upstream", checkpoints["mtp"], dataset, steps=1,
                                              export=False, context_parallel_size=2)
    packed_rows = SequencesDataset(True, alignment=4, rows=2 * STEPS, seed=1)
    for cp in (1, 2):
        results["mbridge", cp] = _fit(workdir / f"mbridge{cp}", checkpoints["plain"], packed_rows, mtp=False,
                                      context_parallel_size=cp)
        results["mtp_only", cp] = _fit(workdir / f"mtp_only{cp}", checkpoints["mtp"], packed_rows, mtp_only=True,
                                       export=False, steps=2, context_parallel_size=cp)
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cp_checkpoints")
    return {"plain": str(make_tiny_checkpoint(root / "qwen3", "qwen3")),
            "mtp": str(make_tiny_checkpoint(root / "qwen3_mtp", "qwen3", mtp=True))}


@pytest.mark.slow
def test_context_parallel_2_equals_cp1_packed_and_padded_both_bridges_and_mtp_only(checkpoints, tmp_path):
    ranks = run_distributed(_two_rank_fits, tmp_path, str(tmp_path), checkpoints)
    results = ranks[0]
    for packed in (False, True):
        _compare_fits(results["joint", packed, 1], results["joint", packed, 2], ("lm_loss", "mtp_loss"))
    _compare_fits(results["mbridge", 1], results["mbridge", 2], ("lm_loss",))
    upstream, reference = results["upstream_mtp_counts"]["metrics"][0], results["joint", True, 1]["metrics"][0]
    assert upstream["lm_loss"] == pytest.approx(reference["lm_loss"], abs=1e-5)
    assert abs(upstream["mtp_loss"] - reference["mtp_loss"]) > 0.1
    reference, ours = results["mtp_only", 1], results["mtp_only", 2]
    for name, before in ours["before"].items():
        if not is_mtp_parameter(name):
            assert torch.equal(ours["after"][name], before), name
    assert ours["mtp_grads"] and ours["mtp_grads"][0]
    for step, grads in enumerate(ours["mtp_grads"]):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference["mtp_grads"][step][name], rtol=0, atol=1e-5,
                                       msg=f"step {step} {name}")
    assert ranks[1]["joint", True, 2]["metrics"] == results["joint", True, 2]["metrics"]  # every rank logs the same


def _validate(workdir: Path, hf_checkpoint: str, dataset: Dataset, **strategy_kwargs: Any) -> tuple[float, float]:
    """`val_lm_loss` and `val_mtp_acceptance` of one global batch of 4 rows through the forward-only schedule."""
    strategy = MegatronStrategy(hf_checkpoint=hf_checkpoint, bridge_type="megatron-bridge", micro_batch_size=1,
                                global_batch_size=4, precision="fp32", **strategy_kwargs)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size(),
                         logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=workdir,
                         limit_val_batches=1)
    trainer.validate(SFTModule(enable_mtp=True), DataLoader(dataset, batch_size=1, collate_fn=collate_packed))
    return float(trainer.callback_metrics["val_lm_loss"]), float(trainer.callback_metrics["val_mtp_acceptance"])


def _four_rank_fits(rank: int, world_size: int, tmp: str, checkpoints: dict[str, str]) -> dict:
    workdir = Path(tmp) / f"rank{rank}"
    results: dict[Any, Any] = _joint_fits(workdir, checkpoints["mtp"], alignment=8, tensor_model_parallel_size=2)
    rows = SequencesDataset(True, alignment=8, rows=4, seed=2)
    for cp in (1, 4):
        results["validate", cp] = _validate(workdir / f"validate{cp}", checkpoints["mtp"], rows,
                                            context_parallel_size=cp)
    return results


@pytest.mark.slow
def test_tp2_x_cp2_fits_and_cp4_forward_equal_cp1(checkpoints, tmp_path):
    results = run_distributed(_four_rank_fits, tmp_path, str(tmp_path), checkpoints, world_size=4)[0]
    for packed in (False, True):
        _compare_fits(results["joint", packed, 1], results["joint", packed, 2], ("lm_loss", "mtp_loss"))
    assert results["validate", 4] == pytest.approx(results["validate", 1], abs=1e-5)  # loss and MTP acceptance


def _packed_microbatch(cu_seqlens: list[int], length: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(1, length, dtype=torch.long), "labels": torch.zeros(1, length, dtype=torch.long),
            "loss_mask": torch.ones(1, length), "position_ids": torch.arange(length)[None],
            "cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.int32)}


@pytest.mark.parametrize(("microbatch", "cp_size", "message"), [
    (_packed_microbatch([0, 8, 12], 16), 1, "cu_seqlens: ends at 12 but the row has 16 tokens"),
    (_packed_microbatch([0, 6, 16], 16), 2, "cu_seqlens: sequence lengths \\[6, 10\\] are not multiples of "
                                            "2 x context_parallel_size = 4; pad every packed sequence"),
    (_packed_microbatch([0, 4, 16], 16), 2, None),
    ({key: value for key, value in _packed_microbatch([0, 16], 18).items() if key != "cu_seqlens"}, 4,
     "seq_length: 18 is not a multiple of 2 x context_parallel_size = 8"),
    ({key: value for key, value in _packed_microbatch([0, 8], 8).items() if key != "cu_seqlens"}
     | {"subtree_end": torch.tensor([[8, 8, 8, 3, 8, 8, 8, 8]])}, 1, "subtree_end: every entry must satisfy"),
    ({key: value for key, value in _packed_microbatch([0, 8], 8).items() if key != "cu_seqlens"}
     | {"subtree_end": torch.full((1, 8), 8)}, 2, "subtree_end: tree rows need context_parallel_size: 1"),
], ids=["cu_seqlens_end", "cp_divisibility_packed", "valid", "cp_divisibility_rows", "subtree_end", "tree_cp"])
def test_bad_layouts_name_the_field_and_the_fix(microbatch, cp_size, message):
    if message is None:
        check_microbatch(microbatch, cp_size)
        return
    with pytest.raises(ValueError, match=message):
        check_microbatch(microbatch, cp_size)


def test_rows_sequence_parallelism_cannot_split_name_seq_length():
    """Megatron-Core's sequence-parallel scatter only asserts; a row of 18 tokens at TP=4 (or 12 at CP=2 x TP=4) is
    named with the multiple it needs."""
    rows = {key: value for key, value in _packed_microbatch([0, 18], 18).items() if key != "cu_seqlens"}
    with pytest.raises(ValueError, match="seq_length: 18: sequence_parallel splits the tokens over "
                                         "tensor_model_parallel_size = 4 ranks; use a seq_length that is a multiple "
                                         "of 4, or sequence_parallel: false"):
        check_microbatch(rows, 1, 4)
    with pytest.raises(ValueError, match=r"seq_length: 12: .* of each context-parallel rank .*multiple of 8"):
        check_microbatch(_packed_microbatch([0, 4, 12], 12), 2, 4)
    check_microbatch(_packed_microbatch([0, 4, 16], 16), 2, 4)


class BadRows(Dataset):
    """Packed rows whose cu_seqlens stop short of the row."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[0] if key != "cu_seqlens" else value
                for key, value in _packed_microbatch([0, 8, 12], 16).items()}


def test_bad_input_fails_before_the_first_step(process_group, checkpoints, tmp_path):
    with pytest.raises(ValueError, match="context_parallel_size > 1 needs attention_backend: sdpa or auto"):
        MegatronStrategy(hf_checkpoint=checkpoints["plain"], context_parallel_size=2, attention_backend="local")
    trainer_options = dict(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    strategy = MegatronStrategy(hf_checkpoint=checkpoints["plain"], context_parallel_size=2)
    with pytest.raises(ValueError, match="world size 1 is not a multiple of .* context_parallel_size 2"):
        pl.Trainer(strategy=strategy, **trainer_options).fit(SFTModule(), DataLoader(BadRows()))

    strategy = MegatronStrategy(hf_checkpoint=checkpoints["plain"], precision="fp32")
    recorder = Recorder()
    trainer = pl.Trainer(strategy=strategy, callbacks=[recorder], **trainer_options)
    with pytest.raises(ValueError, match="cu_seqlens: ends at 12 but the row has 16 tokens"):
        trainer.fit(SFTModule(), DataLoader(BadRows(), batch_size=1, collate_fn=collate_packed))
    assert trainer.global_step == 0 and recorder.mtp_grads == []  # no optimizer step ran
