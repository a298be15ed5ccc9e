"""HF checkpoint loads in which every rank reads only the slices of the checkpoint its parameters hold.

Both libraries load the same way: tensor-parallel rank 0 reads whole HF tensors, converts them on the host
(QKV interleaved, gate and up concatenated), splits them and scatters the parts; mbridge also rebuilds the model's
`state_dict()` for every parameter. Here each rank plans every parameter as `Piece`s, views into the parameter
each filled by one slice of one checkpoint tensor (or zeros, for vocabulary padding), and several threads copy
them straight from the memory-mapped files (`hf_io.Copier`): no host-side concatenation, no scatter, each file
opened once.

A plan is made only for the conversions whose layout is known exactly: a tensor copied whole or split evenly along
one dimension (with zero rows past the vocabulary), QKV interleaved by query group, gate and up stacked, each cast
as the library casts it; and only when the library's own code for it is the stock one (a subclass overriding a
conversion, a mapping type not listed here, a shape that does not add up: the parameter goes through the library's
own conversion instead, on whole tensors from the same reader). So the parameters are bit for bit what the
library's loader gives (tests compare every parameter).

This is a faster path through library internals, not a workaround of a CPU/Transformer Engine limit, so it lives
with the bridges and not in `_compat`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.hf_io import CheckpointReader, Copier, LoadReport, Piece, Source, checked_pieces

Plan = list[Piece] | None


def whole_pieces(target: torch.Tensor, name: str) -> Plan:
    return [Piece(target, Source(name))]


def split_pieces(target: torch.Tensor, name: str, shape: Sequence[int], dim: int, parts: int, rank: int,
                 padded: int | None = None) -> Plan:
    """`target` is part `rank` of `parts` equal parts along `dim` of tensor `name` (of `shape`), which is first
    padded with zeros to `padded` along `dim` (a vocabulary rounded up)."""
    if target.ndim != len(shape) or not 0 <= dim < target.ndim:
        return None
    full, size = padded or shape[dim], target.shape[dim]
    if size * parts != full or full < shape[dim]:
        return None
    if parts == 1 and full == shape[dim]:
        return whole_pieces(target, name)
    start = rank * size
    held = max(0, min(size, shape[dim] - start))
    pieces = [Piece(target.narrow(dim, 0, held), Source(name, dim, start, start + held))] if held else []
    if held < size:
        pieces.append(Piece(target.narrow(dim, held, size - held), None))
    return pieces


def stacked_pieces(target: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]], parts: int,
                   rank: int) -> Plan:
    """`target` is part `rank` of each of `names` (split evenly along dim 0), stacked: gate and up."""
    if len(set(map(tuple, shapes))) != 1 or shapes[0][0] % parts:
        return None
    rows = shapes[0][0] // parts
    return [Piece(target.narrow(0, index * rows, rows), Source(name, 0, rank * rows, (rank + 1) * rows))
            for index, name in enumerate(names)]


def qkv_pieces(target: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]], *, heads: int,
               groups: int, head_dim: int, parts: int, rank: int) -> Plan:
    """`target` is part `rank` of Megatron's fused QKV: per query group its query heads, then its key and its value
    head, the groups split evenly over the parts."""
    if groups % parts or heads % groups or len({tuple(shape[1:]) for shape in shapes}) != 1:
        return None
    if [shape[0] for shape in shapes] != [heads * head_dim, groups * head_dim, groups * head_dim]:
        return None
    local, per_group, rest = groups // parts, heads // groups, tuple(shapes[0][1:])
    if target.numel() != local * (per_group + 2) * head_dim * int(torch.Size(rest).numel()):
        return None
    grouped = target.view(local, per_group + 2, head_dim, *rest)
    pieces = []
    for name, first, count in zip(names, (0, per_group, per_group + 1), (per_group, 1, 1)):
        rows = local * count * head_dim
        pieces.append(Piece(grouped[:, first:first + count],
                            Source(name, 0, rank * rows, (rank + 1) * rows, (local, count, head_dim, *rest))))
    return pieces


# mbridge -----------------------------------------------------------------------------------------------------------


def load_mbridge(bridge: Any, chunks: list[torch.nn.Module], folder: str | Path) -> LoadReport:
    """mbridge's `Bridge.load_weights`, each rank reading its own slices (the library's own loader where the bridge
    class replaces how it reads or loads)."""
    from mbridge.core.bridge import Bridge

    kind = type(bridge)
    if kind.load_weights is not Bridge.load_weights or kind._get_safetensor_io is not Bridge._get_safetensor_io:
        bridge.load_weights(chunks, str(folder))
        return LoadReport(library=True)
    stock = all(getattr(kind, name) is getattr(Bridge, name)
                for name in ("_weight_to_mcore_format", "_weight_split_across_tp"))
    bridge.safetensor_io = bridge._get_safetensor_io(str(folder))  # as its loader leaves it (its save_weights uses it)
    report = LoadReport()
    reader = CheckpointReader(folder)
    with Copier(reader) as copier:
        for model in chunks:
            state = model.state_dict()
            for local_name, global_name in bridge._weight_name_mapping_mcore_local_to_global(model).items():
                if "_extra_state" in local_name:
                    continue
                hf_names = bridge._weight_name_mapping_mcore_to_hf(global_name)
                parameter = state[local_name]
                expert = ".mlp.experts.linear_fc" in local_name  # the library's own rule for the expert TP group
                parts, rank = ((bridge.mpu.etp_size, bridge.mpu.etp_rank) if expert
                               else (bridge.mpu.tp_size, bridge.mpu.tp_rank))
                plan = _mbridge_plan(bridge, local_name, hf_names, parameter, reader, parts, rank) if stock else None
                plan = _rounded_as_mbridge(bridge, local_name, plan, parameter, reader)
                pieces = checked_pieces(plan, parameter, reader)
                if pieces is not None:
                    copier.submit(pieces)
                    report.sliced += 1
                else:
                    _mbridge_convert(bridge, local_name, hf_names, parameter, reader, parts, rank)
                    report.converted += 1
    report.bytes_read = reader.bytes_read
    return report


def _mbridge_plan(bridge: Any, name: str, hf_names: list[str], parameter: torch.Tensor, reader: CheckpointReader,
                  parts: int, rank: int) -> Plan:
    """The pieces of mbridge's stock `_weight_to_mcore_format` + `_weight_split_across_tp`, or None."""
    shapes = [reader.spec(hf_name)[0] for hf_name in hf_names]
    if hf_names[0] in ("lm_head.weight", "model.embed_tokens.weight") and parameter.shape[0] == 1:
        return None  # a value model's head: the library decides whether to skip it
    qkv = "self_attention.linear_qkv." in name and "layer_norm" not in name
    fc1 = "linear_fc1.weight" in name or "linear_fc1.bias" in name
    gated = fc1 and bridge._get_mcore_config_by_name(name).gated_linear_unit
    if len(hf_names) == 3 and qkv:
        config = bridge.hf_config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return qkv_pieces(parameter, hf_names, shapes, heads=heads, groups=config.num_key_value_heads,
                          head_dim=head_dim, parts=parts, rank=rank)
    if len(hf_names) == 2 and fc1 and (gated or parts == 1):
        return stacked_pieces(parameter, hf_names, shapes, parts, rank)
    if len(hf_names) != 1:
        return None
    hf_name, shape = hf_names[0], shapes[0]
    if bridge.make_vocab_size_divisible_by is not None and (
            "embedding.word_embeddings.weight" in name or "output_layer.weight" in name):
        return split_pieces(parameter, hf_name, shape, 0, parts, rank, padded=bridge.padded_vocab_size)
    if parts == 1 and tuple(parameter.shape) == tuple(shape):
        return whole_pieces(parameter, hf_name)
    if fc1 and gated:  # one fused gate_up tensor: its halves split separately
        halves = [Source(hf_name, 0, 0, shape[0] // 2), Source(hf_name, 0, shape[0] // 2, shape[0])]
        return _split_halves(parameter, halves, shape, parts, rank)
    if qkv or fc1:
        return split_pieces(parameter, hf_name, shape, 0, parts, rank)
    if "mlp.experts.linear_fc2.weight" in name:
        return split_pieces(parameter, hf_name, shape, 1, parts, rank)
    if tuple(parameter.shape) == tuple(shape):
        return whole_pieces(parameter, hf_name)
    differing = [dim for dim, (held, full) in enumerate(zip(parameter.shape, shape)) if held != full]
    return split_pieces(parameter, hf_name, shape, differing[0], parts, rank) if differing else None


def _rounded_as_mbridge(bridge: Any, name: str, plan: Plan, parameter: torch.Tensor, reader: CheckpointReader) -> Plan:
    """mbridge casts every HF tensor to its model dtype before the parameter's (norms kept in fp32 by the local
    spec see fp32 weights rounded to bf16 first): the pieces do so too where that rounds differently."""
    staged = None if "expert_bias" in name else getattr(bridge, "dtype", None)
    if plan is None or staged is None or staged == parameter.dtype:
        return plan
    return [piece if piece.source is None or reader.spec(piece.source.name)[1] in (staged, None)
            else Piece(piece.target, dataclasses.replace(piece.source, via=staged)) for piece in plan]


def _split_halves(parameter: torch.Tensor, halves: list[Source], shape: Sequence[int], parts: int,
                  rank: int) -> Plan:
    if shape[0] % (2 * parts):
        return None
    rows = shape[0] // 2 // parts
    return [Piece(parameter.narrow(0, index * rows, rows),
                  Source(half.name, 0, half.start + rank * rows, half.start + (rank + 1) * rows))
            for index, half in enumerate(halves)]


def _mbridge_convert(bridge: Any, name: str, hf_names: list[str], parameter: torch.Tensor,
                     reader: CheckpointReader, parts: int, rank: int) -> None:
    """One parameter through mbridge's own conversion and split, on whole tensors (what its loader does on TP rank
    0 before scattering; here every rank keeps its own part, so no collective is needed)."""
    mcore_weight = bridge._weight_to_mcore_format(name, [reader.read(Source(hf_name)) for hf_name in hf_names])
    if (hf_names[0] in ("lm_head.weight", "model.embed_tokens.weight") and parameter.shape[0] == 1
            and mcore_weight.shape[0] != 1):
        return  # the library leaves a value model's head alone
    part = list(bridge._weight_split_across_tp(name, mcore_weight, parameter, parts))[rank]
    if part.shape != parameter.shape:
        raise ValueError(f"{name}: mbridge makes shape {tuple(part.shape)} of {hf_names}, the model has "
                         f"{tuple(parameter.shape)}")
    parameter.copy_(part)


# megatron-bridge ---------------------------------------------------------------------------------------------------


def load_megatron_bridge(auto_bridge: Any, chunks: list[torch.nn.Module], folder: str | Path,
                         hf_pretrained: Any) -> LoadReport:
    """megatron-bridge's `load_weights_hf_to_megatron`, each rank reading its own slices.

    Its conversion tasks (which parameter, which mapping, which HF names) come from the library; the mappings whose
    layout is known become pieces, the others run the library's `hf_to_megatron` (collectives included, in the
    same task order on every rank). The library's own loader where the model uses Megatron FSDP, fp8 export or
    ModelOpt's hidden modules.
    """
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.conversion.utils import unwrap_model

    bridge = auto_bridge._model_bridge
    ddp_config = getattr(chunks[0], "ddp_config", None)
    unwrapped = unwrap_model(chunks)
    if ((ddp_config is not None and ddp_config.use_megatron_fsdp)
            or getattr(bridge, "export_weight_dtype", "bf16") == "fp8"
            or any(hasattr(unwrapped[0], name) for name in ("hide_teacher_model", "hide_loss_modules"))):
        auto_bridge.load_hf_weights(chunks, str(folder))
        return LoadReport(library=True)
    stock_loading = type(bridge).maybe_modify_loaded_hf_weight is MegatronModelBridge.maybe_modify_loaded_hf_weight
    tasks = bridge.build_conversion_tasks(hf_pretrained, unwrapped)
    report = LoadReport()
    reader = CheckpointReader(folder)
    state = _ReaderState(reader)
    with Copier(reader) as copier:
        for task in tasks:
            if task is None or task.megatron_module is None:
                continue
            mapping = task.mapping
            grouped = getattr(mapping, "is_grouped_export", False)  # one HF tensor for several parameters
            changed = None
            if not stock_loading and not grouped:
                # a bridge that changes some HF tensors as they load (e.g. MiMo's input_proj halves): those go
                # through the library's conversion as changed, the ones it hands back untouched can be sliced
                looked = state.load(bridge, mapping.hf_param, count=False)
                if not state.unchanged(mapping.hf_param, looked):
                    changed = looked
                    reader.count(state.given.values())
            if changed is None and not grouped:
                pieces = checked_pieces(_megatron_bridge_plan(mapping, task, reader), task.param_weight, reader)
                if pieces is not None:
                    copier.submit(pieces)
                    report.sliced += 1
                    continue
            hf_weights = changed if changed is not None else state.load(bridge, mapping.hf_param, keep=grouped)
            _megatron_bridge_convert(task, hf_weights)
            report.converted += 1
    bridge._broadcast_shared_embeddings(chunks)
    report.bytes_read = reader.bytes_read
    return report


class _ReaderState(Mapping):
    """The HF state the library's `maybe_modify_loaded_hf_weight` reads: whole tensors, views of the files;
    `given` holds what the last `load` handed out."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.given: dict[str, torch.Tensor] = {}
        self._kept: dict[str, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.given:
            self.given[name] = self.reader.read(Source(name), count=False)
        return self.given[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.reader.names())

    def __len__(self) -> int:
        return len(self.reader.names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.reader

    def load(self, bridge: Any, hf_param: str | dict[str, str], *, count: bool = True, keep: bool = False) -> Any:
        """The library's `maybe_modify_loaded_hf_weight` for `hf_param` (kept for the next call with `keep`)."""
        key = str(hf_param)
        if key in self._kept:
            return self._kept[key]
        self.given = {}
        weights = bridge.maybe_modify_loaded_hf_weight(hf_param, self)
        if count:
            self.reader.count(self.given.values())
        if keep:
            self._kept[key] = weights
        return weights

    def unchanged(self, hf_param: str | dict[str, str], weights: Any) -> bool:
        """Whether `weights` are exactly the tensors the state handed out for `hf_param`."""
        if isinstance(hf_param, str):
            return weights is self.given.get(hf_param)
        return isinstance(weights, dict) and weights.keys() == hf_param.keys() and all(
            weights[key] is self.given.get(name) for key, name in hf_param.items())


_EMBEDDINGS = ("embedding.word_embeddings.weight", "output_layer.weight")  # the ones the library pads (vocabulary)


def _megatron_bridge_plan(mapping: Any, task: Any, reader: CheckpointReader) -> Plan:
    """The pieces of the stock mappings' `hf_to_megatron`, or None."""
    from megatron.bridge.models.conversion import param_mapping as mappings

    module, parameter = task.megatron_module, task.param_weight
    if type(parameter) not in (torch.Tensor, torch.nn.Parameter):  # a DTensor or an fp8 tensor
        return None
    parameter = parameter.detach()
    if type(mapping) is mappings.AutoMapping:
        if mapping.permute_dims is not None:
            return None
        if mapping._mapping is None:  # what its hf_to_megatron does first
            mapping._detected_type = mapping._detect_parallelism_type(module)
            mapping._mapping = mapping._get_or_create_mapping(mapping._detected_type)
        mapping = mapping._mapping
    kind, hf_param, parts, rank = type(mapping), mapping.hf_param, mapping.tp_size, mapping.tp_rank
    if kind in (mappings.DirectMapping, mappings.ReplicatedMapping):
        return whole_pieces(parameter, hf_param)
    if kind is mappings.ColumnParallelMapping:
        padded = parameter.shape[0] * parts if parts > 1 and mapping.megatron_param in _EMBEDDINGS else None
        return split_pieces(parameter, hf_param, reader.spec(hf_param)[0], 0, parts, rank, padded)
    if kind is mappings.RowParallelMapping:
        shape = reader.spec(hf_param)[0]
        if len(shape) == 1:  # a bias: not split
            return whole_pieces(parameter, hf_param)
        if len(shape) != 2 or shape[0] != parameter.shape[0]:  # e.g. fused experts stored transposed
            return None
        return split_pieces(parameter, hf_param, shape, 1, parts, rank)
    if kind is mappings.GatedMLPMapping:
        names = [hf_param["gate"], hf_param["up"]]
        return stacked_pieces(parameter, names, [reader.spec(name)[0] for name in names], parts, rank)
    if kind is mappings.QKVMapping:
        config = mapping._get_config(module)
        if getattr(config, "attention_output_gate", False):
            return None
        if parts > 1 and mapping._tp_mapping._detect_parallelism_type(module) != "column":
            return None
        names = [hf_param["q"], hf_param["k"], hf_param["v"]]
        heads = config.num_attention_heads
        return qkv_pieces(parameter, names, [reader.spec(name)[0] for name in names], heads=heads,
                          groups=config.num_query_groups, head_dim=config.kv_channels or config.hidden_size // heads,
                          parts=parts, rank=rank)
    return None


def _megatron_bridge_convert(task: Any, hf_weights: Any) -> None:
    """One task through the library's own `hf_to_megatron` (which may scatter over the TP group)."""
    converted = task.mapping.hf_to_megatron(hf_weights, task.megatron_module)
    if converted is None:
        return
    if converted.shape != task.param_weight.shape:
        raise ValueError(f"{task.mapping.megatron_param}: the checkpoint gives shape {tuple(converted.shape)}, the "
                         f"model has {tuple(task.param_weight.shape)} ({type(task.mapping).__name__} of "
                         f"{task.mapping.hf_param})")
    with torch.no_grad():
        task.param_weight.copy_(converted)
