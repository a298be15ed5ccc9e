"""The one small protocol every bridge backend implements, and the HF writer they share.

A bridge turns an HF checkpoint into Megatron-Core model chunks for the current parallel state (one chunk per
virtual pipeline stage), loads the HF weights into them, and streams them back as HF tensors. Writing the HF
checkpoint is shared: it is where "never silently drop a tensor" and "never leave a half-written folder" live.
Bridges know nothing of Lightning.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_megatron.attention import ATTENTION_BACKENDS, AttentionBackend
from lightning_megatron.checkpoint import move_into_place
from lightning_megatron.moe import (
    check_expert_parallel,
    check_router_matches,
    check_moe_sequence_parallel,
    checkpoint_num_experts,
    moe_config_overrides,
    start_moe_metrics,
)
from lightning_megatron.mtp import check_mtp_training_options

BridgeType = Literal["mbridge", "megatron-bridge"]

# The config keys under which model families declare their MTP layers.
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
_SHARD_BYTES = 4 * 1024**3


class BridgeError(ValueError):
    """A checkpoint or option the chosen bridge cannot serve; the message names the field and the fix."""


@dataclass(frozen=True)
class ModelOptions:
    """What the Megatron model should be beyond what the HF config says.

    `mtp`: keep the checkpoint's MTP head (`False` drops it, and an export then declares zero MTP layers).
    `attention_backend`: the core attention of every layer (MTP included): "sdpa" (PyTorch's fused kernels,
    `attention.SDPAttention`), "local" (Megatron-Core's `DotProductAttention`), or "auto" (SDPA without Transformer
    Engine, Transformer Engine's own attention with it).
    `config_overrides`: any `TransformerConfig` field (dropout, recompute, fusions, ...).
    """

    params_dtype: torch.dtype = torch.float32
    mtp: bool = False
    mtp_loss_scaling_factor: float = 0.1
    mtp_detach_heads: bool = True
    sequence_parallel: bool = False
    attention_backend: AttentionBackend = "auto"
    config_overrides: dict[str, Any] = field(default_factory=dict)


def parallel_sizes() -> dict[str, int | None]:
    """The current Megatron parallel state, under the names `TransformerConfig` uses."""
    from megatron.core import parallel_state

    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def apply_parallel_state(config: Any, options: ModelOptions) -> None:
    """Make a model config (or provider) match the current parallel state."""
    for key, value in parallel_sizes().items():
        setattr(config, key, value)
    config.sequence_parallel = options.sequence_parallel


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def check_remote_code(hf_path: Path, hf_config: dict[str, Any], trust_remote_code: bool) -> None:
    """Refuse, before any library reads the checkpoint, one whose model only exists as Python code in its folder.

    A config.json with `auto_map` whose `model_type` transformers does not know needs that code: loading it runs
    the folder's Python files. Without `trust_remote_code` the libraries would fail later with misleading errors.
    """
    from transformers import CONFIG_MAPPING

    auto_map = hf_config.get("auto_map")
    if trust_remote_code or not auto_map or hf_config.get("model_type") in CONFIG_MAPPING:
        return
    modules = sorted({reference.split("--")[-1].rsplit(".", 1)[0] + ".py"
                      for reference in _auto_map_references(auto_map)})
    raise BridgeError(
        f"{hf_path / 'config.json'}: model_type {hf_config.get('model_type')!r} is defined by remote code in the "
        f"checkpoint folder ({', '.join(modules)}, named by auto_map), which runs as Python when loaded. If you trust "
        "this checkpoint, set trust_remote_code: true under the strategy's init_args "
        "(trainer.strategy.init_args.trust_remote_code, or MegatronStrategy(trust_remote_code=True))"
    )


def _auto_map_references(auto_map: dict[str, Any]) -> list[str]:
    """Every "module.Class" an auto_map names (a value may be a list: a tokenizer's slow and fast classes)."""
    references = []
    for value in auto_map.values():
        references += [item for item in (value if isinstance(value, list) else [value]) if isinstance(item, str)]
    return references


def checkpoint_mtp_layers(hf_config: dict[str, Any]) -> int:
    """How many MTP layers an HF config declares (0 when none), whatever key its family uses."""
    return max((int(hf_config.get(key) or 0) for key in MTP_CONFIG_KEYS), default=0)


def safetensors_files(hf_path: Path) -> list[Path]:
    return sorted(Path(hf_path).glob("*.safetensors"))


def checkpoint_tensor_dtypes(hf_path: Path) -> dict[str, torch.dtype]:
    """Name -> dtype of every tensor in an HF checkpoint, read from the safetensors headers only."""
    dtypes = {}
    for file in safetensors_files(hf_path):
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                dtypes[name] = reader.get_slice(name).get_dtype()
    return {name: _SAFETENSORS_DTYPES[dtype] for name, dtype in dtypes.items()}


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


class Bridge(ABC):
    """Build, load and export Megatron-Core chunks for one HF checkpoint."""

    name: ClassVar[BridgeType]
    supports_mtp_training: ClassVar[bool]
    supports_lora: ClassVar[bool]
    moe_model_types: ClassVar[tuple[str, ...]] = ()  # the MoE families whose experts this bridge maps

    def __init__(self, hf_path: str | Path, *, trust_remote_code: bool = False) -> None:
        self.hf_path = Path(hf_path)
        if not (self.hf_path / "config.json").is_file():
            raise BridgeError(f"hf_checkpoint: {self.hf_path} has no config.json; point it at an HF checkpoint folder")
        self.trust_remote_code = trust_remote_code
        self.hf_config = read_json(self.hf_path / "config.json")
        check_remote_code(self.hf_path, self.hf_config, trust_remote_code)
        self.options = ModelOptions()

    @property
    def checkpoint_mtp_layers(self) -> int:
        return checkpoint_mtp_layers(self.hf_config)

    def validate(self, options: ModelOptions, *, lora: bool = False) -> None:
        """Reject what this bridge or checkpoint cannot do, before any model is built."""
        if options.attention_backend not in ATTENTION_BACKENDS:
            raise BridgeError(f"attention_backend: {options.attention_backend!r} is not one of "
                              f"{', '.join(map(repr, ATTENTION_BACKENDS))}")
        if options.mtp and not self.supports_mtp_training:
            raise BridgeError(f"bridge_type: {self.name} cannot build or train MTP heads; set bridge_type: megatron-bridge")
        if lora and not self.supports_lora:
            raise BridgeError(f"bridge_type: {self.name} has no LoRA/PEFT support; set bridge_type: megatron-bridge")
        if options.mtp and self.checkpoint_mtp_layers == 0:
            raise BridgeError(
                f"{self.hf_path}: config.json declares no MTP layers (none of {', '.join(MTP_CONFIG_KEYS)}); a "
                "checkpoint exported with MTP disabled needs its MTP weights and config restored first "
                "(lightning-megatron-restore-mtp), or set mtp: false"
            )
        if options.mtp and not any(self._is_hf_mtp_tensor(name) for name in checkpoint_tensor_dtypes(self.hf_path)):
            raise BridgeError(
                f"{self.hf_path}: config.json declares {self.checkpoint_mtp_layers} MTP layer(s) but the weights hold "
                "no MTP tensor; restore the head with lightning-megatron-restore-mtp (--source or --init), "
                "or set mtp: false"
            )
        if options.mtp and options.mtp_loss_scaling_factor > 0:
            check_mtp_training_options(options.mtp_loss_scaling_factor, self.checkpoint_mtp_layers)
        self._validate_moe(options)

    def _validate_moe(self, options: ModelOptions) -> None:
        from megatron.core import parallel_state

        model_type = self.hf_config.get("model_type")
        if checkpoint_num_experts(self.hf_config) and model_type not in self.moe_model_types:
            others = "mbridge" if self.name == "megatron-bridge" else "megatron-bridge"
            raise BridgeError(f"bridge_type: {self.name} does not map the experts of {model_type!r} checkpoints "
                              f"(it maps {', '.join(self.moe_model_types)}); set bridge_type: {others} if it does")
        try:
            moe_config_overrides(self.hf_config, options.config_overrides)
        except ValueError as error:
            raise BridgeError(str(error)) from None
        if parallel_state.model_parallel_is_initialized():
            sizes = parallel_sizes()
            try:
                check_expert_parallel(self.hf_config, sizes["expert_model_parallel_size"] or 1,
                                      sizes["expert_tensor_parallel_size"] or 1)
                check_moe_sequence_parallel(self.hf_config, sizes["tensor_model_parallel_size"] or 1,
                                            options.sequence_parallel)
            except ValueError as error:
                raise BridgeError(str(error)) from None

    def build(self, options: ModelOptions, *, load_weights: bool = True) -> list[torch.nn.Module]:
        """Model chunks for the current Megatron parallel state (one per virtual pipeline stage), HF weights loaded."""
        from megatron.core.utils import get_model_config

        self.validate(options)
        self.options = options
        overrides = moe_config_overrides(self.hf_config, options.config_overrides)
        chunks = self._build(dataclasses.replace(options, config_overrides=overrides), load_weights=load_weights)
        check_router_matches(get_model_config(chunks[0]), self.hf_config, options.config_overrides)
        start_moe_metrics(get_model_config(chunks[0]))
        return chunks

    @abstractmethod
    def _build(self, options: ModelOptions, *, load_weights: bool) -> list[torch.nn.Module]: ...

    @abstractmethod
    def load_hf_weights(self, chunks: list[torch.nn.Module], hf_path: str | Path | None = None) -> None:
        """Copy an HF checkpoint's tensors (default: this bridge's) into existing chunks."""

    @abstractmethod
    def export_hf_weights(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor of the model, gathered across TP/PP; every rank must iterate it."""

    def save_hf(self, chunks: list[torch.nn.Module], path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Write an HF checkpoint atomically; raises, leaving nothing behind, when a tensor would be missing.

        Tensors keep the dtype of the source checkpoint's tensor of the same name unless `dtype` is given.
        All ranks must call it; global rank 0 writes.
        """
        path = Path(path)
        source_dtypes = checkpoint_tensor_dtypes(self.hf_path)
        writes = not dist.is_initialized() or dist.get_rank() == 0
        exported_names: set[str] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in self.export_hf_weights(chunks):
            exported_names.add(name)
            if writes:
                target_dtype = dtype or source_dtypes.get(name, tensor.dtype)
                tensors[name] = tensor.detach().to("cpu", target_dtype).contiguous()
        # Every rank sees every name, so every rank raises together (none is left waiting at the barrier).
        expected = {name for name in source_dtypes if self.options.mtp or not self._is_hf_mtp_tensor(name)}
        missing = sorted(expected - exported_names)
        if missing:
            raise BridgeError(
                f"save_hf: the export would omit {len(missing)} tensor(s) of {self.hf_path}, e.g. {missing[:5]}; "
                f"nothing was written to {path}"
            )
        if writes:
            write_atomically(path, lambda folder: self._write_folder(folder, tensors))
        if dist.is_initialized():
            dist.barrier()
        return path

    def _is_hf_mtp_tensor(self, name: str) -> bool:
        return name.startswith(("mtp.", "model.mtp_layers.", "model.mtp.")) or ".mtp." in name

    def _write_folder(self, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
        for file in self.hf_path.iterdir():
            if file.is_file() and file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
                shutil.copy2(file, folder / file.name)
        if not self.options.mtp and self.checkpoint_mtp_layers:
            config = {key: 0 if key in MTP_CONFIG_KEYS else value for key, value in self.hf_config.items()}
            (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(folder, tensors)


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One `model.safetensors`, or shards of at most 4 GiB with an index, as HF writes them."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name in sorted(tensors):
        size = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and shard_bytes + size > _SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensors[name]
        shard_bytes += size
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file_name, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_atomically(path: Path, write: Any) -> None:
    """Fill a temporary sibling folder, then rename it into place; an earlier folder at `path` is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write(staging)
        move_into_place(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
