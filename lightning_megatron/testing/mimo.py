"""MiMo's remote code, written beside a tiny MiMo checkpoint so that transformers can load it (trust_remote_code).

MiMo (XiaomiMiMo/MiMo-7B) is Qwen2 plus MTP layers; its modeling code only declares them. The MTP module and
attribute names are filled in from the family table (`lightning_megatron.families`), so the classes always hold
exactly the tensor names the rest of the package reads.
"""

from __future__ import annotations

from pathlib import Path

from lightning_megatron.families import mtp_names

_CONFIGURATION_PY = '''\
"""MiMo configuration: Qwen2 plus a number of MTP (next-n prediction) layers."""

from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    num_nextn_predict_layers: int = 1
'''

_MODELING_PY_TEMPLATE = '''\
"""MiMo = Qwen2 with MTP layers under model.{container}.N, laid out as in XiaomiMiMo/MiMo-7B.

The MTP layers are only declared here, so the checkpoint loads without missing or unexpected keys; the forward
pass is plain Qwen2. Each MTP layer is a Qwen2 decoder layer (input_layernorm, self_attn, post_attention_layernorm,
mlp) plus {embedding_norm}, {hidden_norm}, {projection} (applied to cat([hidden, embedding])) and {final_norm}.
"""

from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2Model, Qwen2RMSNorm

from .configuration_mimo import MiMoConfig


class MiMoMTPLayer(Qwen2DecoderLayer):
    def __init__(self, config: MiMoConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.{embedding_norm} = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.{hidden_norm} = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.{projection} = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.{final_norm} = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MiMoModel(Qwen2Model):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig) -> None:
        super().__init__(config)
        # MiMo builds every MTP attention with layer_idx 0.
        self.{container} = nn.ModuleList([MiMoMTPLayer(config, 0) for _ in range(config.num_nextn_predict_layers)])
        self.post_init()


class MiMoForCausalLM(Qwen2ForCausalLM):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig) -> None:
        super().__init__(config)
        self.model = MiMoModel(config)
        self.post_init()
'''


def write_mimo_remote_code(folder: Path) -> None:
    """Write ``configuration_mimo.py`` and ``modeling_mimo.py`` (the files config.json's ``auto_map`` names)."""
    names = mtp_names("mimo")
    layer = names.layer.format(i=0)
    attributes = {role: name.removeprefix(layer).removesuffix(".weight") for role, name in names.head(0).items()}
    container = names.prefix.removeprefix("model.").removesuffix(".")
    (folder / "configuration_mimo.py").write_text(_CONFIGURATION_PY)
    (folder / "modeling_mimo.py").write_text(_MODELING_PY_TEMPLATE.format(container=container, **attributes))
