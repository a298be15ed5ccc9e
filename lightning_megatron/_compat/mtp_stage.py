"""Megatron-Core 0.19's sharded checkpoint of a pipeline stage that holds the MTP layers but not the embedding, with
tied embeddings (a checkpoint with `tie_word_embeddings`, e.g. Qwen3.5-0.8B, at PP > 1 with its MTP head).

The MTP stage keeps its own copy of the embedding, and with tied embeddings that copy is the output layer's weight
(`LanguageModule.shared_embedding_or_output_weight`, `models/common/language_module/language_module.py:346`: the
forward hands it to the output layer). Yet `GPTModel` allocates an output-layer weight there too
(`models/gpt/gpt_model.py:281`: skipped on the first stage only), which megatron-bridge fills with the embedding
(`conversion/model_bridge.py:1612`) and no forward reads, while `tie_embeddings_and_output_weights_state_dict`
(`language_module.py:495-498`) asserts the MTP stage's output layer has none: every sharded checkpoint save of such a
model fails. The adjustment saves and loads that weight as a replica of the embedding, as upstream does for the output
layer of a last stage without MTP (`language_module.py:500-515`): the main replica stays the first stage's embedding.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from lightning_megatron._compat._adjustment import Adjustment, Patches


def _allocates_the_mtp_stages_output_weight() -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    return re.search(r"skip_weight_param_allocation=self\.pre_process\s+and self\.share_embeddings_and_output_weights",
                     inspect.getsource(GPTModel.__init__)) is not None


def _install_output_weight_as_an_embedding_replica(patches: Patches) -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.utils import get_pg_rank, make_tp_sharded_tensor_for_checkpoint

    tie = LanguageModule.tie_embeddings_and_output_weights_state_dict

    @functools.wraps(tie)
    def tie_on_the_mtp_stage_too(model: Any, sharded_state_dict: Any, output_layer_weight_key: str,
                                 first_stage_word_emb_key: str, metadata: dict | None = None) -> None:
        metadata = metadata or {}
        if not (model.post_process and not model.pre_process and getattr(model, "mtp_process", False)
                and output_layer_weight_key in sharded_state_dict):
            return tie(model, sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key, metadata)
        sharded_state_dict[output_layer_weight_key] = make_tp_sharded_tensor_for_checkpoint(
            tensor=model.output_layer.weight, key=first_stage_word_emb_key,
            replica_id=(2, 0, get_pg_rank(metadata["dp_cp_group"])),  # (1, ...): the MTP stage's embedding copy
            allow_shape_mismatch=True, tp_group=model.tp_group, dp_cp_group=metadata["dp_cp_group"])
        return None

    patches.setattr(LanguageModule, "tie_embeddings_and_output_weights_state_dict", tie_on_the_mtp_stage_too)


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.tied_output_weight_saved_on_the_mtp_stage",
        "models/gpt/gpt_model.py:281 allocates an output-layer weight on the MTP stage that "
        "models/common/language_module/language_module.py:495-498 asserts is absent (tied embeddings, PP > 1)",
        _allocates_the_mtp_stages_output_weight,
        _install_output_weight_as_an_embedding_replica,
    ),
)
