"""The self-distillation MTP loss (`mtp_loss_type: self_distill`): its loss and MTP gradients equal a direct fp32
computation on whole rows at 1 process and at TP=2 (sequence parallel), PP=2 and CP=2, padded and packed, for the
Qwen3-MTP and MiMo families; as its temperature goes to 0 it is the hard-label loss on the model's own greedy text.

The direct computation: the main and MTP hidden states of the model's own forward, full-vocabulary logits from its
output layer, the teacher at `t + 1` by plain indexing within each sequence, `F.kl_div` in fp32, and Megatron-Core's
weighting of microbatches (with `calculate_per_token_loss`, which the strategy sets: microbatch `m` weighs
`scale * tokens_m / (mtp_tokens_m * sum_m tokens_m)`, `tokens_m` its loss-mask tokens, `mtp_tokens_m` those left after
the MTP roll). Gradients by autograd.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.data.packing import collate_packed
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.parameters import is_mtp_parameter
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_distributed
from tests.mtp._helpers import block_logits
from tests.test_context_parallel import SequencesDataset

SCALE, TEMPERATURE = 0.5, 0.7
FAMILIES = ("qwen3", "mimo")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("self_distill_checkpoints")
    return {family: str(make_tiny_checkpoint(root / family, family, mtp=True)) for family in FAMILIES}


def _batches(dataset: Dataset) -> list[dict[str, torch.Tensor]]:
    """The first global batch (2 rows, one per microbatch) as the strategy's sampler (shuffled, seed 0, one
    data-parallel rank in every layout here) hands it out."""
    collate = collate_packed if getattr(dataset, "packed", False) else torch.utils.data.default_collate
    indices = list(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))[:2]
    return [collate([dataset[index]]) for index in indices]


def _serving_weights(main_logits: torch.Tensor, input_ids: torch.Tensor, weighting: str) -> torch.Tensor:
    """`[b, s - 1]`: at t, how the main head at t would feed token t + 1 (greedy: its argmax; sampled: its
    probability), from full-vocabulary fp32 logits."""
    logits, chosen = main_logits[:, :-1], input_ids[:, 1:].unsqueeze(-1)
    if weighting == "greedy":
        return (logits.gather(-1, chosen).squeeze(-1) >= logits.max(dim=-1).values).float()
    return torch.softmax(logits, dim=-1).gather(-1, chosen).squeeze(-1)


def head_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP head's and the (detached) main head's whole-vocabulary fp32 logits `[b, s, V]` of the model's own
    forward on `batch`."""
    from lightning_megatron.microbatch import model_inputs

    captured = {}
    hook = model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output))
    model(**model_inputs(batch))
    hook.remove()
    main_hidden, mtp_hidden = captured["hidden"].chunk(2, dim=0)
    tied = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    mtp_logits = model.output_layer(mtp_hidden, weight=tied)[0].transpose(0, 1).float()
    with torch.no_grad():
        main_logits = model.output_layer(main_hidden.detach(), weight=tied)[0].transpose(0, 1).float()
    return mtp_logits, main_logits


def _direct(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
            weighting: str = "uniform") -> tuple[float, dict[str, torch.Tensor], list[torch.Tensor]]:
    """(logged `mtp_loss`, MTP gradients, the serving weights of the trained positions) of the self-distillation
    loss computed directly on whole rows."""

    terms, logged, total_tokens, weights = [], [], 0.0, []
    for batch in batches:
        mtp_logits, main_logits = head_logits(model, batch)  # [b, s, V]
        mask = batch["loss_mask"].float()
        seq = mask.size(1)
        ends = batch["cu_seqlens"][1:].tolist() if "cu_seqlens" in batch else [seq]
        same_sequence = torch.ones(seq - 1, dtype=torch.bool)
        same_sequence[[end - 1 for end in ends if 0 < end <= seq - 1]] = False  # t + 1 starts the next sequence
        mtp_mask = torch.zeros_like(mask)
        mtp_mask[:, :-1] = mask[:, 1:] * same_sequence
        log_q = F.log_softmax(mtp_logits[:, :-1], dim=-1)
        log_p = F.log_softmax(main_logits[:, 1:] / TEMPERATURE, dim=-1)
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
        if weighting != "uniform":
            weight = _serving_weights(main_logits, batch["input_ids"], weighting)
            kl = kl * weight
            weights.append(weight[mtp_mask[:, :-1].bool()])
        loss_sum = (kl * mtp_mask[:, :-1]).sum()
        terms.append((loss_sum, mask.sum(), mtp_mask.sum()))
        logged.append(float(loss_sum / mtp_mask.sum()))
        total_tokens += float(mask.sum())
    objective = sum(SCALE * tokens / mtp_tokens * loss_sum for loss_sum, tokens, mtp_tokens in terms) / total_tokens
    names, parameters = zip(*[(f"0.{name}", p) for name, p in model.named_parameters() if is_mtp_parameter(name)])
    return sum(logged) / len(logged), dict(zip(names, torch.autograd.grad(objective, parameters))), weights


class Direct(pl.Callback):
    """The direct computation on the model about to be trained (1 process only), before its first step."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], weighting: str = "uniform") -> None:
        self.batches, self.weighting = batches, weighting

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
        from megatron.core.utils import unwrap_model

        self.mtp_loss, self.gradients, self.weights = _direct(unwrap_model(pl_module.model[0]), self.batches,
                                                              self.weighting)
        MTPLossLoggingHelper.clean_metrics_in_tracker()  # that forward is not a training step's


class Gradients(pl.Callback):
    """The first step's MTP gradients as whole (TP-gathered) tensors, and its logged metrics."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from megatron.core.utils import unwrap_model

        if not hasattr(self, "gradients"):
            model = unwrap_model(pl_module.model[0])
            self.gradients = {f"0.{name}": _whole(name, p, p.main_grad.detach().clone(),
                                                  model.config.gated_linear_unit)
                              for name, p in model.named_parameters() if is_mtp_parameter(name) and p.requires_grad}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not hasattr(self, "metrics"):
            self.metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}


def _whole(name: str, parameter: torch.Tensor, gradient: torch.Tensor, gated: bool) -> torch.Tensor:
    """A tensor-parallel parameter's gradient gathered over TP into the TP=1 layout (a gated fc1 shard is
    `[gate_r; up_r]`, so gates and ups are gathered apart)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(parameter, "tensor_model_parallel", False):
        return gradient
    dim = parameter.partition_dim
    parts = [torch.empty_like(gradient) for _ in range(tp)]
    torch.distributed.all_gather(parts, gradient.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    if gated and name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(part.chunk(2, dim=dim) for part in parts))
        return torch.cat([*gates, *ups], dim=dim)
    return torch.cat(parts, dim=dim)


def _fit(workdir: Path, hf_checkpoint: str, dataset: Dataset, *, mtp_only: bool = True, callbacks: tuple = (),
         module_kwargs: dict | None = None, **strategy_kwargs: Any) -> Gradients:
    world_size = torch.distributed.get_world_size()
    options = dict(bridge_type="megatron-bridge", micro_batch_size=1, global_batch_size=2, precision="fp32",
                   use_distributed_optimizer=False, trust_remote_code=True) | strategy_kwargs
    gradients = Gradients()
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=hf_checkpoint, **options), accelerator="cpu",
                         devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=workdir,
                         callbacks=[gradients, *callbacks, *([MTPOnlyCallback()] if mtp_only else [])])
    module = SFTModule(**(dict(enable_mtp=True, mtp_detach_heads=mtp_only, mtp_loss_scaling_factor=SCALE,
                               mtp_loss_type="self_distill", mtp_distill_temperature=TEMPERATURE)
                          | (module_kwargs or {})))
    collate = collate_packed if getattr(dataset, "packed", False) else None
    trainer.fit(module, DataLoader(dataset, batch_size=1, collate_fn=collate))
    return gradients


def _assert_equal(ours: Gradients, direct: Direct) -> None:
    assert ours.gradients.keys() == direct.gradients.keys()
    for name, gradient in direct.gradients.items():
        torch.testing.assert_close(ours.gradients[name], gradient, rtol=0, atol=1e-6, msg=name)
    assert max(float(g.abs().max()) for g in direct.gradients.values()) > 1e-4  # not a comparison of zeros
    assert ours.metrics["mtp_loss"] == pytest.approx(direct.mtp_loss, rel=0, abs=1e-6)


@pytest.mark.parametrize(("family", "packed", "mtp_only"), [("qwen3", False, True), ("qwen3", True, False),
                                                           ("mimo", False, False), ("mimo", True, True)],
                         ids=["qwen3-padded-mtp_only", "qwen3-packed-joint", "mimo-padded-joint",
                              "mimo-packed-mtp_only"])
def test_self_distillation_equals_the_direct_computation_at_one_process(process_group, checkpoints, tmp_path, family,
                                                                        packed, mtp_only):
    dataset = SequencesDataset(packed, alignment=4, rows=4)
    direct = Direct(_batches(dataset))
    _assert_equal(_fit(tmp_path, checkpoints[family], dataset, mtp_only=mtp_only, callbacks=(direct,)), direct)


VALIDATED = ("tp2_sp", "cp2_packed")  # validation metrics, against one process
LAYOUTS = {"tp2_sp": (False, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
           "pp2": (False, dict(pipeline_model_parallel_size=2)),
           "cp2": (False, dict(context_parallel_size=2)),
           "cp2_packed": (True, dict(context_parallel_size=2))}


def _parallel_fits(rank: int, world_size: int, tmp: str, checkpoints: dict[str, str]) -> dict:
    results = {}
    for family in FAMILIES:
        for layout, (packed, parallel) in LAYOUTS.items():
            fit = _fit(Path(tmp) / f"rank{rank}" / family / layout, checkpoints[family],
                       SequencesDataset(packed, alignment=4, rows=4), **parallel)
            results[family, layout] = (getattr(fit, "gradients", {}), fit.metrics)
            if layout in VALIDATED:
                results[family, layout, "validate"] = _validate(Path(tmp) / f"rank{rank}" / family / f"v{layout}",
                                                                checkpoints[family],
                                                                SequencesDataset(packed, alignment=4, rows=4),
                                                                **parallel)
    for weighting, dataset in WEIGHTED.items():
        for layout in WEIGHTED_LAYOUTS:
            fit = _fit(Path(tmp) / f"rank{rank}" / weighting / layout, checkpoints["qwen3"],
                       dataset(checkpoints["qwen3"]), module_kwargs={"mtp_distill_weighting": weighting},
                       **LAYOUTS[layout][1])
            results[weighting, layout] = (fit.gradients, fit.metrics)
    return results


@pytest.mark.slow
def test_self_distillation_equals_the_direct_computation_under_tp_pp_cp_and_packing(process_group, checkpoints,
                                                                                    tmp_path):
    """One spawned pair of processes runs every layout of both families (MTP-only, the chunked path), and the
    serving-weighted loss (`mtp_distill_weighting`) under TP=2 and CP=2; each is compared with the direct
    computation on the same checkpoint and batch at one process. Validation under TP and CP with packing logs the
    same greedy and sampled acceptance as one process."""
    ranks = run_distributed(_parallel_fits, tmp_path, str(tmp_path), checkpoints)
    for family in FAMILIES:
        for layout in VALIDATED:
            one_process = _validate(tmp_path / f"v_{family}_{layout}", checkpoints[family],
                                    SequencesDataset(LAYOUTS[layout][0], alignment=4, rows=4))
            for results in ranks:
                assert results[family, layout, "validate"] == pytest.approx(one_process, abs=1e-5)
    for family in FAMILIES:
        for packed in (False, True):
            dataset = SequencesDataset(packed, alignment=4, rows=4)
            direct = Direct(_batches(dataset))
            _fit(tmp_path / f"direct_{family}_{packed}", checkpoints[family], dataset, callbacks=(direct,))
            for layout, (layout_packed, _) in LAYOUTS.items():
                if layout_packed != packed:
                    continue
                for rank, results in enumerate(ranks):
                    gradients, metrics = results[family, layout]
                    if layout == "pp2" and rank == 0:
                        assert gradients == {}  # the first stage holds no MTP layer
                        continue
                    ours = Gradients()
                    ours.gradients, ours.metrics = gradients, metrics
                    _assert_equal(ours, direct)
    for weighting, dataset in WEIGHTED.items():
        batches = dataset(checkpoints["qwen3"])
        direct = Direct(_batches(batches), weighting)
        _fit(tmp_path / f"direct_{weighting}", checkpoints["qwen3"], batches, callbacks=(direct,),
             module_kwargs={"mtp_distill_weighting": weighting})
        for layout in WEIGHTED_LAYOUTS:
            for results in ranks:
                ours = Gradients()
                ours.gradients, ours.metrics = results[weighting, layout]
                _assert_equal(ours, direct)


class GreedyTextDataset(Dataset):
    """The model's own greedy continuations (24 tokens) of random 8-token prompts, the loss on the continuation;
    with `changed_every`, every that many continuation tokens one is replaced (not the model's choice there)."""

    def __init__(self, hf_checkpoint: str, rows: int = 4, changed_every: int = 0) -> None:
        from lightning_megatron.speculative import greedy_decode, load_target

        target = load_target(hf_checkpoint)
        generator = torch.Generator().manual_seed(0)
        self.rows = []
        for _ in range(rows):
            prompt = torch.randint(0, 384, (8,), generator=generator).tolist()
            sequence = torch.tensor(prompt + greedy_decode(target, prompt, 25, set()).tokens)
            if changed_every:
                sequence[8::changed_every] = (sequence[8::changed_every] + 1) % 384
            loss_mask = torch.zeros(32)
            loss_mask[7:] = 1  # labels 7.. are the continuation's tokens
            self.rows.append({"input_ids": sequence[:-1], "labels": sequence[1:], "loss_mask": loss_mask,
                              "position_ids": torch.arange(32)})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


@pytest.mark.parametrize("family", FAMILIES)
def test_temperature_to_zero_is_the_hard_label_loss_on_the_models_own_greedy_text(process_group, checkpoints,
                                                                                   tmp_path, family):
    """On the model's own greedy text the main head's argmax at t + 1 is the label at t + 1, so a teacher sharpened
    to T = 1e-6 is that label: loss and MTP gradients are the hard-label ones; at T = 1 they are not."""
    dataset = GreedyTextDataset(checkpoints[family])
    runs = {name: _fit(tmp_path / name, checkpoints[family], dataset, module_kwargs=kwargs)
            for name, kwargs in {"labels": {"mtp_loss_type": "labels", "mtp_distill_temperature": 1.0},
                                 "cold": {"mtp_distill_temperature": 1e-6},
                                 "warm": {"mtp_distill_temperature": 1.0}}.items()}
    labels, cold, warm = runs["labels"], runs["cold"], runs["warm"]
    assert cold.metrics["mtp_loss"] == pytest.approx(labels.metrics["mtp_loss"], rel=0, abs=1e-6)
    assert warm.metrics["mtp_loss"] < labels.metrics["mtp_loss"] - 0.1
    for name, gradient in labels.gradients.items():
        torch.testing.assert_close(cold.gradients[name], gradient, rtol=0, atol=1e-6, msg=name)
    assert max(float((warm.gradients[name] - gradient).abs().max()) for name, gradient in labels.gradients.items()) > 1e-3


WEIGHTED = {"greedy": lambda checkpoint: GreedyTextDataset(checkpoint, changed_every=3),
            "sampled": lambda checkpoint: SequencesDataset(True, alignment=4, rows=4)}  # packed
WEIGHTED_LAYOUTS = ("tp2_sp", "cp2")


@pytest.mark.parametrize("weighting", list(WEIGHTED))
def test_serving_weighted_self_distillation_equals_the_direct_computation(process_group, checkpoints, tmp_path,
                                                                          weighting):
    """`mtp_distill_weighting`: each position's KL times how a server feeds it token t + 1 (greedy: 1 where it is
    the main head's argmax at t, on greedy text with every third token changed so that both occur; sampled: its
    probability, on packed rows), loss and gradients as the direct computation's."""
    dataset = WEIGHTED[weighting](checkpoints["qwen3"])
    direct = Direct(_batches(dataset), weighting)
    ours = _fit(tmp_path, checkpoints["qwen3"], dataset, callbacks=(direct,),
                module_kwargs={"mtp_distill_weighting": weighting})
    _assert_equal(ours, direct)
    weights = torch.cat(direct.weights)
    assert 0.1 < float(weights.mean()) < 0.9 if weighting == "greedy" else 0 < float(weights.min())
    uniform = _fit(tmp_path / "uniform", checkpoints["qwen3"], dataset)
    assert abs(uniform.metrics["mtp_loss"] - ours.metrics["mtp_loss"]) > 1e-3


def _direct_sampled_acceptance(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Pooled `sum_x min(p, q)` at temperature 1 over the positions whose next-but-one token is trained and in the
    same sequence, from fresh full-vocabulary logits of the model's own hidden states."""
    total = count = 0.0
    for batch in batches:
        main, mtp = block_logits(model, batch)
        seq = main.size(1)
        ends = {end - 1 for end in (batch["cu_seqlens"][1:].tolist() if "cu_seqlens" in batch else [seq])}
        for b in range(main.size(0)):
            for t in range(seq - 1):
                if t in ends or not batch["loss_mask"][b, t + 1]:
                    continue
                total += float(torch.minimum(torch.softmax(main[b, t + 1], -1), torch.softmax(mtp[b, t], -1)).sum())
                count += 1
    return total / count


class DirectSampledAcceptance(pl.Callback):
    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        self.value = _direct_sampled_acceptance(unwrap_model(pl_module.model[0]), self.batches)


def _validate(workdir: Path, hf_checkpoint: str, dataset: Dataset, callbacks: tuple = (),
              **strategy_kwargs: Any) -> dict[str, float]:
    """`val_mtp_sampled_acceptance` and `val_mtp_acceptance` over the first two rows, in order."""
    options = dict(bridge_type="megatron-bridge", micro_batch_size=1, global_batch_size=2, precision="fp32",
                   trust_remote_code=True) | strategy_kwargs
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=hf_checkpoint, **options), accelerator="cpu",
                         devices=torch.distributed.get_world_size(), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=1, default_root_dir=workdir,
                         callbacks=list(callbacks))
    collate = collate_packed if getattr(dataset, "packed", False) else None
    trainer.validate(SFTModule(enable_mtp=True), DataLoader(dataset, batch_size=1, collate_fn=collate))
    return {key: float(trainer.callback_metrics[key]) for key in ("val_mtp_sampled_acceptance", "val_mtp_acceptance")}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sampled_acceptance_in_validation_equals_the_direct_computation(process_group, checkpoints, tmp_path, packed):
    dataset = SequencesDataset(packed, alignment=4, rows=4)
    collate = collate_packed if packed else torch.utils.data.default_collate
    direct = DirectSampledAcceptance([collate([dataset[index]]) for index in range(2)])
    values = _validate(tmp_path, checkpoints["qwen3"], dataset, callbacks=(direct,))
    assert 0.05 < direct.value < 0.95
    assert values["val_mtp_sampled_acceptance"] == pytest.approx(direct.value, abs=1e-6)
