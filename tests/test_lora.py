"""LoRA through megatron-bridge under a real Trainer: only adapters train, and both HF exports reproduce the model.

The exported adapter is checked with `peft` on the Hugging Face model, the merged export with plain transformers;
both against the logits of the Megatron model that was trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron._compat import import_peft
from lightning_megatron._compat.peft import ADJUSTMENTS as PEFT_ADJUSTMENTS
from lightning_megatron.bridges import BridgeError, backend_class, create_bridge
from lightning_megatron.callbacks import LoRACallback, MTPOnlyCallback
from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.lora import (
    ALL_LINEAR,
    DEFAULT_TARGET_MODULES,
    LoRAConfig,
    add_lora_adapters,
    check_adapter_form,
    check_lora_supported,
    export_lora_adapter,
    export_lora_merged,
    write_lora_adapter,
)
from lightning_megatron.module import SFTModule
from lightning_megatron.options import ModelOptions
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import MoEShape, make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._adam import comparable_adam_eps
from tests._distributed import run_distributed
from tests.test_deepseek_v3 import DEEPSEEK
from tests.test_glm4_moe import GLM
from tests.test_moe import _logits_difference
from tests.test_qwen3_5 import _mtp_head_difference

SEQ, VOCAB, SAMPLES, STEPS = 16, 384, 16, 3
LORA = dict(rank=4, alpha=8)
LR = 1e-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lora") / "qwen3", "qwen3")


class RecordWeights(pl.Callback):
    """Base weights at `setup` (before the pre-wrap hook adds adapters); adapters, DDP and optimizer at fit start."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.base = {id(param): (name, param, param.detach().clone())
                     for name, param in pl_module.model[0].named_parameters()}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        model = unwrap_model(trainer.strategy.model_chunks[0])
        self.adapters = {name: (param, param.detach().clone()) for name, param in model.named_parameters()
                         if id(param) not in self.base}
        self.trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        ddp = trainer.strategy.model_chunks[0]
        self.ddp_params = {id(param) for buffer in ddp.buffers for param in buffer.params}
        optimizer = trainer.optimizers[0].megatron_optimizer
        self.optimizer_numel = sum(param.numel() for param in optimizer.get_parameters())


def _fit(tmp_path: Path, checkpoint: Path, devices: int = 1, module_kwargs: dict[str, Any] | None = None,
         lora: dict[str, Any] | None = None, **strategy_kwargs: Any) -> dict:
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", precision="fp32",
                                micro_batch_size=2, global_batch_size=4, **strategy_kwargs)
    recorder = RecordWeights()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS,
                         callbacks=[LoRACallback(**{**LORA, **(lora or {})}), recorder], default_root_dir=tmp_path,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    loader = DataLoader(RandomTokenDataset(SAMPLES, SEQ, VOCAB), batch_size=2, drop_last=True)
    trainer.fit(SFTModule(**{"lr": LR, **(module_kwargs or {})}), loader)
    return {"strategy": strategy, "recorder": recorder}


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _megatron_logits(strategy: MegatronStrategy, input_ids: torch.Tensor) -> torch.Tensor:
    from megatron.core.utils import unwrap_model

    model = unwrap_model(strategy.model_chunks[0]).eval()
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=torch.arange(SEQ).expand_as(input_ids), attention_mask=None)


def _hf_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids).logits


@pytest.fixture(scope="module")
def lora_fit(process_group, checkpoint, tmp_path_factory) -> dict:
    """One LoRA fit at TP=1 with both exports, shared by the tests that read it."""
    tmp_path = tmp_path_factory.mktemp("lora_fit")
    result = _fit(tmp_path, checkpoint)
    result["adapter"] = export_lora_adapter(result["strategy"], tmp_path / "adapter")
    result["merged"] = export_lora_merged(result["strategy"], tmp_path / "merged")
    result["logits"] = _megatron_logits(result["strategy"], _input_ids())
    return result


def test_only_adapters_train_and_only_they_reach_ddp_and_the_optimizer(lora_fit):
    recorder = lora_fit["recorder"]
    assert len(recorder.adapters) == 16  # linear_in + linear_out of 4 linears x 2 layers
    assert all(".adapter.linear_" in name for name in recorder.adapters)
    assert recorder.trainable == set(recorder.adapters)
    unchanged_base = [name for name, param, before in recorder.base.values() if torch.equal(param, before)]
    assert sorted(unchanged_base) == sorted(name for name, _, _ in recorder.base.values())
    changed_adapters = [name for name, (param, before) in recorder.adapters.items() if not torch.equal(param, before)]
    assert sorted(changed_adapters) == sorted(recorder.adapters)
    assert recorder.ddp_params == {id(param) for param, _ in recorder.adapters.values()}
    assert recorder.optimizer_numel == sum(param.numel() for param, _ in recorder.adapters.values())


def test_exported_adapter_on_the_hf_model_gives_the_megatron_logits(lora_fit, checkpoint):
    peft = import_peft()
    import transformers

    config = json.loads((lora_fit["adapter"] / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.0)
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    base_logits = _hf_logits(base, _input_ids())
    with_adapter = peft.PeftModel.from_pretrained(base, lora_fit["adapter"])
    logits = _hf_logits(with_adapter, _input_ids())
    assert (logits - lora_fit["logits"]).abs().max() <= 1e-5
    assert (base_logits - lora_fit["logits"]).abs().max() > 1e-2  # the adapters did change the model


def test_merged_export_gives_the_megatron_logits_without_peft(lora_fit, checkpoint):
    import transformers

    merged = transformers.AutoModelForCausalLM.from_pretrained(lora_fit["merged"], dtype=torch.float32)
    assert (_hf_logits(merged, _input_ids()) - lora_fit["logits"]).abs().max() <= 1e-5
    exported = load_file(lora_fit["merged"] / "model.safetensors")
    original = load_file(checkpoint / "model.safetensors")
    assert sorted(exported) == sorted(original)
    changed = sorted(name for name in original if not torch.equal(exported[name], original[name]))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert changed == sorted(name for name in original if name.endswith(tuple(f"{p}.weight" for p in projections)))
    assert len(changed) == 14  # 7 adapted projections x 2 layers; norms, embedding and LM head untouched


# the fits whose adapters are compared across TP sizes: LoRA-A's gradients start at zero (B does), where Adam's default
# eps turns the rounding differences of TP's reductions into update differences of the learning rate's order;
# with eps = 10 lr the steps are Lipschitz in the gradients (tests/_adam.py) and 1e-6 bounds the difference
COMPARABLE = {"adam_eps": comparable_adam_eps(LR)}


def _tensor_parallel_adapter(rank: int, world_size: int, tmp: str, checkpoint: str) -> None:
    result = _fit(Path(tmp) / f"rank{rank}", Path(checkpoint), devices=world_size, module_kwargs=COMPARABLE,
                  tensor_model_parallel_size=2)
    export_lora_adapter(result["strategy"], Path(tmp) / "adapter_tp2")


@pytest.mark.slow
def test_tensor_parallel_lora_exports_the_same_adapter(process_group, checkpoint, tmp_path):
    run_distributed(_tensor_parallel_adapter, tmp_path, str(tmp_path), str(checkpoint))
    one_process = export_lora_adapter(_fit(tmp_path / "tp1", checkpoint, module_kwargs=COMPARABLE)["strategy"],
                                      tmp_path / "adapter_tp1")
    tp1 = load_file(one_process / "adapter_model.safetensors")
    tp2 = load_file(tmp_path / "adapter_tp2" / "adapter_model.safetensors")
    assert sorted(tp2) == sorted(tp1)
    # a misplaced shard or q/k/v slice would differ by the tensor's own size
    for name, tensor in tp1.items():
        torch.testing.assert_close(tp2[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(tensor, torch.zeros_like(tensor)) for name, tensor in tp1.items()
               if "lora_B" in name)  # the adapters trained
    assert json.loads((tmp_path / "adapter_tp2" / "adapter_config.json").read_text()) == json.loads(
        (one_process / "adapter_config.json").read_text())


def test_lora_resume_equals_the_uninterrupted_run_bit_for_bit(process_group, checkpoint, tmp_path):
    """The checkpoint holds the adapter-wrapped model under `state_dict()`'s names (megatron-bridge's wrapper saves
    its base linear's `to_wrap.weight` as `weight`); resuming loads it back into the same wrapped structure."""
    from tests.test_strategy import StopAfter
    from tests.test_strategy import _fit as fit_recording_losses

    steps, stop_at = 4, 2
    options = dict(bridge_type="megatron-bridge", precision="bf16")
    uninterrupted = fit_recording_losses(tmp_path / "full", checkpoint, steps, callbacks=(LoRACallback(**LORA),),
                                         **options)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=stop_at, save_top_k=-1)
    first = fit_recording_losses(tmp_path / "first", checkpoint, steps,
                                 callbacks=(LoRACallback(**LORA), StopAfter(stop_at), saver),
                                 trainer_kwargs=dict(enable_checkpointing=True), **options)
    recorder = RecordWeights()
    resumed = fit_recording_losses(tmp_path / "second", checkpoint, steps, callbacks=(LoRACallback(**LORA), recorder),
                                   ckpt_path=str(tmp_path / "ckpts" / f"epoch=0-step={stop_at}.ckpt"), **options)

    assert first["losses"] == uninterrupted["losses"][:stop_at]
    assert resumed["losses"] == uninterrupted["losses"][stop_at:]
    assert resumed["trainer"].global_step == steps
    final = uninterrupted["weights"]
    assert sum(".adapter.linear_" in name for name in final) == 16
    assert sum(".to_wrap.weight" in name for name in final) == 8  # 4 wrapped linears x 2 layers
    assert sorted(resumed["weights"]) == sorted(final)
    assert [name for name, tensor in final.items() if not torch.equal(tensor, resumed["weights"][name])] == []
    # frozen: the checkpoint gave back the weights built from the HF checkpoint (Float16Module casts the norms to bf16)
    changed_base = [name for name, param, built in recorder.base.values()
                    if not torch.equal(param, built.to(param.dtype))]
    assert len(recorder.base) == len(final) - 16 and changed_base == []


def test_a_module_fitted_again_trains_its_kept_adapters_on(process_group, checkpoint, tmp_path):
    """A module's later runs keep its model (`contract.ModelBuild`), adapters and all, and run the pre-wrap hook on
    it again: a validation freezes them, another fit trains them on (and only them); other settings are refused."""
    from megatron.core.utils import unwrap_model

    options = dict(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", precision="fp32", micro_batch_size=2,
                   global_batch_size=4)
    trainer_options = dict(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=1, logger=False,
                           enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer = pl.Trainer(strategy=MegatronStrategy(**options), callbacks=[LoRACallback(**LORA)], **trainer_options)
    module, loader = SFTModule(lr=LR), DataLoader(RandomTokenDataset(SAMPLES, SEQ, VOCAB), batch_size=2)
    trainer.fit(module, loader)
    trainer.validate(module, loader, verbose=False)
    fitted = dict(unwrap_model(trainer.strategy.model_chunks[0]).named_parameters())
    before = {name: parameter.detach().clone() for name, parameter in fitted.items()}
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(module, loader)
    again = dict(unwrap_model(trainer.strategy.model_chunks[0]).named_parameters())
    assert again.keys() == fitted.keys() and all(again[name] is fitted[name] for name in fitted)
    changed = {name for name, parameter in again.items() if not torch.equal(parameter, before[name])}
    assert len(changed) == 16 and all(".adapter.linear_" in name for name in changed)
    other = pl.Trainer(strategy=MegatronStrategy(**options), callbacks=[LoRACallback(rank=8)], **trainer_options)
    with pytest.raises(ValueError, match=r"keeps the adapters an earlier run added, .* \[\(4, 8, 0\.0\)\]"):
        other.validate(module, loader)


class SavesUnderItsOwnName(torch.nn.Module):
    """A wrapper a pre-wrap hook might add, which (like megatron-bridge's AdapterWrapper) saves the wrapped module's
    tensors and extra state without the `inner.` of its module path."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.side = torch.nn.Linear(3, 3)

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        destination = {} if destination is None else destination
        self.inner.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        self.side.state_dict(destination=destination, prefix=f"{prefix}side.", keep_vars=keep_vars)
        return destination


class LinearWithExtraState(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(3, 3)
        self.note = torch.zeros(1)

    def get_extra_state(self) -> torch.Tensor:
        return self.note

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.note = state


def test_checkpoint_loading_follows_a_wrapper_that_renames_what_it_saves():
    from lightning_megatron.checkpoint import _load_model_state

    def model() -> torch.nn.Module:
        wrapped = torch.nn.Sequential(SavesUnderItsOwnName(LinearWithExtraState()))
        wrapped.tied = wrapped[0].inner  # a second module path for the same weight is not a rename
        return wrapped

    saved_model = model()
    saved_model[0].inner.note = torch.ones(1)
    saved = {name: value.detach().clone() for name, value in saved_model.state_dict().items()}
    assert sorted(saved) == ["0._extra_state", "0.bias", "0.side.bias", "0.side.weight", "0.weight",
                             "tied._extra_state", "tied.bias", "tied.weight"]
    loaded = model()
    _load_model_state(loaded, saved)
    assert all(torch.equal(value, saved[name]) for name, value in loaded.state_dict().items())
    assert torch.equal(loaded[0].inner.note, torch.ones(1))


def test_lora_on_mbridge_fails_before_the_model_is_built(process_group, checkpoint, tmp_path):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="mbridge", precision="fp32")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, callbacks=[LoRACallback()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path)
    with pytest.raises(BridgeError, match="bridge_type: mbridge has no LoRA/PEFT support .* set bridge_type: "
                                          "megatron-bridge"):
        trainer.fit(SFTModule(), DataLoader(RandomTokenDataset(4, SEQ, VOCAB), batch_size=1))
    assert strategy.model_chunks == [] and not hasattr(trainer.lightning_module, "model")


def test_a_target_module_that_matches_nothing_is_an_error(process_group, checkpoint, tmp_path):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", precision="fp32")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         callbacks=[LoRACallback(target_modules=["linear_qkv", "linear_qvk"])],
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="target_modules: \\['linear_qvk'\\] matched no linear layer"):
        trainer.fit(SFTModule(), DataLoader(RandomTokenDataset(4, SEQ, VOCAB), batch_size=1))


def test_check_lora_supported_names_the_fix():
    with pytest.raises(BridgeError, match="bridge_type: mbridge has no LoRA/PEFT support .* set bridge_type: "
                                          "megatron-bridge"):
        check_lora_supported(backend_class("mbridge"), mtp_only=False)
    with pytest.raises(ValueError, match="LoRACallback and MTPOnlyCallback cannot be used together"):
        check_lora_supported(backend_class("megatron-bridge"), mtp_only=True)
    check_lora_supported(backend_class("megatron-bridge"), mtp_only=False)


def test_lora_with_mtp_only_fails_before_the_model_is_built(process_group, tmp_path):
    mtp_checkpoint = make_tiny_checkpoint(tmp_path / "qwen3_mtp", "qwen3", mtp=True)
    strategy = MegatronStrategy(hf_checkpoint=str(mtp_checkpoint), bridge_type="megatron-bridge", precision="fp32")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1,
                         callbacks=[MTPOnlyCallback(), LoRACallback()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="LoRACallback and MTPOnlyCallback cannot be used together"):
        trainer.fit(SFTModule(enable_mtp=True), DataLoader(RandomTokenDataset(4, SEQ, VOCAB), batch_size=1))
    assert strategy.model_chunks == [] and not hasattr(trainer.lightning_module, "model")


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_modules=[]), "target_modules: \\[\\] must be a non-empty list"),
    (dict(target_modules="linear_qkv"), "target_modules: 'linear_qkv' must be a non-empty list .* or 'all-linear'"),
    (dict(target_modules=["all-linear", "eh_proj"]), "'all-linear' stands alone \\(target_modules: all-linear\\)"),
    (dict(rank=0), "rank: 0 must be a positive integer"),
    (dict(alpha=0), "alpha: 0 must be > 0"),
    (dict(dropout=1.0), "dropout: 1.0 must be in \\[0, 1\\)"),
])
def test_invalid_lora_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


@pytest.mark.parametrize("value, target_modules", [("all-linear", ALL_LINEAR), ("[linear_qkv]", ["linear_qkv"])])
def test_a_config_gives_all_linear_as_peft_writes_it(value, target_modules):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(LoRACallback, "lora")
    callback = parser.instantiate_classes(parser.parse_args(["--lora.target_modules", value])).lora
    assert callback.config.target_modules == target_modules


# The families with native MTP heads: adapters on every linear of their layers (multi-latent attention's down and up
# projections, the gated DeltaNet's input and output projections, routed and shared experts), the MTP layer's
# included, trained jointly with the MTP loss; the merged export is the trained model, its MTP head included.
# DeepSeek-V3 and Qwen3.5 name them "all-linear", which resolves to the same names and the MTP layer's eh_proj.
MLA_TARGETS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
               "linear_fc1", "linear_fc2"]
GATED_DELTANET_TARGETS = [*DEFAULT_TARGET_MODULES, "in_proj", "out_proj"]
NATIVE_MTP_FAMILIES = {"glm4_moe": (GLM, list(DEFAULT_TARGET_MODULES)), "deepseek_v3": (DEEPSEEK, ALL_LINEAR),
                       "qwen3_5_text": (None, ALL_LINEAR), "qwen3_5_moe_text": (MoEShape(), GATED_DELTANET_TARGETS)}
ALL_LINEAR_NAMES = {"deepseek_v3": {*MLA_TARGETS, "eh_proj"}, "qwen3_5_text": {*GATED_DELTANET_TARGETS, "eh_proj"}}
# the HF tensors no adapter reaches: norms, routers and their expert bias, the shared expert's gate, embeddings and
# LM heads (and the MTP layer's copies of them), the gated DeltaNet's decay, bias and convolution
NOT_ADAPTED = ("norm.weight", "mlp.gate.weight", "e_score_correction_bias", "shared_expert_gate.weight",
               "embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "A_log", "dt_bias", "conv1d.weight")
MTP_PROJECTIONS = ("eh_proj.weight", "mtp.fc.weight")  # adapted by "all-linear" only


@pytest.mark.parametrize("family", NATIVE_MTP_FAMILIES)
def test_joint_lora_on_a_native_mtp_family_merges_into_an_export_of_the_trained_model(process_group, tmp_path,
                                                                                     family):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.utils import unwrap_model

    moe, targets = NATIVE_MTP_FAMILIES[family]
    checkpoint = make_tiny_checkpoint(tmp_path / family, family, mtp=True, moe=moe)
    result = _fit(tmp_path, checkpoint, module_kwargs={"enable_mtp": True}, lora={"target_modules": targets})
    recorder = result["recorder"]
    assert recorder.trainable == set(recorder.adapters)
    assert any(name.startswith("mtp.") for name in recorder.adapters)
    assert all(torch.equal(param, before) for _, param, before in recorder.base.values())
    chunk = unwrap_model(result["strategy"].model_chunks[0])
    wrapped = {name.split(".adapter.")[0] for name in recorder.adapters}
    unwrapped = [name for name, module in chunk.named_modules() if isinstance(module, ColumnParallelLinear |
                 RowParallelLinear) and not name.endswith(".to_wrap") and ".adapter." not in name]
    if targets == ALL_LINEAR:  # every linear of the layers, by the family's own names; the LM head only is left
        assert {name.rsplit(".", 1)[-1] for name in wrapped} == ALL_LINEAR_NAMES[family]
        assert unwrapped == ["output_layer"]

    merged = export_lora_merged(result["strategy"], tmp_path / "merged")
    assert _logits_difference(chunk, merged) <= 1e-5
    # the MTP head reads the trunk's output (its rounding: <= 1e-5, as the main logits) through one more layer, whose
    # fp32 rounding on logits of |z| ~ 4 adds a few ulps (4.8e-7 each); an adapter left out of the merge (eh_proj's:
    # 0.4) or misplaced is four orders of magnitude above
    assert _mtp_head_difference(chunk, merged) <= 2e-5
    original, exported = load_file(checkpoint / "model.safetensors"), load_file(merged / "model.safetensors")
    assert exported.keys() == original.keys()
    changed = {name for name in original if not torch.equal(exported[name], original[name])}
    config = json.loads((checkpoint / "config.json").read_text())
    assert any(is_hf_mtp_tensor(name, config) for name in changed)
    assert not any(name.endswith(NOT_ADAPTED) for name in changed)
    assert any(name.endswith(MTP_PROJECTIONS) for name in changed) == (targets == ALL_LINEAR)
    if targets == ALL_LINEAR:
        with pytest.warns(UserWarning, match=r"the MTP layer's adapters are written, but engines apply LoRA "
                                             r"adapters to the main model only"):  # the draft head is not served
            adapter = export_lora_adapter(result["strategy"], tmp_path / "adapter")
        _assert_adapter_folds_into(adapter, original, exported, changed)


def _assert_adapter_folds_into(adapter: Path, original: dict, merged: dict, changed: set[str]) -> None:
    """The PEFT folder (what `WeightSync(lora_form="adapter")` writes) names every adapted HF module in its
    `target_modules` and, folded into the base weights, gives the merged export (an adapted expert no token reached
    kept B = 0: unchanged in both): a misplaced slice or a missing module would differ by an adapter's own size
    (1e-2 after the fit), fp32 rounding of `W + s B A` by 1e-6."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted({name.removesuffix(".weight").rsplit(".", 1)[-1]
                                                       for name in changed})
    weights, scale = load_file(adapter / "adapter_model.safetensors"), config["lora_alpha"] / config["r"]
    folded = {}
    for name, lora_a in weights.items():
        if ".lora_A." in name:
            base = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            folded[base] = original[base] + scale * weights[name.replace(".lora_A.", ".lora_B.")] @ lora_a
    assert changed <= folded.keys()
    for name, weight in folded.items():
        torch.testing.assert_close(weight, merged[name], rtol=0, atol=1e-6, msg=name)


def test_default_targets_on_multi_latent_attention_name_its_linears(model_parallel, tmp_path):
    chunks = create_bridge("megatron-bridge", make_tiny_checkpoint(tmp_path / "deepseek_v3", "deepseek_v3",
                                                                   moe=DEEPSEEK)).build(ModelOptions())
    with pytest.raises(ValueError, match=r"target_modules: \['linear_qkv'\] matched no linear layer of the model; its "
                                         r"layers' linears are \['linear_fc1', 'linear_fc2', 'linear_kv_down_proj', "
                                         r"'linear_kv_up_proj', 'linear_proj', 'linear_q_down_proj', "
                                         r"'linear_q_up_proj'\]"):
        add_lora_adapters(chunks, LoRAConfig())


def test_moe_adapter_on_transformers_fused_experts_gives_the_megatron_logits(process_group, tmp_path):
    """GLM-4.5 (a dense first layer, routed and shared experts): the adapter is written per expert, as the checkpoint
    and vLLM/SGLang name them; `peft` folds the routed experts' adapters into transformers 5's fused experts and,
    with `import_peft()`, applies the dense MLP's and the shared experts' too: bit-equal to the merged export's
    weights (both compute W + s B A in fp32), logits as the Megatron model's (fp32 rounding: 1e-5 as
    `_logits_difference`). Without the adjustment the dense and shared adapters are dropped: logits off by ~1."""
    import transformers
    from megatron.core.utils import unwrap_model

    checkpoint = make_tiny_checkpoint(tmp_path / "glm4_moe", "glm4_moe", moe=GLM)
    result = _fit(tmp_path, checkpoint)
    adapter = export_lora_adapter(result["strategy"], tmp_path / "adapter")
    merged = export_lora_merged(result["strategy"], tmp_path / "merged")
    megatron = _megatron_logits(result["strategy"], _input_ids())
    assert any(".mlp.experts.3.down_proj." in name for name in load_file(adapter / "adapter_model.safetensors"))
    check_adapter_form(result["strategy"].bridge, [unwrap_model(chunk) for chunk in result["strategy"].model_chunks])

    def folded() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        model = import_peft().PeftModel.from_pretrained(base, adapter).merge_and_unload()
        return model.state_dict(), _hf_logits(model, _input_ids())

    weights, logits = folded()
    expected = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).state_dict()
    assert weights.keys() == expected.keys() and {"model.layers.0.mlp.gate_proj.weight",
                                                  "model.layers.1.mlp.shared_experts.down_proj.weight",
                                                  "model.layers.1.mlp.experts.gate_up_proj"} <= weights.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    assert (logits - megatron).abs().max() <= 1e-5
    (linear_targets,) = PEFT_ADJUSTMENTS
    with linear_targets.suspended():
        weights, logits = folded()
    assert torch.equal(weights["model.layers.1.mlp.experts.down_proj"], expected["model.layers.1.mlp.experts.down_proj"])
    assert not torch.equal(weights["model.layers.1.mlp.shared_experts.down_proj.weight"],
                           expected["model.layers.1.mlp.shared_experts.down_proj.weight"])
    assert (logits - megatron).abs().max() > 1e-2


def test_adapters_on_experts_a_checkpoint_stores_fused_are_refused(model_parallel, tmp_path):
    """Qwen3.5-MoE's checkpoint holds `mlp.experts.gate_up_proj` (3-D): per-expert adapters would reach nothing."""
    bridge = create_bridge("megatron-bridge", make_tiny_checkpoint(tmp_path / "qwen3_5_moe", "qwen3_5_moe_text",
                                                                   moe=MoEShape()))
    chunks = bridge.build(ModelOptions())
    add_lora_adapters(chunks, LoRAConfig(**LORA))
    with pytest.raises(ValueError, match=r"export_lora_adapter: the adapters of \['model\.layers\.0\.mlp\.experts\.0\."
                                         r"down_proj'.* name no tensor of .*exclude those linears from LoRACallback's "
                                         r"target_modules"):
        write_lora_adapter(bridge, chunks, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    # WeightSync(lora_form="adapter")'s check at fit start: the same refusal from the export's names, no tensor read
    exported = {name.rsplit(".lora_", 1)[0] for name, _ in bridge.export_adapter_weights(chunks)}
    assert set(bridge.adapted_hf_modules(chunks)) <= exported
    with pytest.raises(ValueError, match=r"WeightSync\(lora_form='adapter'\): the adapters of \['model\.layers\.0\.mlp"
                                         r"\.experts\.0\.down_proj'.* set lora_form: merged"):
        check_adapter_form(bridge, chunks)
