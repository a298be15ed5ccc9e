"""Rotary embeddings by depth for tree-packed rows, and the checks tree rows need at the model.

In a tree row (``data/tree.py``) a token's position is its depth in the trie, which is its index in every original
sequence through it, not its flat index in the row. Megatron-Core's ``GPTModel`` with ``rope`` ignores
``position_ids``: ``rotary_pos_emb(seq_len)`` returns the table of positions ``0..seq_len-1`` (``[s, 1, 1, d]``),
which every layer of the decoder and of the MTP block then applies by flat index. :func:`install_depth_rotary`
hooks every chunk so that, while a tree microbatch runs (Megatron's ``attention_mask`` is then the integer
``subtree_end`` of the layout contract, ``lightning_megatron.microbatch``), the table is gathered at ``position_ids``
instead. Other microbatches are left exactly as they were. The hooks sit on the model the bridge built, so they work
for every bridge.

The same hook refuses, before the first tree microbatch runs, what tree rows cannot do: more than one row per
microbatch (the rotary table is shared by the batch), weights that are not integer counts (the loss normaliser
counts original tokens), and an MTP head (Megatron-Core's MTP rolls inputs and labels along the flat row, which
takes the wrong child at every branch point).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

_GPT_FORWARD_ARGS = ("input_ids", "position_ids", "attention_mask")


def install_depth_rotary(chunks: list[torch.nn.Module]) -> list[RemovableHandle]:
    """Hook every model chunk (main decoder and MTP layers share its rotary table); returns the handles."""
    from megatron.core.utils import unwrap_model

    handles: list[RemovableHandle] = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        rotaries = _rotary_tables(model)
        if not rotaries:
            continue
        state: dict[str, torch.Tensor | None] = {"positions": None}
        handles.append(model.register_forward_pre_hook(_remember_depths(model, state), with_kwargs=True))
        handles.append(model.register_forward_hook(_forget_depths(state), always_call=True))
        handles.extend(rotary.register_forward_hook(_gather_at_depths(state)) for rotary in rotaries)
    return handles


def _rotary_tables(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that make the rotary tables: the model's one, or each multi-latent attention layer's own
    (DeepSeek-V3's MLA builds its YaRN table inside every attention layer; GPTModel then has none)."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None and getattr(model, "position_embedding_type", None) in ("rope", "yarn"):
        return [rotary]
    return [module.rotary_pos_emb for module in model.modules() if isinstance(module, MultiLatentAttention)]


def _remember_depths(model: torch.nn.Module, state: dict[str, torch.Tensor | None]) -> Any:
    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        values = dict(zip(_GPT_FORWARD_ARGS, args)) | kwargs
        attention_mask = values.get("attention_mask")
        is_tree = isinstance(attention_mask, torch.Tensor) and not (
            attention_mask.dtype.is_floating_point or attention_mask.dtype == torch.bool
        )
        state["positions"] = None
        if is_tree:
            check_tree_forward(model, values)
            state["positions"] = values["position_ids"]

    return hook


def _forget_depths(state: dict[str, torch.Tensor | None]) -> Any:
    def hook(_module: torch.nn.Module, _args: tuple, _output: Any) -> None:
        state["positions"] = None

    return hook


def _gather_at_depths(state: dict[str, torch.Tensor | None]) -> Any:
    def hook(_module: torch.nn.Module, _args: tuple, output: Any) -> Any:
        positions = state["positions"]
        if positions is None:
            return None
        if isinstance(output, tuple):  # YaRN: (table, mscale)
            return (output[0][positions[0].to(output[0].device)], *output[1:])
        return output[positions[0].to(output.device)]  # [s, 1, 1, d] at each token's depth

    return hook


def check_tree_forward(model: torch.nn.Module, values: dict[str, Any]) -> None:
    """Raise, naming the fix, on a tree microbatch this model cannot run exactly."""
    position_ids = values.get("position_ids")
    if position_ids is None:
        raise ValueError("position_ids: a tree microbatch needs each token's depth as position_ids")
    if position_ids.dim() != 2 or position_ids.size(0) != 1:
        raise ValueError(f"micro_batch_size: tree rows run one per microbatch (the rotary table is shared by the "
                         f"batch), got position_ids of shape {tuple(position_ids.shape)}; set micro_batch_size: 1")
    if values.get("packed_seq_params") is not None:
        raise ValueError("packed_seq_params: a tree row carries its structure in subtree_end alone; drop cu_seqlens")
    loss_mask = values.get("loss_mask")
    if loss_mask is not None and not bool((loss_mask == loss_mask.round()).all()):
        raise ValueError("loss_mask: tree rows weigh each label by the number of original sequences training it, an "
                         "integer; the loss normaliser counts original tokens, so non-integer weights are refused "
                         "(build the rows with lightning_megatron.data.tree.build_tree_rows)")
    if getattr(model, "mtp_process", False):
        raise ValueError("enable_mtp: tree rows cannot go through the MTP head (Megatron-Core's MTP rolls inputs and "
                         "labels along the flat row, taking the wrong child at branch points and mixing subtrees); "
                         "set model.enable_mtp: false, or data.packing: true")
