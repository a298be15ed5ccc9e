"""Put an MTP head back into an HF checkpoint that was exported without one.

A checkpoint exported with `mtp=False` carries the fine-tuned backbone but no MTP tensors, and its config.json
declares zero MTP layers. Training or serving its MTP head needs them back: from the checkpoint the fine-tuning
started from (`source`), or made fresh (`init`). Everything else must stay as fine-tuned, so the fine-tuned tensors
are written bit for bit, every other file is copied byte for byte, and config.json changes only in its MTP layer
count. Only safetensors are read and written here: no Megatron, no Lightning. A multimodal checkpoint trained as its
text model (Qwen3.5's published `qwen3_5` and `qwen3_5_moe`: `families.LanguageModel`) is read and written in its own
layout: the MTP layer count in its `text_config`, the last decoder layer under its multimodal name, the vision tower
copied as is.

The command is `lightning-megatron-restore-mtp` (`lightning_megatron.cli.restore_mtp`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from lightning_megatron.atomic import write_atomically
from lightning_megatron.families import (
    MTP_CONFIG_KEYS,
    MTP_MODEL_TYPES,
    MTPNames,
    checkpoint_mtp_layers,
    checkpoint_name,
    family,
    layer_types,
    quantization_refusal,
    text_model_config,
    with_text_model_fields,
)
from lightning_megatron.hf_io import read_json, safetensors_files, write_safetensors

Init = Literal["random", "copy-last-layer"]
INITS: tuple[Init, ...] = ("random", "copy-last-layer")


class MTPRestoreError(ValueError):
    """Checkpoints or options that cannot give a correct MTP checkpoint; the message names the field and the fix."""


def restore_mtp_head(
    finetuned: str | Path,
    output: str | Path,
    *,
    source: str | Path | None = None,
    init: Init | None = None,
    seed: int = 0,
) -> Path:
    """Write `output`: the fine-tuned checkpoint plus an MTP head, taken from `source` or made by `init`.

    `source` is the checkpoint the fine-tuning started from: its MTP tensors and MTP layer count are copied, after
    checking that its family, hidden size, vocab size and every MTP tensor's shape fit the fine-tuned checkpoint.
    `init="random"` draws matrices from N(0, initializer_range) (config.json, default 0.02) with `seed`, norms
    scale by 1 (weights ones; zeros where the family's norms scale by `1 + weight`, Qwen3.5's), biases (and routers'
    expert biases) are zeros. `init="copy-last-layer"` copies the last decoder layer into the MTP transformer layer,
    sets the MTP norms to scale by 1 and draws the projection (eh_proj / input_proj) as `random` does.
    A fresh MTP layer stores its routed experts one by one (`experts.{e}.gate_proj.weight`, ...), as the MTP layers
    of every family's checkpoints do, also where the decoder layers pack them (Qwen3.5-MoE); from `source`, the
    source's layout is kept (Qwen3.6 packs its MTP layer's experts too).
    MTP tensors take the dtype of the fine-tuned input embedding: source tensors of another dtype are cast.
    The folder is written atomically; an earlier HF checkpoint at `output` is replaced.
    """
    finetuned, output = Path(finetuned), Path(output)
    if (source is None) == (init is None):
        raise MTPRestoreError(
            "give exactly one of source (the checkpoint the fine-tuning started from, which has the MTP head) "
            f"or init (one of {', '.join(INITS)}) for a fresh head"
        )
    if init is not None and init not in INITS:
        raise MTPRestoreError(f"init: {init!r} is not one of {', '.join(INITS)}")
    source = None if source is None else Path(source)
    _check_output(output, finetuned=finetuned, source=source)

    config = _read_config(finetuned, "finetuned")
    model_type, names = _mtp_family(config, finetuned, "finetuned")
    shapes = _tensor_shapes(finetuned, "finetuned")
    prefixes = _mtp_prefixes(names, config, 1)
    present = sorted(name for name in shapes if name.startswith(prefixes))
    if checkpoint_mtp_layers(config) or present:
        raise MTPRestoreError(
            f"finetuned: {finetuned} already has an MTP head (config.json declares {checkpoint_mtp_layers(config)} MTP "
            f"layer(s); {len(present)} {prefixes[0]}* tensor(s)); restore into a checkpoint exported with mtp=False"
        )

    if source is not None:
        source_config = _read_config(source, "source")
        mtp_layers = _check_source(finetuned, config, source, source_config, model_type)
        source_shapes, source_prefixes = _tensor_shapes(source, "source"), _mtp_prefixes(names, config, mtp_layers)
        packed = any(name.startswith(source_prefixes) and name.endswith(_PACKED_EXPERTS) for name in source_shapes)
        expected = _mtp_shapes(names, config, shapes if packed else _experts_one_by_one_shapes(shapes), mtp_layers)
        _check_source_tensors(source, source_shapes, source_prefixes, expected)
    else:
        source_config = {}
        mtp_layers = 1
        expected = _mtp_shapes(names, config, _experts_one_by_one_shapes(shapes), mtp_layers)

    declared = (text_model_config(config), text_model_config(source_config))
    keys = [key for key in MTP_CONFIG_KEYS if any(key in fields for fields in declared)] or [names.layers_key]
    restored_config = with_text_model_fields(config, **dict.fromkeys(keys, mtp_layers))
    # Listed before anything is written: `output` (and its staging folder) may lie inside `finetuned`.
    copied = [
        entry
        for entry in sorted(finetuned.iterdir())
        if entry.suffix != ".safetensors"
        and entry.name not in ("model.safetensors.index.json", "config.json")
        and entry.resolve() != output.resolve()
    ]

    tensors = _load_tensors(finetuned)
    embedding = checkpoint_name(config, "model.embed_tokens.weight")
    dtype = tensors[embedding].dtype
    if source is not None:
        mtp_tensors = _load_tensors(source, names=set(expected))
    else:
        mtp_tensors = _fresh_mtp_tensors(expected, _experts_one_by_one(tensors), init, seed=seed,
                                         std=text_model_config(config).get("initializer_range", 0.02),
                                         unit_norm=0.0 if family(model_type).zero_centered_norms else 1.0)
    for i in range(mtp_layers):  # the MTP layers' copies of the embedding and LM head: the fine-tuned ones
        mtp_tensors.update({copy: tensors[main if main in tensors else embedding]
                            for main, copy in names.copy_names(i, text_model_config(config)).items()})
    mtp_tensors = {name: tensor.to(dtype) for name, tensor in mtp_tensors.items()}

    def write(folder: Path) -> None:
        for entry in copied:
            if entry.is_dir():
                shutil.copytree(entry, folder / entry.name)
            else:
                shutil.copy2(entry, folder / entry.name)
        (folder / "config.json").write_text(json.dumps(restored_config, indent=2) + "\n")
        write_safetensors(folder, {**tensors, **mtp_tensors})

    write_atomically(output, write)
    return output


def _check_output(output: Path, *, finetuned: Path, source: Path | None) -> None:
    for label, path in (("finetuned", finetuned), ("source", source)):
        if path is not None and path.resolve().is_relative_to(output.resolve()):
            raise MTPRestoreError(
                f"output: {output} is (or contains) the {label} checkpoint {path}, which writing it would replace; "
                "choose a new folder"
            )
    if output.exists() and not (output.is_dir() and ((output / "config.json").is_file() or not any(output.iterdir()))):
        raise MTPRestoreError(
            f"output: {output} exists and is not an HF checkpoint folder, and writing would replace it; "
            "choose a new or empty folder"
        )


def _read_config(path: Path, label: str) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise MTPRestoreError(f"{label}: {path} has no config.json; point it at an HF checkpoint folder")
    config = read_json(path / "config.json")
    refusal = quantization_refusal(config, f"{label}: {path}")  # its MTP weights are stored scaled, not as trained
    if refusal is not None:
        raise MTPRestoreError(refusal)
    return config


def _mtp_family(config: dict[str, Any], path: Path, label: str) -> tuple[str, MTPNames]:
    """The checkpoint's `model_type` and its family's MTP names."""
    model_type = config.get("model_type")
    names = family(model_type).mtp if model_type in MTP_MODEL_TYPES else None
    if names is None:
        raise MTPRestoreError(
            f"{label}: {path} has model_type {model_type!r}; restoring an MTP head is supported for "
            f"{', '.join(MTP_MODEL_TYPES)} (the families whose MTP weights the bridges map)"
        )
    return model_type, names


def _check_source(
    finetuned: Path, config: dict[str, Any], source: Path, source_config: dict[str, Any], model_type: str
) -> int:
    """The source's MTP layer count, once it is known to be the same model as the fine-tuned one."""
    if source_config.get("model_type") != model_type:
        raise MTPRestoreError(
            f"model_type: the fine-tuned checkpoint {finetuned} is {model_type!r}, the source {source} is "
            f"{source_config.get('model_type')!r}; the MTP head must come from a checkpoint of the same family"
        )
    for key in ("hidden_size", "vocab_size"):
        ours, theirs = text_model_config(config).get(key), text_model_config(source_config).get(key)
        if ours != theirs:
            raise MTPRestoreError(
                f"{key}: the fine-tuned checkpoint {finetuned} has {ours}, the source {source} has {theirs}; the MTP "
                "head must come from the checkpoint the fine-tuning started from"
            )
    mtp_layers = checkpoint_mtp_layers(source_config)
    if mtp_layers == 0:
        raise MTPRestoreError(
            f"source: {source} has no MTP head (its config.json declares no MTP layers under any of "
            f"{', '.join(MTP_CONFIG_KEYS)}); point source at the checkpoint that had it, or use init"
        )
    return mtp_layers


def _mtp_prefixes(names: MTPNames, config: dict[str, Any], mtp_layers: int) -> tuple[str, ...]:
    """The name prefixes of `mtp_layers` MTP layers of a checkpoint with this config."""
    return names.layer_prefixes({**text_model_config(config), names.layers_key: mtp_layers})


def _mtp_shapes(
    names: MTPNames, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], mtp_layers: int
) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Every MTP tensor the fine-tuned checkpoint needs: its shape, and the decoder tensor it mirrors (if any).

    An MTP transformer layer is a decoder layer, so its tensors are read off the fine-tuned last decoder layer (the
    last full-attention one where the others are linear attention: Qwen3.5's MTP layer is full attention).
    """
    text_config = text_model_config(config)
    hidden, num_layers = text_config["hidden_size"], text_config["num_hidden_layers"]
    kinds = layer_types(config)
    template = num_layers - 1
    if "linear_attention" in kinds and "full_attention" in kinds:
        template = len(kinds) - 1 - kinds[::-1].index("full_attention")
    last = checkpoint_name(config, f"model.layers.{template}.")
    decoder_layer = {name.removeprefix(last): name for name in shapes if name.startswith(last)}
    if not decoder_layer:
        raise MTPRestoreError(
            f"finetuned: config.json declares num_hidden_layers={num_layers}, but there are no {last}* tensors; the "
            "checkpoint is incomplete"
        )
    embedding = checkpoint_name(config, "model.embed_tokens.weight")
    expected: dict[str, tuple[tuple[int, ...], str | None]] = {}
    for i in range(mtp_layers):
        head = names.head(i, text_config)
        expected[head.pop("projection")] = ((hidden, 2 * hidden), None)
        expected.update({norm: ((hidden,), None) for norm in head.values()})
        for suffix, name in decoder_layer.items():
            expected[names.layer_prefix(i, text_config) + suffix] = (shapes[name], name)
        expected.update({copy: (shapes[main if main in shapes else embedding], None)
                         for main, copy in names.copy_names(i, text_config).items()})
    return expected


_PACKED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def _experts_one_by_one(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with packed routed experts (Qwen3.5-MoE's decoder layers: `experts.gate_up_proj` [experts,
    2 x ffn, hidden], gate rows first, and `experts.down_proj` [experts, hidden, ffn]) as views of the one-by-one
    tensors an MTP layer stores (`experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`)."""
    result = {}
    for name, tensor in tensors.items():
        if name.endswith(_PACKED_EXPERTS[0]):
            experts = name.removesuffix("gate_up_proj")
            for expert, (gate, up) in enumerate(packed.chunk(2) for packed in tensor):
                result[f"{experts}{expert}.gate_proj.weight"], result[f"{experts}{expert}.up_proj.weight"] = gate, up
        elif name.endswith(_PACKED_EXPERTS[1]):
            experts = name.removesuffix("down_proj")
            result.update({f"{experts}{expert}.down_proj.weight": down for expert, down in enumerate(tensor)})
        else:
            result[name] = tensor
    return result


def _experts_one_by_one_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`_experts_one_by_one` of tensors of these shapes: their names and shapes."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    return {name: tuple(tensor.shape) for name, tensor in _experts_one_by_one(meta).items()}


def _check_source_tensors(
    source: Path,
    shapes: dict[str, tuple[int, ...]],
    prefixes: tuple[str, ...],
    expected: dict[str, tuple[tuple[int, ...], str | None]],
) -> None:
    present = {name for name in shapes if name.startswith(prefixes)}
    if not present:
        raise MTPRestoreError(
            f"source: {source} has no MTP head (no {prefixes[0]}* tensors, though config.json declares MTP layers)"
        )
    missing = sorted(set(expected) - present)
    if missing:
        raise MTPRestoreError(f"source: {source} lacks MTP tensor(s) the head needs: {', '.join(missing[:5])}")
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise MTPRestoreError(
            f"source: {source} has MTP tensor(s) the fine-tuned checkpoint has no place for: "
            f"{', '.join(unexpected[:5])}"
        )
    for name, (shape, mirrored) in expected.items():
        if shapes[name] != shape:
            reason = f"the shape of its {mirrored}" if mirrored else "from its hidden_size"
            raise MTPRestoreError(
                f"{name}: the source {source} has shape {shapes[name]}, the fine-tuned checkpoint needs {shape} "
                f"({reason}); the MTP head must come from the checkpoint the fine-tuning started from"
            )


def _fresh_mtp_tensors(
    expected: dict[str, tuple[tuple[int, ...], str | None]],
    tensors: dict[str, torch.Tensor],
    init: Init,
    *,
    std: float,
    seed: int,
    unit_norm: float,
) -> dict[str, torch.Tensor]:
    """`unit_norm`: the weight of a norm that scales by 1 (0 where the family's norms scale by `1 + weight`)."""
    generator = torch.Generator().manual_seed(seed)
    fresh = {}
    for name, (shape, mirrored) in sorted(expected.items()):  # sorted: the same seed draws the same tensors
        if init == "copy-last-layer" and mirrored is not None:
            fresh[name] = tensors[mirrored].clone()
        elif name.endswith("bias"):  # biases, and the routers' expert bias (GLM-4.5's e_score_correction_bias)
            fresh[name] = torch.zeros(shape)
        elif len(shape) == 1:  # the only other vectors are norm weights
            fresh[name] = torch.full(shape, unit_norm)
        else:
            fresh[name] = torch.normal(0.0, std, shape, generator=generator)
    return fresh


def _tensor_shapes(path: Path, label: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor, read from the safetensors headers only."""
    shapes = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                shapes[name] = tuple(reader.get_slice(name).get_shape())
    if not shapes:
        raise MTPRestoreError(f"{label}: {path} has no *.safetensors files; point it at an HF checkpoint folder")
    return shapes


def _load_tensors(path: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                if names is None or name in names:
                    tensors[name] = reader.get_tensor(name)
    return tensors

