"""What "MoE" means for the project, in one place: the router an HF checkpoint asks for, the expert-parallel sizes it
allows, and the load-balancing loss as a per-step metric.

Each bridge derives Megatron's router settings from the HF config its own way (mbridge hard-codes pre-softmax
routing and no load balancing for Qwen3-MoE; megatron-bridge hard-codes the aux-loss coefficient), so the project
derives them once from the HF config, hands them to the bridge as config overrides and checks the built model.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_megatron.families import MOE_MODEL_TYPES, text_model_config

# Router fields an HF checkpoint fixes: a different value computes a different model.
CHECKPOINT_ROUTER_FIELDS = (
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_topk_scaling_factor",
    "moe_layer_freq",
    "moe_router_num_groups",
    "moe_router_group_topk",
)
# The load-balancing losses Megatron-Core's router records in its MoE metrics tracker (moe/router.py).
LOAD_BALANCING_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")


# transformers' class defaults of the router fields a GLM-4.5 or DeepSeek-V3 config.json may leave out
# (configuration_glm4_moe.py:97-103, configuration_deepseek_v3.py:78-90): an absent field means what it means there
SIGMOID_ROUTER_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                 "first_k_dense_replace": 1, "norm_topk_prob": True},
    "deepseek_v3": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                    "first_k_dense_replace": 3, "norm_topk_prob": True},
}

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # transformers 5 writes num_local_experts


def checkpoint_num_experts(hf_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer declared by an HF config (its text model's: `families.text_model_config`; 0 for
    a dense model)."""
    config = text_model_config(hf_config)
    return next((int(config[key]) for key in EXPERT_COUNT_KEYS if config.get(key)), 0)


def router_settings(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Megatron `TransformerConfig` MoE fields equivalent to an HF MoE config; empty for a dense one.

    Qwen-MoE routes with a softmax over all experts, keeps the top k and, with `norm_topk_prob`, renormalises them:
    Megatron's `moe_router_pre_softmax=False` (softmax over the top-k logits) is that renormalised softmax,
    `True` the plain one. The HF load-balancing coefficient `router_aux_loss_coef` becomes Megatron's `aux_loss`.
    Qwen2-MoE and Qwen3.5-MoE add a shared expert gated by a sigmoid; Qwen3.5-MoE always renormalises (its config
    has no `norm_topk_prob`).

    GLM-4.5 routes with a sigmoid, picks the top k of `sigmoid + e_score_correction_bias` (Megatron's expert bias),
    renormalises the chosen sigmoids and scales them by `routed_scaling_factor`; its first `first_k_dense_replace`
    layers are dense (`moe_layer_freq`) and every MoE layer adds one ungated shared expert. The checkpoint's
    expert bias is kept as it is (`moe_router_bias_update_rate: 0`, as megatron-bridge's GLM-4.5 provider does):
    a positive rate updates it every step from the routed token counts.

    DeepSeek-V3 routes as GLM-4.5 does, but only among the experts of the `topk_group` of its `n_group` expert
    groups that score best, a group's score being the sum of its two best experts' biased sigmoids. Megatron-Core
    sums the best `num_experts_per_tok // topk_group` (`moe_utils.group_limited_topk`), so it routes DeepSeek-V3's
    way only where that is 2 (DeepSeek-V3: 8 // 4) or where every group is kept (`topk_group` >= `n_group`, Kimi-K2
    and Moonlight's n_group 1); other checkpoints are refused. Its load-balancing loss is sequence-wise, weighted by
    the config's `aux_loss_alpha` (0 when absent: transformers trains none).
    """
    if not checkpoint_num_experts(hf_config):
        return {}
    hf_config = text_model_config(hf_config)  # a multimodal checkpoint's router is its text model's
    model_type = hf_config.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(f"hf_checkpoint: MoE model_type {model_type!r} is not supported; the MoE families are "
                         f"{', '.join(MOE_MODEL_TYPES)}")
    if model_type == "glm4_moe":
        return _glm4_moe_router_settings(_with_router_defaults(hf_config))
    if model_type == "deepseek_v3":
        return _deepseek_v3_router_settings(_with_router_defaults(hf_config))
    if hf_config.get("mlp_only_layers") or int(hf_config.get("decoder_sparse_step", 1)) != 1:
        raise ValueError("hf_checkpoint: dense layers between MoE layers (mlp_only_layers, decoder_sparse_step != 1) "
                         "are not mapped by the bridges; use a checkpoint whose every layer is MoE")
    settings: dict[str, Any] = {
        "num_moe_experts": checkpoint_num_experts(hf_config),
        "moe_router_topk": int(hf_config["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(hf_config["moe_intermediate_size"]),
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not hf_config.get("norm_topk_prob", False),
        "moe_router_enable_expert_bias": False,
        "moe_shared_expert_intermediate_size": None,
        "moe_shared_expert_gate": False,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf_config.get("router_aux_loss_coef", 0.0)),
        "moe_token_dispatcher_type": "alltoall",
    }
    if model_type == "qwen3_5_moe_text":  # its router (Qwen3_5MoeTopKRouter) always renormalises the top k
        settings["moe_router_pre_softmax"] = False
    if settings["moe_router_topk"] == 1 and not settings["moe_router_pre_softmax"]:
        qwen3_5 = model_type == "qwen3_5_moe_text"
        renormalised = "Qwen3.5-MoE's router always renormalises it" if qwen3_5 else "norm_topk_prob: true"
        raise ValueError(f"hf_checkpoint: num_experts_per_tok: 1 renormalised ({renormalised}: every token's one "
                         "expert weighted 1) is refused by Megatron-Core, which routes top-1 only after a softmax over "
                         "all experts (transformer_config.py: moe_router_pre_softmax); use a checkpoint with "
                         "num_experts_per_tok > 1" + ("" if qwen3_5 else " or norm_topk_prob: false"))
    if model_type in ("qwen2_moe", "qwen3_5_moe_text"):
        settings["moe_shared_expert_intermediate_size"] = int(hf_config["shared_expert_intermediate_size"])
        settings["moe_shared_expert_gate"] = True
    return settings


def _with_router_defaults(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A GLM-4.5 or DeepSeek-V3 text config with the router fields it leaves out at transformers' defaults."""
    return {**SIGMOID_ROUTER_DEFAULTS.get(hf_config.get("model_type"), {}), **hf_config}


def _glm4_moe_router_settings(hf_config: dict[str, Any]) -> dict[str, Any]:
    top_k, renormalised = int(hf_config["num_experts_per_tok"]), bool(hf_config.get("norm_topk_prob", True))
    if top_k > 1 and not renormalised:
        raise ValueError("hf_checkpoint: norm_topk_prob: false with sigmoid routing is not expressible in Megatron-Core "
                         "(moe_utils.topk_routing_with_score_function always renormalises the top-k sigmoids); use a "
                         "checkpoint with norm_topk_prob: true")
    if top_k == 1 and renormalised:
        raise ValueError("hf_checkpoint: num_experts_per_tok: 1 with norm_topk_prob: true (every token's one expert "
                         "weighted 1) is not expressible in Megatron-Core, which weights a lone top-1 sigmoid as it is "
                         "(moe_utils.topk_routing_with_score_function); use a checkpoint with num_experts_per_tok > 1 "
                         "or norm_topk_prob: false")
    if int(hf_config.get("n_group") or 1) != 1 or int(hf_config.get("topk_group") or 1) != 1:
        raise ValueError(f"hf_checkpoint: group-limited routing (n_group: {hf_config.get('n_group')}, topk_group: "
                         f"{hf_config.get('topk_group')}) is not supported; use a checkpoint with n_group: 1")
    num_layers, first_dense = int(hf_config["num_hidden_layers"]), int(hf_config.get("first_k_dense_replace", 0))
    shared_experts = int(hf_config.get("n_shared_experts", 1))  # 0: HF's shared MLP has no channels, adds nothing
    return {
        "num_moe_experts": checkpoint_num_experts(hf_config),
        "moe_router_topk": top_k,
        "moe_ffn_hidden_size": int(hf_config["moe_intermediate_size"]),
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_topk_scaling_factor": float(hf_config.get("routed_scaling_factor", 1.0)),
        # HF's shared experts are one MLP of this size (modeling_glm4_moe.py:378-380, modeling_deepseek_v3.py:204-206);
        # megatron-bridge's GLM-4.5 bridge (glm/glm45_bridge.py:88) and mbridge's (models/glm4moe.py:148) size it
        # moe_intermediate_size alone: a checkpoint with n_shared_experts: 2 would not load (a shape error). With
        # n_shared_experts: 0 HF's MLP has no channels (it adds zero), Megatron's None builds none (0 is refused)
        "moe_shared_expert_intermediate_size": int(hf_config["moe_intermediate_size"]) * shared_experts or None,
        "moe_shared_expert_gate": False,
        "moe_shared_expert_overlap": False,  # overlaps the shared expert on a second CUDA stream
        "moe_layer_freq": [0] * first_dense + [1] * (num_layers - first_dense),
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf_config.get("router_aux_loss_coef", 0.0)),
        "moe_token_dispatcher_type": "alltoall",
    }


def _deepseek_v3_router_settings(hf_config: dict[str, Any]) -> dict[str, Any]:
    top_k, groups = int(hf_config["num_experts_per_tok"]), int(hf_config.get("n_group") or 1)
    group_topk = int(hf_config.get("topk_group") or 1)
    if group_topk < groups and top_k // group_topk != 2:
        raise ValueError(
            f"hf_checkpoint: num_experts_per_tok: {top_k} with topk_group: {group_topk} of n_group: {groups} is not "
            f"routable the HF way: Megatron-Core scores an expert group by its best num_experts_per_tok // "
            f"topk_group = {top_k // group_topk} experts (moe_utils.group_limited_topk), DeepSeek-V3 by its best 2; "
            "use a checkpoint with num_experts_per_tok // topk_group == 2, or with topk_group == n_group")
    settings = _glm4_moe_router_settings({**hf_config, "n_group": 1, "topk_group": 1})
    settings.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk,
                    moe_router_load_balancing_type="seq_aux_loss",
                    moe_aux_loss_coeff=float(hf_config.get("aux_loss_alpha") or 0.0))
    return settings


def check_mtp_layer_experts(hf_config: dict[str, Any]) -> None:
    """GLM-4.5's and DeepSeek-V3's MTP layer is decoder layer `num_hidden_layers`, past the `first_k_dense_replace`
    dense ones, so it has routed experts; Megatron-Core builds the MTP layer with the last decoder layer's spec
    (megatron/core/models/gpt/gpt_layer_specs.py:769), so a checkpoint whose decoder layers are all dense would get a
    dense MTP layer that leaves the stored experts unloaded."""
    config = _with_router_defaults(text_model_config(hf_config))
    first_dense, num_layers = int(config.get("first_k_dense_replace") or 0), int(config.get("num_hidden_layers") or 0)
    if checkpoint_num_experts(hf_config) and first_dense >= num_layers:
        raise ValueError(f"hf_checkpoint: first_k_dense_replace: {first_dense} makes all {num_layers} decoder layers "
                         "dense, and Megatron-Core builds the MTP layer as the last decoder layer, while the "
                         f"checkpoint's MTP layer (decoder layer {num_layers}) has routed experts; set mtp: false, or "
                         "use a checkpoint with first_k_dense_replace < num_hidden_layers")


def moe_config_overrides(hf_config: dict[str, Any], config_overrides: dict[str, Any]) -> dict[str, Any]:
    """`config_overrides` with the checkpoint's router settings added; refuses overrides that contradict it."""
    settings = router_settings(hf_config)
    if not settings:
        return config_overrides
    for field in CHECKPOINT_ROUTER_FIELDS:
        if field in config_overrides and field in settings and config_overrides[field] != settings[field]:
            raise ValueError(f"config_overrides.{field}: {config_overrides[field]!r} contradicts the checkpoint, "
                             f"whose config.json asks for {settings[field]!r}; remove the override")
    return {**settings, **config_overrides}


def check_router_matches(model_config: Any, hf_config: dict[str, Any], config_overrides: dict[str, Any]) -> None:
    """Raise when a bridge built a router other than the one the checkpoint and the overrides ask for."""
    expected = moe_config_overrides(hf_config, config_overrides)
    for field in (*CHECKPOINT_ROUTER_FIELDS, "moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if field in expected and getattr(model_config, field, None) != expected[field]:
            raise RuntimeError(f"the bridge built {field}={getattr(model_config, field, None)!r} but the "
                               f"checkpoint asks for {expected[field]!r}; the model would not be the checkpoint's")


def start_moe_metrics(model_config: Any) -> None:
    """A fresh MoE metrics tracker for a newly built model: Megatron-Core's is process-global and sizes its per-layer
    buffers by the first model that records (a later model with more layers, e.g. an MTP layer, overruns them)."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    if model_config.num_moe_experts:
        destroy_moe_metrics_tracker()


def check_expert_parallel(hf_config: dict[str, Any], expert_model_parallel_size: int,
                          expert_tensor_parallel_size: int) -> None:
    """What expert parallelism needs from the checkpoint, checked before the model is built."""
    num_experts = checkpoint_num_experts(hf_config)
    hf_config = text_model_config(hf_config)
    if expert_model_parallel_size > 1 and not num_experts:
        raise ValueError(f"expert_model_parallel_size: {expert_model_parallel_size} needs an MoE checkpoint; this "
                         "one has no experts (num_experts in config.json); set expert_model_parallel_size: 1")
    if num_experts and num_experts % expert_model_parallel_size:
        raise ValueError(f"expert_model_parallel_size: {expert_model_parallel_size} must divide the checkpoint's "
                         f"{num_experts} experts (num_experts in config.json); use a divisor of {num_experts}")
    moe_ffn = int(hf_config.get("moe_intermediate_size") or 0)
    if num_experts and moe_ffn % expert_tensor_parallel_size:
        raise ValueError(f"expert_tensor_parallel_size: {expert_tensor_parallel_size} must divide the experts' "
                         f"FFN size {moe_ffn} (moe_intermediate_size in config.json)")


def check_moe_sequence_parallel(hf_config: dict[str, Any], tensor_model_parallel_size: int,
                                sequence_parallel: bool) -> None:
    """Megatron-Core's MoE layer refuses to train with tensor parallelism but no sequence parallelism
    (moe/moe_layer.py), after the model is built and loaded: refuse it first."""
    if checkpoint_num_experts(hf_config) and tensor_model_parallel_size > 1 and not sequence_parallel:
        raise ValueError("sequence_parallel: an MoE model with tensor_model_parallel_size: "
                         f"{tensor_model_parallel_size} trains only with sequence parallelism in Megatron-Core; "
                         "set sequence_parallel: true")


def check_expert_parallel_world(world_size: int, expert_model_parallel_size: int, expert_tensor_parallel_size: int,
                                pipeline_model_parallel_size: int) -> None:
    """Megatron lays experts out over EP x ETP ranks in each pipeline stage; they must tile the world."""
    expert_ranks = expert_model_parallel_size * expert_tensor_parallel_size * pipeline_model_parallel_size
    if world_size % expert_ranks:
        raise ValueError(
            f"world size {world_size} is not a multiple of expert_model_parallel_size x expert_tensor_parallel_size "
            f"x pipeline_model_parallel_size = {expert_model_parallel_size} x {expert_tensor_parallel_size} x "
            f"{pipeline_model_parallel_size}; change devices/num_nodes or expert_model_parallel_size"
        )


def read_and_reset_moe_aux_loss(model_config: Any, num_microbatches: int) -> torch.Tensor | None:
    """Megatron-Core's MoE metrics tracker (summed over microbatches and layers until reported) as one metric.

    The load-balancing loss(es) before their coefficient, averaged over MoE layers, microbatches and data-parallel
    ranks, as Megatron-LM reports them (`MoEMetricsTracker.report`); every microbatch routes the same number of
    tokens, so this is the mean over all routed tokens. Every rank must call it; None when the router records none.
    The loss stays where the tracker keeps it (the device): Lightning reads it on the host only when it logs.
    """
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    if not model_config.num_moe_experts:
        return None
    load_balancing_type = model_config.moe_router_load_balancing_type
    types = load_balancing_type if isinstance(load_balancing_type, list) else [load_balancing_type]
    names = [name for name, kind in zip(LOAD_BALANCING_LOSSES, ("aux_loss", "seq_aux_loss", "global_aux_loss"))
             if kind in types]
    if not names:
        return None
    totals: dict[str, Any] = {}
    get_moe_metrics_tracker().report(
        loss_scale=1 / num_microbatches, iteration=0, force_initialize=True, track_names=names,
        num_layers=model_config.num_layers, moe_layer_freq=model_config.moe_layer_freq,
        mtp_num_layers=model_config.mtp_num_layers, total_loss_dict=totals,
    )
    return sum(torch.as_tensor(totals[name], dtype=torch.float32) for name in names)
