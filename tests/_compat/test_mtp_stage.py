"""`_compat/mtp_stage.py`: the sharded checkpoint of a model with tied embeddings at PP=2, its MTP layer on the last
stage: refused by Megatron-Core's assertion without the adjustment; with it, saved and loaded bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron._compat import mtp_stage
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_distributed

(ADJUSTMENT,) = mtp_stage.ADJUSTMENTS


def _save_and_load(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.utils import unwrap_model

    from lightning_megatron import checkpoint
    from lightning_megatron._compat import prepare_megatron_core
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    prepare_megatron_core()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bridge = create_bridge("megatron-bridge", hf_checkpoint)
    chunks = bridge.build(ModelOptions(mtp=True))
    result: dict[str, Any] = {"output_weight": any(name == "output_layer.weight"
                                                   for name, _ in chunks[0].named_parameters())}
    with ADJUSTMENT.suspended():  # this rank's state dict alone: no collective a failing rank would leave waiting
        try:
            unwrap_model(chunks[0]).sharded_state_dict(metadata=dict(checkpoint.SHARDED_METADATA))
            result["upstream"] = "saved"
        except AssertionError:
            result["upstream"] = "refused"
    path = Path(tmp) / "checkpoint"
    checkpoint.save(path, chunks, None, {"epoch": 0})
    fresh = bridge.build(ModelOptions(mtp=True), load_weights=False)
    checkpoint.load(path, fresh, None)
    saved, loaded = dict(chunks[0].named_parameters()), dict(fresh[0].named_parameters())
    result["unequal"] = [name for name in saved if not torch.equal(saved[name], loaded[name])]
    result["parameters"] = len(saved)
    parallel_state.destroy_model_parallel()
    return result


@pytest.mark.slow
def test_a_tied_output_weight_on_the_mtp_stage_saves_and_loads(tmp_path: Path) -> None:
    hf_checkpoint = make_tiny_checkpoint(tmp_path / "tied", "qwen3", mtp=True, tied=True)
    first, last = run_distributed(_save_and_load, tmp_path, str(tmp_path), str(hf_checkpoint))
    assert (first["output_weight"], last["output_weight"]) == (False, True)  # the MTP stage's unused weight
    assert (first["upstream"], last["upstream"]) == ("saved", "refused")
    for result in (first, last):
        assert result["parameters"] and result["unequal"] == []
