"""Mixture-of-Experts through both bridges and the strategy: HF logits at EP=1, EP=2 and EP=2 x TP=2, training at
EP=2 equal to EP=1, exports, resume, PP=2, the load-balancing loss as a metric, MTP-only on an MoE backbone, and
bad expert-parallel input refused before the build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.module import SFTModule
from lightning_megatron.moe import router_settings
from lightning_megatron.mtp.parameters import is_mtp_parameter
from lightning_megatron.options import ModelOptions
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import MoEShape, make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._adam import comparable_adam_eps
from tests._distributed import run_distributed
from tests.test_strategy import StopAfter

SEQ, VOCAB, SAMPLES, LR = 16, 384, 32, 1e-3
BRIDGES = ("mbridge", "megatron-bridge")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_checkpoints")
    return {
        "qwen3_moe": make_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe"),
        "qwen3_moe_mtp": make_tiny_checkpoint(root / "qwen3_moe_mtp", "qwen3_moe", mtp=True),
        "qwen3_moe_plain_softmax": make_tiny_checkpoint(root / "qwen3_moe_plain_softmax", "qwen3_moe",
                                                        moe=MoEShape(norm_topk_prob=False)),
        "qwen2_moe": make_tiny_checkpoint(root / "qwen2_moe", "qwen2_moe"),
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3"),
    }


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _logits_difference(chunk: torch.nn.Module, hf_checkpoint: Path) -> float:
    """Max |Megatron - HF| logits, the vocabulary gathered over tensor-parallel ranks."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    input_ids = _input_ids()
    chunk.eval()
    with torch.no_grad():
        positions = torch.arange(SEQ).expand_as(input_ids)
        ours = gather_from_tensor_model_parallel_region(chunk(input_ids=input_ids, position_ids=positions,
                                                              attention_mask=None))
        reference = transformers.AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=torch.float32)(input_ids)
    return float((ours - reference.logits).abs().max())


def _same_tensors(original: Path, exported: Path) -> list[str]:
    expected, written = load_file(original / "model.safetensors"), load_file(exported / "model.safetensors")
    assert written.keys() == expected.keys()
    return [name for name in expected if not torch.equal(expected[name], written[name])]


def _max_difference(first: Path, second: Path) -> float:
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def _build_check_and_export(bridge_type: str, hf_checkpoint: Path, export: Path) -> dict[str, Any]:
    """Build through the bridge for the current parallel state; logits vs HF; export; the export's differences."""
    from megatron.core import parallel_state

    bridge = create_bridge(bridge_type, hf_checkpoint)
    chunks = bridge.build(ModelOptions(sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1))
    difference = _logits_difference(chunks[0], hf_checkpoint)
    bridge.save_hf(chunks, export)
    experts = type(chunks[0].decoder.layers[0].mlp.experts).__name__
    return {"logits": difference, "experts": experts, "export_unequal": _same_tensors(hf_checkpoint, export)}


# one process ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bridge_type, name", [
    ("mbridge", "qwen3_moe"), ("megatron-bridge", "qwen3_moe"),
    ("mbridge", "qwen3_moe_plain_softmax"), ("megatron-bridge", "qwen3_moe_plain_softmax"),
    ("mbridge", "qwen2_moe"),  # the shared expert: megatron-bridge 0.6 has no Qwen2-MoE bridge
])
def test_logits_router_and_round_trip_at_ep1(model_parallel, checkpoints, tmp_path, bridge_type, name):
    from megatron.core.utils import get_model_config

    result = _build_check_and_export(bridge_type, checkpoints[name], tmp_path / "export")
    assert result["logits"] <= 1e-5
    assert result["export_unequal"] == []
    assert result["experts"] == "SequentialMLP"  # the local spec's expert backend
    config = get_model_config(create_bridge(bridge_type, checkpoints[name]).build(ModelOptions())[0])
    hf_config = json.loads((checkpoints[name] / "config.json").read_text())
    assert config.moe_router_pre_softmax is not hf_config["norm_topk_prob"]  # mbridge hard-codes False upstream
    assert (config.moe_router_topk, config.num_moe_experts) == (hf_config["num_experts_per_tok"], 4)
    assert config.moe_router_load_balancing_type == "aux_loss"  # mbridge: "none" upstream
    assert config.moe_aux_loss_coeff == hf_config["router_aux_loss_coef"]


def test_mbridge_alone_routes_a_checkpoint_without_norm_topk_prob_wrongly(model_parallel, checkpoints):
    """What the router settings correct: mbridge hard-codes renormalised top-k routing and no load balancing."""
    from lightning_megatron._compat import import_mbridge

    path = checkpoints["qwen3_moe_plain_softmax"]
    bridge = import_mbridge().AutoBridge.from_pretrained(str(path), dtype=torch.float32)
    assert bridge.config.moe_router_pre_softmax is False and bridge.config.moe_router_load_balancing_type == "none"
    (model,) = bridge.get_model(wrap_with_ddp=False, bf16=False, fp16=False, use_cpu_initialization=True)
    bridge.load_weights([model], str(path))
    assert _logits_difference(model, path) > 1e-2


def test_router_settings_follow_the_hf_config():
    base = {"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "norm_topk_prob": True, "router_aux_loss_coef": 0.01}
    assert router_settings({"model_type": "qwen3"}) == {}
    settings = router_settings(base)
    assert settings["num_moe_experts"] == 8 and settings["moe_aux_loss_coeff"] == 0.01
    assert settings["moe_router_pre_softmax"] is False
    assert router_settings({**base, "norm_topk_prob": False})["moe_router_pre_softmax"] is True
    with pytest.raises(ValueError, match="mlp_only_layers"):
        router_settings({**base, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="model_type 'mixtral' is not supported"):
        router_settings({**base, "model_type": "mixtral"})


def test_a_renormalised_top_1_router_is_refused_before_megatron_core_refuses_it():
    """HF weights a renormalised top-1 expert 1; Megatron-Core refuses top-1 without a softmax over all experts (in
    TransformerConfig, deep in the build): refused here, naming the fields. Without renormalising it routes as HF."""
    base = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
            "norm_topk_prob": True}
    assert router_settings({**base, "norm_topk_prob": False})["moe_router_pre_softmax"] is True
    with pytest.raises(ValueError, match=r"num_experts_per_tok: 1 renormalised \(norm_topk_prob: true.* "
                                         r"num_experts_per_tok > 1 or norm_topk_prob: false"):
        router_settings(base)
    with pytest.raises(ValueError, match=r"num_experts_per_tok: 1 renormalised \(Qwen3.5-MoE's router always "
                                         r"renormalises it.* use a checkpoint with num_experts_per_tok > 1$"):
        router_settings({**base, "model_type": "qwen3_5_moe_text", "shared_expert_intermediate_size": 32})


@pytest.mark.parametrize("overrides, field", [
    ({"moe_router_topk": 3}, "moe_router_topk"),
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax"),
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
])
def test_router_overrides_that_contradict_the_checkpoint_fail_before_the_build(model_parallel, checkpoints,
                                                                             overrides, field):
    bridge = create_bridge("mbridge", checkpoints["qwen3_moe"])
    with pytest.raises(BridgeError, match=rf"config_overrides.{field}: .* contradicts the checkpoint"):
        bridge.validate(ModelOptions(config_overrides=overrides))


def test_expert_parallel_sizes_are_checked_against_the_checkpoint():
    from lightning_megatron.moe import check_expert_parallel, check_expert_parallel_world, check_moe_sequence_parallel

    moe = {"num_local_experts": 4, "moe_intermediate_size": 32}
    with pytest.raises(ValueError, match=r"expert_model_parallel_size: 3 must divide the checkpoint's 4 experts"):
        check_expert_parallel(moe, 3, 1)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size: 2 needs an MoE checkpoint"):
        check_expert_parallel({"num_experts": 0}, 2, 1)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size: 3 must divide the experts' FFN size 32"):
        check_expert_parallel(moe, 1, 3)
    with pytest.raises(ValueError, match=r"world size 2 is not a multiple of expert_model_parallel_size x"):
        check_expert_parallel_world(2, 4, 1, 1)
    with pytest.raises(ValueError, match=r"sequence_parallel: an MoE model with tensor_model_parallel_size: 2 "
                                         r"trains only with sequence parallelism in Megatron-Core; set sequence"):
        check_moe_sequence_parallel(moe, 2, False)
    check_expert_parallel(moe, 4, 2)
    check_expert_parallel_world(8, 2, 2, 2)
    check_moe_sequence_parallel(moe, 2, True)
    check_moe_sequence_parallel({"num_experts": 0}, 2, False)


def _trainer(tmp_path: Path, strategy: MegatronStrategy, steps: int, devices: int, callbacks: list,
             **kwargs: Any) -> pl.Trainer:
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, default_root_dir=tmp_path,
                      callbacks=callbacks, **{**defaults, **kwargs})


class Metrics(pl.Callback):
    """Every logged metric after each step; the parameters when training starts and ends."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = _parameters(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps.append({key: float(value) for key, value in trainer.callback_metrics.items()})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after = _parameters(pl_module)


def _parameters(pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
    from megatron.core.utils import unwrap_model

    return {f"{index}.{name}": parameter.detach().clone() for index, chunk in enumerate(pl_module.model)
            for name, parameter in unwrap_model(chunk).named_parameters()}


def _fit(tmp_path: Path, hf_checkpoint: Path, steps: int, devices: int = 1, *, export: Path | None = None,
         module: SFTModule | None = None, callbacks: tuple = (), ckpt_path: str | None = None,
         trainer_kwargs: dict | None = None, samples: int = SAMPLES, **strategy_kwargs: Any) -> Metrics:
    """A fit on `samples` random sequences (fewer than the steps consume: the same ones again, epoch after epoch)."""
    options = dict(micro_batch_size=2, global_batch_size=4, precision="fp32") | strategy_kwargs
    strategy = MegatronStrategy(hf_checkpoint=str(hf_checkpoint), **options)
    metrics = Metrics()
    trainer = _trainer(tmp_path, strategy, steps, devices, [metrics, *callbacks], **(trainer_kwargs or {}))
    loader = DataLoader(RandomTokenDataset(samples, SEQ, VOCAB), batch_size=options["micro_batch_size"],
                        drop_last=True)
    trainer.fit(module or SFTModule(lr=LR, warmup_steps=1), loader, ckpt_path=ckpt_path)
    if export is not None:
        strategy.export_hf(export)
    return metrics


@pytest.mark.parametrize("bridge_type", BRIDGES)
def test_training_logs_the_load_balancing_loss_apart(process_group, checkpoints, tmp_path, bridge_type):
    metrics = _fit(tmp_path, checkpoints["qwen3_moe"], 3, bridge_type=bridge_type, export=tmp_path / "export")
    aux_losses = [step["moe_aux_loss"] for step in metrics.steps]
    # Switch loss (before its coefficient): 1 for perfectly balanced routing, up to num_experts when collapsed
    assert all(0.9 < value < 4 for value in aux_losses)
    assert len(set(aux_losses)) == 3
    assert metrics.steps[-1]["lm_loss"] < metrics.steps[0]["lm_loss"]
    moved = [name for name in metrics.before if not torch.equal(metrics.before[name], metrics.after[name])]
    assert any(".router." in name for name in moved) and any(".local_experts." in name for name in moved)
    assert _same_tensors(checkpoints["qwen3_moe"], tmp_path / "export")  # the export carries the trained weights


def test_a_dense_model_logs_no_load_balancing_loss(process_group, checkpoints, tmp_path):
    metrics = _fit(tmp_path, checkpoints["qwen3"], 1)
    assert "moe_aux_loss" not in metrics.steps[0]


def _comparable_module() -> SFTModule:
    """The module of the fits whose exports are compared across layouts: its Adam steps are a Lipschitz function of
    the gradients, so the layouts' rounding differences stay far below the 1e-5 the exports are held to
    (tests/_adam.py; with the default eps, three steps left 3.5e-5 between them on one CPU)."""
    return SFTModule(lr=LR, warmup_steps=1, adam_eps=comparable_adam_eps(LR))


def _mtp_only_module() -> SFTModule:
    return SFTModule(enable_mtp=True, lr=1e-2)


def _assert_only_mtp_moved(metrics: Metrics) -> None:
    mtp = {name for name in metrics.before if is_mtp_parameter(name)}
    frozen_moved = [name for name in metrics.before if name not in mtp
                    and not torch.equal(metrics.before[name], metrics.after[name])]
    assert frozen_moved == []
    assert any(".mtp_model_layer.mlp.local_experts." in name or ".mtp_model_layer.mlp.experts." in name
               for name in mtp)
    assert all(not torch.equal(metrics.before[name], metrics.after[name]) for name in mtp
               if ".mlp.experts." not in name)  # an expert no token was routed to gets no gradient


def test_mtp_only_on_an_moe_backbone_freezes_router_and_experts(process_group, checkpoints, tmp_path):
    metrics = _fit(tmp_path, checkpoints["qwen3_moe_mtp"], 3, bridge_type="megatron-bridge",
                   module=_mtp_only_module(), callbacks=(MTPOnlyCallback(log_lm_loss_every_n_steps=1),),
                   use_distributed_optimizer=False)
    _assert_only_mtp_moved(metrics)
    frozen = [name for name in metrics.before if not is_mtp_parameter(name)]
    assert any(".mlp.router." in name for name in frozen) and any(".local_experts." in name for name in frozen)
    assert {"lm_loss", "mtp_loss", "moe_aux_loss"} <= set(metrics.steps[-1])
    audit = json.loads((tmp_path / "mtp_only_audit.json").read_text())
    assert audit["frozen_bit_identical"]


def test_joint_training_on_an_moe_backbone_with_mtp_moves_everything(process_group, checkpoints, tmp_path):
    metrics = _fit(tmp_path, checkpoints["qwen3_moe_mtp"], 3, bridge_type="megatron-bridge",
                   module=_mtp_only_module())
    unchanged = [name for name in metrics.before if torch.equal(metrics.before[name], metrics.after[name])
                 and ".local_experts." not in name]
    assert unchanged == []
    assert metrics.steps[-1]["mtp_loss"] < metrics.steps[0]["mtp_loss"]


def test_mtp_only_refuses_expert_bias_updates_on_moe(process_group, checkpoints, tmp_path):
    module = _mtp_only_module()
    module.model_options = lambda: ModelOptions(mtp=True, config_overrides={"moe_router_enable_expert_bias": True})
    with pytest.raises(ValueError, match="moe_router_enable_expert_bias"):
        _fit(tmp_path, checkpoints["qwen3_moe_mtp"], 1, bridge_type="megatron-bridge", module=module,
             callbacks=(MTPOnlyCallback(),))


def test_an_expert_parallel_size_the_world_cannot_hold_fails_before_the_build(process_group, checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"world size 1 is not a multiple of expert_model_parallel_size x "
                                         r"expert_tensor_parallel_size x pipeline_model_parallel_size = 2 x 1 x 1"):
        _fit(tmp_path, checkpoints["qwen3_moe"], 1, expert_model_parallel_size=2)


# two processes: EP=2 ----------------------------------------------------------------------------------------------


def _expert_parallel_case(rank: int, world_size: int, tmp: str, paths: dict[str, str]) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core

    root, checkpoint = Path(tmp), Path(paths["qwen3_moe"])
    prepare_megatron_core()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    result: dict[str, Any] = {"build": {bridge_type: _build_check_and_export(bridge_type, checkpoint,
                                                                               root / f"ep2_build_{bridge_type}")
                                        for bridge_type in BRIDGES}}
    steps = 5
    for bridge_type in BRIDGES:
        for ep in (1, 2):
            metrics = _fit(root / f"{bridge_type}_ep{ep}", checkpoint, steps, world_size, bridge_type=bridge_type,
                           expert_model_parallel_size=ep, export=root / f"{bridge_type}_ep{ep}_export",
                           module=_comparable_module())
            result[bridge_type, ep] = metrics.steps
        result[bridge_type, "export"] = _max_difference(root / f"{bridge_type}_ep1_export",
                                                        root / f"{bridge_type}_ep2_export")

    # resume at EP=2, from a checkpoint written mid-run, against the uninterrupted EP=2 run above
    saver = pl.callbacks.ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=3, save_top_k=-1)
    _fit(root / "first", checkpoint, steps, world_size, callbacks=(StopAfter(3), saver), module=_comparable_module(),
         trainer_kwargs=dict(enable_checkpointing=True), expert_model_parallel_size=2)
    saved = root / "ckpts" / "epoch=0-step=3.ckpt"
    resumed = _fit(root / "resumed", checkpoint, steps, world_size, ckpt_path=str(saved), module=_comparable_module(),
                   export=root / "resumed_export", expert_model_parallel_size=2)
    result["resumed"] = [step["lm_loss"] for step in resumed.steps]
    result["resumed_export_unequal"] = _same_tensors(root / "mbridge_ep2_export", root / "resumed_export")

    mtp_only = _fit(root / "mtp_only", Path(paths["qwen3_moe_mtp"]), 2, world_size, bridge_type="megatron-bridge",
                    module=_mtp_only_module(), callbacks=(MTPOnlyCallback(),), expert_model_parallel_size=2)
    _assert_only_mtp_moved(mtp_only)

    try:
        _fit(root / "three_experts", Path(paths["three_experts"]), 1, world_size, expert_model_parallel_size=2)
    except BridgeError as error:
        result["three_experts"] = str(error)
    return result


@pytest.mark.slow
def test_expert_parallel_two_equals_one(checkpoints, tmp_path):
    paths = {name: str(checkpoints[name]) for name in ("qwen3_moe", "qwen3_moe_mtp")}
    paths["three_experts"] = str(make_tiny_checkpoint(tmp_path / "three_experts", "qwen3_moe",
                                                      moe=MoEShape(num_experts=3)))
    results = run_distributed(_expert_parallel_case, tmp_path, str(tmp_path), paths)
    for result in results:
        for bridge_type in BRIDGES:
            assert result["build"][bridge_type]["logits"] <= 1e-5
            assert result["build"][bridge_type]["export_unequal"] == []
            ep1, ep2 = result[bridge_type, 1], result[bridge_type, 2]
            assert len(ep1) == len(ep2) == 5
            for one, two in zip(ep1, ep2):
                assert two["lm_loss"] == pytest.approx(one["lm_loss"], abs=1e-5)
                assert two["moe_aux_loss"] == pytest.approx(one["moe_aux_loss"], abs=1e-5)
            assert result[bridge_type, "export"] <= 1e-5
        assert result["resumed"] == [step["lm_loss"] for step in result["mbridge", 2][3:]]
        assert result["resumed_export_unequal"] == []
        assert "expert_model_parallel_size: 2 must divide the checkpoint's 3 experts" in result["three_experts"]
    assert results[0]["mbridge", 2] == results[1]["mbridge", 2]  # every rank logs the same, reduced metrics


# four processes: EP=2 with TP=2 (expert tensor parallelism 2), and with PP=2 -------------------------------------


def _uneven_gather_with_and_without_adjustment() -> dict[str, Any]:
    """What the dispatcher does under sequence parallelism (token_dispatcher.py:739): tensor-parallel ranks hold
    different numbers of tokens and gather them; gloo needs equal shares unless `moe.gloo_uneven_gathers` pads them."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    from lightning_megatron._compat import moe

    adjustment = next(item for item in moe.MEGATRON_CORE_ADJUSTMENTS if item.name == "moe.gloo_uneven_gathers")
    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    sizes = [2, 3]
    tokens = torch.full((sizes[rank], 4), float(rank))
    with adjustment.suspended(), pytest.raises(RuntimeError) as upstream:
        mappings._gather_along_first_dim(tokens, group, output_split_sizes=sizes)
    gathered = mappings._gather_along_first_dim(tokens, group, output_split_sizes=sizes)
    scattered = mappings._reduce_scatter_along_first_dim(torch.ones(5, 4), group, input_split_sizes=sizes)
    return {"upstream": str(upstream.value), "gathered": gathered, "scattered": scattered, "rank": rank}


def _expert_tensor_and_pipeline_case(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core

    root, checkpoint = Path(tmp), Path(hf_checkpoint)
    prepare_megatron_core()
    parallel_state.initialize_model_parallel(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    result: dict[str, Any] = {"uneven_gather": _uneven_gather_with_and_without_adjustment()}
    result["build"] = {bridge_type: _build_check_and_export(bridge_type, checkpoint, root / f"tp2ep2_{bridge_type}")
                       for bridge_type in BRIDGES}
    steps, batches = 3, dict(micro_batch_size=1, global_batch_size=4)
    reference = _fit(root / "dp4", checkpoint, steps, world_size, export=root / "dp4_export",
                     module=_comparable_module(), **batches)
    result["reference"] = [step["lm_loss"] for step in reference.steps]
    for bridge_type in BRIDGES:
        for name, parallel in (("tp2_ep2", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
                               ("pp2_ep2", dict(pipeline_model_parallel_size=2))):
            export = root / f"{bridge_type}_{name}_export"
            metrics = _fit(root / f"{bridge_type}_{name}", checkpoint, steps, world_size, bridge_type=bridge_type,
                           expert_model_parallel_size=2, export=export, module=_comparable_module(), **parallel,
                           **batches)
            result[bridge_type, name] = [step["lm_loss"] for step in metrics.steps]
            result[bridge_type, name, "aux"] = [step["moe_aux_loss"] for step in metrics.steps]
            result[bridge_type, name, "export"] = _max_difference(root / "dp4_export", export)
    return result


@pytest.mark.slow
def test_expert_parallel_with_tensor_and_pipeline_parallelism(checkpoints, tmp_path):
    results = run_distributed(_expert_tensor_and_pipeline_case, tmp_path, str(tmp_path), str(checkpoints["qwen3_moe"]),
                              world_size=4)
    for result in results:
        gather = result["uneven_gather"]
        assert "invalid tensor size" in gather["upstream"]
        assert torch.equal(gather["gathered"], torch.cat([torch.zeros(2, 4), torch.ones(3, 4)]))
        assert torch.equal(gather["scattered"], torch.full(([2, 3][gather["rank"]], 4), 2.0))
        for bridge_type in BRIDGES:
            assert result["build"][bridge_type]["logits"] <= 1e-5
            assert result["build"][bridge_type]["export_unequal"] == []
            for name in ("tp2_ep2", "pp2_ep2"):
                assert result[bridge_type, name] == pytest.approx(result["reference"], abs=1e-5)
                assert result[bridge_type, name, "export"] <= 1e-5  # sound with _comparable_module's Adam
                assert all(value > 0.9 for value in result[bridge_type, name, "aux"])


def test_a_family_whose_experts_a_bridge_does_not_map_fails_before_the_build(model_parallel, checkpoints):
    with pytest.raises(BridgeError, match=r"bridge_type: megatron-bridge does not map the experts of 'qwen2_moe' "
                                          r"checkpoints \(it maps qwen3_moe, glm4_moe, deepseek_v3, "
                                          r"qwen3_5_moe_text, qwen3_5_moe\); "
                                          r"set bridge_type: mbridge"):
        create_bridge("megatron-bridge", checkpoints["qwen2_moe"]).validate(ModelOptions())


def test_restoring_an_mtp_head_on_qwen3_moe_gives_the_layout_the_bridge_maps(checkpoints, tmp_path):
    from lightning_megatron.mtp.restore import restore_mtp_head

    restored = restore_mtp_head(checkpoints["qwen3_moe"], tmp_path / "restored", init="copy-last-layer")
    expected = load_file(checkpoints["qwen3_moe_mtp"] / "model.safetensors")
    written = load_file(Path(restored) / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in written.items()} == {n: tuple(t.shape) for n, t in expected.items()}
    assert torch.equal(written["mtp.layers.0.mlp.experts.3.up_proj.weight"],
                       written["model.layers.1.mlp.experts.3.up_proj.weight"])


def fit_shortened_config(config_file: str, tmp_path: Path) -> None:
    """`lightning-megatron fit --config <config_file>` for 2 steps, writing everything under tmp_path (the tiny
    checkpoint under tmp_path/tiny, each callback's folder under its own name)."""
    import os
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((root / config_file).read_text())
    config["trainer"].update(max_steps=2, val_check_interval=2, default_root_dir=str(tmp_path))
    config["trainer"]["strategy"]["init_args"]["hf_checkpoint"] = str(tmp_path / "tiny")
    config["trainer"]["logger"][0]["init_args"]["save_dir"] = str(tmp_path)
    for callback in config["trainer"]["callbacks"]:
        if "dirpath" in callback.get("init_args", {}):
            callback["init_args"]["dirpath"] = str(tmp_path / Path(callback["init_args"]["dirpath"]).name)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    completed = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "fit", "--config",
                                str(tmp_path / "config.yaml")], cwd=root, capture_output=True, text=True,
                               timeout=600, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]


@pytest.mark.slow
def test_the_tiny_moe_config_fits_on_two_processes_with_expert_parallelism(tmp_path):
    """`lightning-megatron fit --config configs/tiny/moe_ep2.yaml`, shortened, writing under tmp_path."""
    fit_shortened_config("configs/tiny/moe_ep2.yaml", tmp_path)
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"lm_loss", "moe_aux_loss", "val_lm_loss"} <= set(header)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in exported and not any("mtp" in n for n in exported)
