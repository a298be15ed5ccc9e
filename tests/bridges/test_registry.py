"""Bridge backends are registered by name and declare what they can do; callers ask the bridge, never its name.

The registry is the one place a `bridge_type` string is looked up, an unknown name lists the registered ones, the
strategy's `bridge` fails loudly before a Trainer ran, and callbacks' `validate_megatron_setup` runs with the bridge
made and before any model is built.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_megatron.bridges import BridgeError, backend_class, capable_backends, create_bridge, registered_backends
from lightning_megatron.bridges.base import register_backend
from lightning_megatron.callbacks import LoRACallback, MTPOnlyCallback
from lightning_megatron.contract import MegatronStrategyContract, ValidatesMegatronSetup, megatron_strategy
from lightning_megatron.distributed import ParallelSizes
from lightning_megatron.module import SFTModule
from lightning_megatron.options import ModelOptions
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_megatron"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("registry") / "qwen3", "qwen3")


@pytest.mark.parametrize("bridge_type, mtp_training, lora, vl, reads_model_config", [
    ("mbridge", False, False, False, False),
    ("megatron-bridge", True, True, True, True),
])
def test_each_backend_declares_what_it_can_do(bridge_type, mtp_training, lora, vl, reads_model_config):
    backend = backend_class(bridge_type)
    assert backend.name == bridge_type and registered_backends()[bridge_type] is backend
    assert (backend.supports_mtp_training, backend.supports_lora, backend.supports_vl,
            backend.reads_model_config_before_build) == (mtp_training, lora, vl, reads_model_config)


def test_a_backend_without_a_capability_refuses_its_method_naming_the_fix(checkpoint):
    bridge = create_bridge("mbridge", checkpoint)
    with pytest.raises(BridgeError, match="bridge_type: mbridge cannot read the model config .*; set bridge_type: "
                                          "megatron-bridge"):
        bridge.router_updates_expert_bias(ModelOptions())
    for lora_method in (bridge.export_adapter_weights, bridge.adapted_hf_modules):
        with pytest.raises(BridgeError, match="bridge_type: mbridge has no LoRA/PEFT support; set bridge_type: "
                                              "megatron-bridge"):
            lora_method([])


def test_megatron_bridge_reads_the_router_expert_bias_from_its_model_config(checkpoint):
    bridge = create_bridge("megatron-bridge", checkpoint)
    assert bridge.router_updates_expert_bias(ModelOptions()) is False
    assert bridge.router_updates_expert_bias(ModelOptions(config_overrides={"moe_router_enable_expert_bias": True}))


def test_the_fix_an_error_suggests_comes_from_the_registry():
    assert capable_backends(lambda backend: backend.supports_lora) == "megatron-bridge"
    assert capable_backends(lambda backend: "qwen2_moe" in backend.moe_model_types) == "mbridge"
    assert capable_backends(lambda backend: False) == ""


def test_an_unknown_bridge_type_names_the_registered_ones(checkpoint):
    message = "bridge_type: 'nemo' is not one of 'mbridge', 'megatron-bridge'"
    with pytest.raises(BridgeError, match=message):
        create_bridge("nemo", checkpoint)
    with pytest.raises(BridgeError, match=message):  # at construction, before any Trainer runs
        MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="nemo")


def test_a_second_backend_under_a_taken_name_is_refused():
    class Impostor(backend_class("mbridge")):
        pass

    with pytest.raises(ValueError, match="bridge_type 'mbridge' is registered twice"):
        register_backend(Impostor)
    assert registered_backends()["mbridge"] is not Impostor


def test_the_bridge_accessor_before_a_trainer_ran_says_when_it_exists(checkpoint):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint))
    with pytest.raises(RuntimeError, match=r"MegatronStrategy.bridge: no bridge yet .*\(trainer\.fit/"):
        _ = strategy.bridge


def test_the_strategy_is_reached_through_its_contract_and_any_other_is_refused(checkpoint):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint))
    assert isinstance(strategy, MegatronStrategyContract)
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert megatron_strategy(pl.Trainer(strategy=strategy, **options), "HFExport") is strategy
    with pytest.raises(TypeError, match=r"HFExport needs Trainer\(strategy=MegatronStrategy\(\.\.\.\)\), got "
                                        "SingleDeviceStrategy"):
        megatron_strategy(pl.Trainer(**options), "HFExport")


def test_the_callbacks_that_validate_the_setup_satisfy_the_protocol():
    assert isinstance(MTPOnlyCallback(), ValidatesMegatronSetup)
    assert isinstance(LoRACallback(), ValidatesMegatronSetup)
    assert not isinstance(pl.Callback(), ValidatesMegatronSetup)


class Refuses(pl.Callback):
    """Records what `validate_megatron_setup` saw, then refuses."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def validate_megatron_setup(self, strategy: MegatronStrategy, module: SFTModule) -> None:
        self.seen.append((strategy.bridge.name, hasattr(module, "model")))
        raise ValueError("refused by the callback")


def test_validate_megatron_setup_runs_with_the_bridge_and_before_the_model(process_group, checkpoint, tmp_path):
    callback = Refuses()
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), precision="fp32")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="refused by the callback"):
        trainer.fit(SFTModule(), DataLoader(RandomTokenDataset(4, 16, 384), batch_size=1))
    assert callback.seen == [("mbridge", False)]
    assert strategy.model_chunks == []


def test_parallel_sizes_read_megatron_and_name_config_fields(model_parallel):
    sizes = ParallelSizes.current()
    assert sizes == ParallelSizes(tensor=1, pipeline=1, virtual_pipeline=None, context=1, expert=1,
                                  expert_tensor=1, data=1)
    assert list(sizes.config_fields()) == [
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
    ]
    assert sizes.saved_fields() == {**sizes.config_fields(), "data_parallel_size": 1}


def test_parallel_sizes_for_a_world_derive_data_parallel_and_refuse_a_misfit():
    sizes = ParallelSizes.for_world(8, tensor=2, pipeline=2, virtual_pipeline=None, context=1, expert=1,
                                    expert_tensor=2)
    assert sizes.data == 2
    with pytest.raises(ValueError, match="world size 6 is not a multiple of tensor x pipeline x context"):
        ParallelSizes.for_world(6, tensor=4, pipeline=1, virtual_pipeline=None, context=1, expert=1, expert_tensor=4)


# A bridge name compared as a string: `bridge_type == ...`, `... != "mbridge"`, `bridge.name == ...`.
NAME_COMPARISON = re.compile(
    r"bridge_type\s*[!=]=|[!=]=\s*\w*\.?bridge_type\b"
    r"|[\"'](mbridge|megatron-bridge)[\"']\s*[!=]=|[!=]=\s*[\"'](mbridge|megatron-bridge)[\"']"
    r"|bridge\w*\.name\s*[!=]=|[!=]=\s*\w*bridge\w*\.name\b"
)


def test_no_bridge_type_is_compared_outside_the_registry():
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "bridges" / "__init__.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if NAME_COMPARISON.search(line)]
    assert not found, "ask the bridge (or bridges.backend_class) for a capability instead:\n" + "\n".join(found)


def test_the_name_scan_catches_what_it_looks_for():
    for line in ['if strategy.bridge_type != "megatron-bridge":', 'if bridge_name == "mbridge":',
                 'others = "mbridge" if self.name == "megatron-bridge" else "megatron-bridge"',
                 'if bridge.name == "mbridge":']:
        assert NAME_COMPARISON.search(line), line
    assert not NAME_COMPARISON.search('if field.name == "core_attention":')
