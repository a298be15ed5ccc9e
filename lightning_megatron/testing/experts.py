"""The routed experts of the tiny MoE checkpoints (`testing.checkpoints`): their shape, config fields and tensors in
each family's HF naming (Qwen3-MoE, Qwen2-MoE's gated shared expert, GLM-4.5's and DeepSeek-V3's dense first layers,
expert bias and shared experts, Qwen3.5-MoE's packed experts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lightning_megatron.families import MODEL_FAMILIES, MOE_MODEL_TYPES
from lightning_megatron.testing import qwen3_5


class CheckpointShape(Protocol):
    """The sizes of `testing.checkpoints.CheckpointShape` the experts are sized by."""

    hidden_size: int


@dataclass(frozen=True)
class MoEShape:
    """The routed experts of an MoE checkpoint: ``num_experts`` experts of FFN size ``intermediate_size`` (default
    ``hidden_size // 2``), each token going to ``top_k``; ``norm_topk_prob`` renormalises the chosen experts'
    probabilities; Qwen2-MoE adds a sigmoid-gated shared expert of size ``shared_expert_intermediate_size``
    (default ``hidden_size``). GLM-4.5 keeps its first ``first_dense_layers`` layers dense, adds one ungated shared
    expert of the experts' size and scales the routing weights by ``routed_scaling_factor``."""

    num_experts: int = 4
    top_k: int = 2
    intermediate_size: int | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 1e-3
    shared_expert_intermediate_size: int | None = None
    first_dense_layers: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # DeepSeek-V3's group-limited routing: experts in n_group groups, tokens routed within the
    topk_group: int = 1  # topk_group groups whose two best experts score highest
    packed_mtp_experts: bool = False  # Qwen3.5-MoE's MTP layer stores its experts packed, as its decoder layers do
    # (Qwen3.6's checkpoints); Qwen3.5's store them one by one


def check_moe_shape(family: str, moe: MoEShape | None) -> MoEShape | None:
    if not MODEL_FAMILIES[family].moe:
        if moe is not None:
            raise ValueError(f"moe= applies to the MoE families {MOE_MODEL_TYPES}, not {family!r}")
        return None
    moe = moe or MoEShape()
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
        raise ValueError(f"MoEShape: top_k={moe.top_k} must be between 1 and num_experts={moe.num_experts}")
    if family == qwen3_5.MOE_MODEL_TYPE and not moe.norm_topk_prob:
        raise ValueError(f"MoEShape: norm_topk_prob=False is not {family!r}'s router, which always renormalises the "
                         "top k; use norm_topk_prob=True")
    if moe.packed_mtp_experts and family != qwen3_5.MOE_MODEL_TYPE:
        raise ValueError(f"MoEShape: packed_mtp_experts=True is Qwen3.5-MoE's (Qwen3.6's) layout, not {family!r}'s")
    return moe


def moe_config_fields(family: str, moe: MoEShape, shape: CheckpointShape) -> dict[str, Any]:
    expert_size, shared_size = _moe_intermediate_sizes(moe, shape)
    fields: dict[str, Any] = dict(
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        router_aux_loss_coef=moe.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    fields["moe_intermediate_size"] = expert_size
    if family in ("qwen2_moe", qwen3_5.MOE_MODEL_TYPE):
        fields["shared_expert_intermediate_size"] = shared_size
    if family == qwen3_5.MOE_MODEL_TYPE:  # its router always renormalises the top k; every layer is MoE
        for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            del fields[key]
    if family in ("glm4_moe", "deepseek_v3"):  # their router: no auxiliary-loss coefficient, no decoder_sparse_step
        for key in ("num_experts", "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers"):
            del fields[key]
        fields.update(n_routed_experts=moe.num_experts, n_shared_experts=1, first_k_dense_replace=moe.first_dense_layers,
                      routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_group, topk_group=moe.topk_group)
    return fields


def _moe_intermediate_sizes(moe: MoEShape, shape: CheckpointShape) -> tuple[int, int]:
    expert = shape.hidden_size // 2 if moe.intermediate_size is None else moe.intermediate_size
    shared = shape.hidden_size if moe.shared_expert_intermediate_size is None else moe.shared_expert_intermediate_size
    return expert, shared


def with_experts(family: str, shapes: dict[str, tuple[int, ...]], moe: MoEShape | None, shape: CheckpointShape,
                  config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every dense MLP (``<layer>.mlp.{gate,up,down}_proj``) replaced by a router and routed experts, in HF naming."""
    if moe is None:
        return shapes
    hidden_size = shape.hidden_size
    expert_size, shared_size = _moe_intermediate_sizes(moe, shape)
    shared_experts_size = expert_size * int(config.get("n_shared_experts") or 0)  # GLM-4.5's and DeepSeek-V3's
    result: dict[str, tuple[int, ...]] = {}
    first_dense = family in ("glm4_moe", "deepseek_v3")
    dense = tuple(f"model.layers.{i}." for i in range(moe.first_dense_layers)) if first_dense else ()
    for name, tensor_shape in shapes.items():
        if name.startswith(dense) or not name.endswith((".mlp.gate_proj.weight", ".mlp.up_proj.weight",
                                                        ".mlp.down_proj.weight")):
            result[name] = tensor_shape
            continue
        if not name.endswith(".mlp.gate_proj.weight"):
            continue
        mlp = name.removesuffix("gate_proj.weight")
        result[f"{mlp}gate.weight"] = (moe.num_experts, hidden_size)
        packed = qwen3_5.packs_experts(family, mlp, moe.packed_mtp_experts)
        if packed:
            result.update(qwen3_5.packed_expert_shapes(mlp, moe.num_experts, hidden_size, expert_size))
        for expert in range(0 if packed else moe.num_experts):
            result[f"{mlp}experts.{expert}.gate_proj.weight"] = (expert_size, hidden_size)
            result[f"{mlp}experts.{expert}.up_proj.weight"] = (expert_size, hidden_size)
            result[f"{mlp}experts.{expert}.down_proj.weight"] = (hidden_size, expert_size)
        if family in ("qwen2_moe", qwen3_5.MOE_MODEL_TYPE):
            result[f"{mlp}shared_expert.gate_proj.weight"] = (shared_size, hidden_size)
            result[f"{mlp}shared_expert.up_proj.weight"] = (shared_size, hidden_size)
            result[f"{mlp}shared_expert.down_proj.weight"] = (hidden_size, shared_size)
            result[f"{mlp}shared_expert_gate.weight"] = (1, hidden_size)
        if family in ("glm4_moe", "deepseek_v3"):
            result[f"{mlp}gate.e_score_correction_bias"] = (moe.num_experts,)
        if shared_experts_size:
            result[f"{mlp}shared_experts.gate_proj.weight"] = (shared_experts_size, hidden_size)
            result[f"{mlp}shared_experts.up_proj.weight"] = (shared_experts_size, hidden_size)
            result[f"{mlp}shared_experts.down_proj.weight"] = (hidden_size, shared_experts_size)
    return result
