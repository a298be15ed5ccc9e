"""The one small protocol every bridge backend implements, and the HF writer they share.

A bridge turns an HF checkpoint into Megatron-Core model chunks for the current parallel state (one chunk per
virtual pipeline stage), loads the HF weights into them, and streams them back as HF tensors. Writing the HF
checkpoint is shared: it is where "never silently drop a tensor" and "never leave a half-written folder" live.
Bridges know nothing of Lightning.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from lightning_megatron._compat import fast_swiglu
from lightning_megatron.atomic import write_atomically
from lightning_megatron.bridges.vl import check_vl_options, vl_model_type
from lightning_megatron.distributed import ParallelSizes
from lightning_megatron.families import (
    LINEAR_ATTENTION_MODEL_TYPES,
    MTP_CONFIG_KEYS,
    checkpoint_mtp_layers,
    family,
    is_hf_mtp_tensor,
    language_model,
    layer_types,
    quantization_refusal,
    text_model_config,
    with_text_model_fields,
)
from lightning_megatron.hf_io import (
    CheckpointReader,
    LoadReport,
    Source,
    TensorSpec,
    checkpoint_tensor_dtypes,
    checkpoint_tensor_specs,
    plan_parallel_shards,
    plan_shards,
    read_json,
    shard_file_names,
    shard_writer,
    write_index,
    write_shard_files,
)
from lightning_megatron.moe import (
    check_expert_parallel,
    check_moe_sequence_parallel,
    check_mtp_layer_experts,
    check_router_matches,
    checkpoint_num_experts,
    moe_config_overrides,
    start_moe_metrics,
)
from lightning_megatron.mtp.parameters import check_mtp_training_options
from lightning_megatron.options import ATTENTION_BACKENDS, BridgeType, ModelOptions
from lightning_megatron.tree_rotary import install_depth_rotary


class BridgeError(ValueError):
    """A checkpoint or option the chosen bridge cannot serve; the message names the field and the fix."""


def apply_parallel_state(config: Any, options: ModelOptions) -> None:
    """Make a model config (or provider) match the current parallel state."""
    for key, value in ParallelSizes.current().config_fields().items():
        setattr(config, key, value)
    config.sequence_parallel = options.sequence_parallel


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


class Bridge(ABC):
    """Build, load and export Megatron-Core chunks for one HF checkpoint.

    A backend declares what it can do on its class, so that callers ask it (or its registered class, before a
    bridge exists) rather than comparing `bridge_type` names.
    """

    name: ClassVar[BridgeType]  # the `bridge_type` it is registered as (`register_backend`)
    supports_mtp_training: ClassVar[bool] = False  # builds and trains the checkpoint's MTP heads
    supports_lora: ClassVar[bool] = False  # LoRA adapters (`callbacks.LoRACallback`) and their HF export
    supports_vl: ClassVar[bool] = False  # the Qwen vision-language checkpoints of `bridges.vl`
    moe_model_types: ClassVar[tuple[str, ...]] = ()  # the MoE families whose experts this bridge maps
    linear_attention_model_types: ClassVar[tuple[str, ...]] = ()  # the families whose linear attention it maps
    reads_model_config_before_build: ClassVar[bool] = False  # `router_updates_expert_bias`
    exports_selected_tensors: ClassVar[bool] = False  # `changed_hf_names`: an export of only what changed

    def __init__(self, hf_path: str | Path, *, trust_remote_code: bool = False) -> None:
        self.hf_path = Path(hf_path)
        if not (self.hf_path / "config.json").is_file():
            raise BridgeError(f"hf_checkpoint: {self.hf_path} has no config.json; point it at an HF checkpoint folder")
        self.trust_remote_code = trust_remote_code
        self.hf_config = read_json(self.hf_path / "config.json")
        check_remote_code(self.hf_path, self.hf_config, trust_remote_code)
        self.options = ModelOptions()
        self._export_specs: dict[tuple[torch.dtype | None, bool], dict[str, TensorSpec]] = {}

    @property
    def checkpoint_mtp_layers(self) -> int:
        return checkpoint_mtp_layers(self.hf_config)

    def validate(self, options: ModelOptions) -> None:
        """Reject what this bridge or checkpoint cannot do, before any model is built."""
        refusal = quantization_refusal(self.hf_config, f"hf_checkpoint: {self.hf_path}")
        if refusal is not None:
            raise BridgeError(refusal)
        if options.attention_backend not in ATTENTION_BACKENDS:
            raise BridgeError(f"attention_backend: {options.attention_backend!r} is not one of "
                              f"{', '.join(map(repr, ATTENTION_BACKENDS))}")
        if not (isinstance(options.mtp_depths, int) and options.mtp_depths >= 1):
            raise BridgeError(f"mtp_depths: {options.mtp_depths!r} must be an integer >= 1 (1: the MTP head's own depth)")
        if options.mtp_depths > 1 and not self.supports_mtp_training:
            raise BridgeError(f"mtp_depths: {options.mtp_depths} applies the one MTP layer at every drafting depth "
                              f"(Megatron-Core's repeated MTP layer), which bridge_type: {self.name} cannot build; set "
                              f"bridge_type: {capable_backends(lambda backend: backend.supports_mtp_training)}")
        if options.mtp_depths > 1 and not options.mtp:
            raise BridgeError(f"mtp_depths: {options.mtp_depths} needs the MTP head kept (mtp: true)")
        if options.mtp and not self.supports_mtp_training:
            raise BridgeError(f"bridge_type: {self.name} cannot build or train MTP heads; set bridge_type: "
                              f"{capable_backends(lambda backend: backend.supports_mtp_training)}")
        if options.mtp and self.checkpoint_mtp_layers == 0:
            raise BridgeError(
                f"{self.hf_path}: config.json declares no MTP layers (none of {', '.join(MTP_CONFIG_KEYS)}); a "
                "checkpoint exported with MTP disabled needs its MTP weights and config restored first "
                "(lightning-megatron-restore-mtp), or set mtp: false"
            )
        if options.mtp and not options.random_weights and not any(
                is_hf_mtp_tensor(name, self.hf_config) for name in checkpoint_tensor_dtypes(self.hf_path)):
            raise BridgeError(
                f"{self.hf_path}: config.json declares {self.checkpoint_mtp_layers} MTP layer(s) but the weights hold "
                "no MTP tensor; restore the head with lightning-megatron-restore-mtp (--source or --init), "
                "or set mtp: false"
            )
        if options.mtp and options.mtp_loss_scaling_factor > 0:
            check_mtp_training_options(options.mtp_loss_scaling_factor, self.checkpoint_mtp_layers)
        vl_type = vl_model_type(self.hf_config)
        if vl_type is not None:
            if not self.supports_vl:
                capable = capable_backends(lambda backend: backend.supports_vl)
                raise BridgeError(f"{family(vl_type).vl_name} checkpoints are built through {capable} here; set "
                                  f"bridge_type: {capable}")
            check_vl_options(self.hf_config, attention_backend=options.attention_backend,
                             context_parallel_size=ParallelSizes.current().context)
        self._validate_moe(options)
        self._validate_linear_attention(options)
        self._validate_vocabulary()
        self._validate_heads()

    def router_updates_expert_bias(self, options: ModelOptions) -> bool:
        """Whether the model `options` asks for updates its MoE router's expert bias every step (outside the
        optimizer), read from the model config the library makes of the checkpoint, before any model is built."""
        capable = capable_backends(lambda backend: backend.reads_model_config_before_build)
        raise BridgeError(f"bridge_type: {self.name} cannot read the model config before building it (to tell "
                          f"whether the MoE router updates its expert bias); set bridge_type: {capable}")

    def export_adapter_weights(self, chunks: list[torch.nn.Module], *, on_host: bool = True
                               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapters' tensors under their HF PEFT names, gathered across TP/PP, on the host (`on_host=False`:
        on the model's device); every rank must iterate it."""
        raise self._no_lora_support()

    def adapted_hf_modules(self, chunks: list[torch.nn.Module]) -> list[str]:
        """The HF modules the adapter export names the LoRA adapters after (`model.layers.0.self_attn.q_proj`; one
        per adapter: a fused one by its first projection), without gathering a tensor; every rank must call it."""
        raise self._no_lora_support()

    def _no_lora_support(self) -> BridgeError:
        capable = capable_backends(lambda backend: backend.supports_lora)
        return BridgeError(f"bridge_type: {self.name} has no LoRA/PEFT support; set bridge_type: {capable}")

    def _validate_vocabulary(self) -> None:
        """Neither bridge pads the vocabulary: tensor parallelism splits the embedding and output rows evenly."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return
        vocab_size = self.hf_config.get("vocab_size") or self.hf_config.get("text_config", {}).get("vocab_size")
        tensor_parallel = ParallelSizes.current().tensor or 1
        if vocab_size and vocab_size % tensor_parallel:
            divisors = [size for size in range(2, 9) if vocab_size % size == 0]
            fix = (f"use a tensor_model_parallel_size that divides it (e.g. {', '.join(map(str, divisors))})"
                   if divisors else f"{vocab_size} has no factor from 2 to 8, so use tensor_model_parallel_size: 1")
            raise BridgeError(
                f"tensor_model_parallel_size: {tensor_parallel} must divide the checkpoint's vocab_size "
                f"({vocab_size}, {self.hf_path / 'config.json'}): the embedding and output rows are split evenly "
                f"and the bridges do not pad them; {fix}")

    def _validate_heads(self) -> None:
        """Tensor parallelism splits the attention heads evenly (KV heads fewer than the ranks are replicated), and
        Qwen3.5's DeltaNet key and value heads over tensor x context parallelism: Megatron-Core asserts both only as
        the model is built (megatron/core/transformer/transformer_config.py)."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return
        sizes, config = ParallelSizes.current(), text_model_config(self.hf_config)
        parts = {"num_attention_heads": (sizes.tensor, f"tensor_model_parallel_size: {sizes.tensor}")}
        if self.hf_config.get("model_type") in LINEAR_ATTENTION_MODEL_TYPES:
            option = f"tensor_model_parallel_size x context_parallel_size = {sizes.tensor} x {sizes.context}"
            parts.update({key: (sizes.tensor * sizes.context, option)
                          for key in ("linear_num_key_heads", "linear_num_value_heads")})
        for key, (size, option) in parts.items():
            heads = int(config.get(key) or 0)
            if heads % size:
                raise BridgeError(f"{option} must divide the checkpoint's {key} ({heads}, "
                                  f"{self.hf_path / 'config.json'}): the heads are split evenly over those ranks; "
                                  f"use parallel sizes whose product divides {heads}")

    def _validate_linear_attention(self, options: ModelOptions) -> None:
        """Linear-attention layers (Qwen3.5's gated DeltaNet) need a backend that maps them, and an MTP layer (full
        attention) needs a decoder that ends with a full-attention layer: Megatron-Core builds the MTP layer with the
        last decoder layer's spec (megatron/core/models/gpt/gpt_layer_specs.py:769)."""
        model_type = self.hf_config.get("model_type")
        if model_type not in LINEAR_ATTENTION_MODEL_TYPES:
            return
        if model_type not in self.linear_attention_model_types:
            capable = capable_backends(lambda backend: model_type in backend.linear_attention_model_types)
            raise BridgeError(f"bridge_type: {self.name} does not map the gated DeltaNet (linear-attention) layers of "
                              f"{model_type!r} checkpoints; set bridge_type: {capable}")
        kinds = layer_types(self.hf_config) or ["full_attention"]
        if options.mtp and kinds[-1] != "full_attention":
            raise BridgeError(
                f"{self.hf_path}: layer_types ends with {kinds[-1]!r}, and Megatron-Core builds the MTP layer as "
                f"the last decoder layer, while {model_type!r}'s MTP layer is full attention (Qwen3.5's published "
                "checkpoints end every 4 layers with one, full_attention_interval: 4); set mtp: false, or use a "
                "checkpoint whose last decoder layer is full_attention")

    def _validate_moe(self, options: ModelOptions) -> None:
        from megatron.core import parallel_state

        model_type = self.hf_config.get("model_type")
        if checkpoint_num_experts(self.hf_config) and model_type not in self.moe_model_types:
            capable = capable_backends(lambda backend: model_type in backend.moe_model_types)
            fix = f"set bridge_type: {capable}" if capable else "no bridge_type maps them"
            raise BridgeError(f"bridge_type: {self.name} does not map the experts of {model_type!r} checkpoints "
                              f"(it maps {', '.join(self.moe_model_types)}); {fix}")
        try:
            moe_config_overrides(self.hf_config, options.config_overrides)
            if options.mtp:
                check_mtp_layer_experts(self.hf_config)
        except ValueError as error:
            raise BridgeError(str(error)) from None
        if parallel_state.model_parallel_is_initialized():
            sizes = ParallelSizes.current()
            try:
                check_expert_parallel(self.hf_config, sizes.expert or 1, sizes.expert_tensor or 1)
                check_moe_sequence_parallel(self.hf_config, sizes.tensor or 1, options.sequence_parallel)
            except ValueError as error:
                raise BridgeError(str(error)) from None

    def build(self, options: ModelOptions, *, load_weights: bool = True) -> list[torch.nn.Module]:
        """Model chunks for the current Megatron parallel state (one per virtual pipeline stage), HF weights loaded,
        with rotary embeddings that follow the depth of tree-packed rows (`tree_rotary`)."""
        from megatron.core.utils import get_model_config

        self.validate(options)
        self.options = options
        overrides = moe_config_overrides(self.hf_config, options.config_overrides)
        chunks = self._build(dataclasses.replace(options, config_overrides=overrides),
                             load_weights=load_weights and not options.random_weights)
        if "bias_activation_fusion" in options.config_overrides:  # the user's value, not the fused default
            for chunk in chunks:
                fast_swiglu.keep_as_given(chunk)
        check_router_matches(get_model_config(chunks[0]), self.hf_config, options.config_overrides)
        start_moe_metrics(get_model_config(chunks[0]))
        install_depth_rotary(chunks)  # tree-packed rows: rotary embeddings at each token's depth
        return chunks

    @abstractmethod
    def _build(self, options: ModelOptions, *, load_weights: bool) -> list[torch.nn.Module]: ...

    @abstractmethod
    def load_hf_weights(self, chunks: list[torch.nn.Module], hf_path: str | Path | None = None, *,
                        sliced: bool = True) -> LoadReport:
        """Copy an HF checkpoint's tensors (default: this bridge's) into existing chunks.

        Each rank reads only the slices of the checkpoint its parameters hold, on several threads
        (`sliced_load`); `sliced=False` runs the library's own loader instead (the reference the sliced load is
        tested against, bit for bit).
        """

    @abstractmethod
    def export_hf_weights(self, chunks: list[torch.nn.Module], *, on_host: bool = True,
                          only: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor of the model (or those named in `only`), gathered across TP/PP; every rank must iterate
        it.

        `on_host=False` leaves the tensors on the model's device (for sending them on to an inference engine).
        """

    def changed_hf_names(self, chunks: list[torch.nn.Module], changed: Collection[int]) -> set[str] | None:
        """The HF tensors computed from the Megatron parameters and buffers whose `id` is in `changed` (a LoRA
        adapter changes the merged weight of the linear it wraps), the same set on every rank; None where this
        backend cannot tell (then every tensor counts as changed). All ranks call it."""
        return None

    def hf_tensor_specs(self, dtype: torch.dtype | None = None) -> dict[str, TensorSpec]:
        """The tensors an export of the built model carries: the source checkpoint's names (its MTP tensors only
        when the model was built with MTP; not those of `unchanged_hf_tensors`), shapes, and dtypes (the source's,
        or `dtype`). Made once per dtype and MTP setting: every export and weight sync asks, some several times."""
        key = (dtype, self.options.mtp)
        if key not in self._export_specs:
            unchanged = self.unchanged_hf_tensors()
            self._export_specs[key] = {
                name: TensorSpec(name, spec.shape, dtype or spec.dtype) for name, spec in self._checkpoint_specs.items()
                if name not in unchanged and (self.options.mtp or not is_hf_mtp_tensor(name, self.hf_config))}
        return dict(self._export_specs[key])

    def unchanged_hf_tensors(self) -> dict[str, TensorSpec]:
        """The source checkpoint's tensors the model does not hold: the other towers of a multimodal checkpoint
        trained as its text model (Qwen3.5's vision tower, `families.LanguageModel`). `save_hf` copies them from the
        source bit for bit, so the exported folder is the whole multimodal checkpoint again."""
        layout = language_model(self.hf_config)
        if layout is None:
            return {}
        return {name: spec for name, spec in self._checkpoint_specs.items() if name.startswith(layout.other_prefixes)}

    @functools.cached_property
    def _checkpoint_specs(self) -> dict[str, TensorSpec]:
        """The source checkpoint's tensors, read from its headers once (every export and weight sync asks)."""
        return checkpoint_tensor_specs(self.hf_path)

    def export_hf_tensors(self, chunks: list[torch.nn.Module], *, dtype: torch.dtype | None = None,
                          on_host: bool = True, only: Collection[str] | None = None
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        """`export_hf_weights` checked against `hf_tensor_specs` (those named in `only`) and cast to its dtypes.

        Every rank sees every name and shape, so on a mismatch or a missing tensor every rank raises together
        (none is left waiting in a collective). A name the source checkpoint does not have keeps its own dtype.
        """
        specs = self.hf_tensor_specs(dtype)
        expected = set(specs) if only is None else set(specs) & set(only)
        exported: set[str] = set()
        for name, tensor in self.export_hf_weights(chunks, on_host=on_host, only=only):
            spec = specs.get(name)
            if spec is not None and tuple(tensor.shape) != spec.shape:
                raise BridgeError(f"the export gives {name} the shape {tuple(tensor.shape)}, but {self.hf_path} "
                                  f"has {spec.shape}")
            if name in exported:  # a tied embedding, exported by the first and the last pipeline stage: once
                continue
            if only is not None and name not in only:  # a backend that exports more than it was asked for
                continue
            exported.add(name)
            yield name, tensor.detach().to(spec.dtype if spec is not None else tensor.dtype)
        missing = sorted(expected - exported)
        if missing:
            raise BridgeError(f"the export would omit {len(missing)} tensor(s) of {self.hf_path}, e.g. {missing[:5]}")

    def save_hf(self, chunks: list[torch.nn.Module], path: str | Path, *, dtype: torch.dtype | None = None,
                separate: Collection[str] = (), extra_files: Mapping[str, str] | None = None) -> Path:
        """Write an HF checkpoint atomically; raises, leaving nothing behind, when a tensor would be missing.

        Tensors keep the dtype of the source checkpoint's tensor of the same name unless `dtype` is given.
        All ranks must call it. The shards are split over the ranks; each rank's files are laid out before the
        export starts and every tensor is written into them as the export yields it (from a GPU through pinned
        staging, overlapping the export of the next tensors, one thread per file: `hf_io.shard_writer`), so no
        rank holds the model on the host. Global rank 0 writes the index and the other files and renames the
        folder into place.

        `separate`: tensors that get shard files of their own (those a delta weight sync rewrites, so that the
        other files can be shared with the next version), spread over several files of about equal bytes, written
        at once (`hf_io.plan_parallel_shards`); `extra_files`: `{name: text}` written into the folder
        before it is renamed into place (a version's metadata).
        """
        path = Path(path)
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        specs, unchanged = self.hf_tensor_specs(dtype), self.unchanged_hf_tensors()
        sizes = {name: spec.nbytes for name, spec in {**specs, **unchanged}.items()}
        apart = {name: size for name, size in sizes.items() if name in separate}
        kept = {name: size for name, size in sizes.items() if name not in apart}
        # the tensors apart are spread over several files, written at once (as the next delta writes them)
        shards = (plan_shards(kept) if kept else []) + (plan_parallel_shards(apart) if apart else [])
        files = shard_file_names(len(shards))
        mine = {file: [specs[name] if name in specs else unchanged[name] for name in shard]
                for index, (file, shard) in enumerate(zip(files, shards)) if index % world_size == rank}
        owned = {spec.name for file_specs in mine.values() for spec in file_specs}
        # a GPU model's tensors are staged from the GPU by the writer (a host copy per tensor would be slower)
        on_host = not any(parameter.is_cuda for chunk in chunks for parameter in chunk.parameters())

        def write(folder: Path) -> None:
            extras: dict[str, torch.Tensor] = {}
            try:  # no autograd: a GPU model's export broadcasts its (grad-requiring) parameters in place
                with torch.no_grad(), shard_writer(folder, mine) as writer:
                    for name, tensor in self.export_hf_tensors(chunks, dtype=dtype, on_host=on_host):
                        if name in owned:
                            writer.write(name, tensor)
                        elif name not in specs and rank == 0:
                            extras[name] = tensor.to("cpu")
                    if owned & unchanged.keys():
                        source = CheckpointReader(self.hf_path)
                        for name in sorted(owned & unchanged.keys()):
                            writer.write(name, source.read(Source(name)))
            except BridgeError as error:
                raise BridgeError(f"save_hf: {error}; nothing was written to {path}") from error
            if rank == 0:
                if extras:  # a tensor the source lacks (none for the supported families) joins the first shard
                    _add_to_shard(folder / files[0], extras)
                    shards[0] = sorted([*shards[0], *extras])
                write_index(folder, shards, {**sizes, **{name: tensor.nbytes for name, tensor in extras.items()}})
                self._write_folder(folder)
                for name, text in (extra_files or {}).items():
                    (folder / name).write_text(text)

        write_atomically(path, write, every_rank=True)
        return path

    def _write_folder(self, folder: Path) -> None:
        """Everything of an HF checkpoint folder but the weights: tokenizer, generation config, config."""
        for file in self.hf_path.iterdir():
            if file.is_file() and file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
                shutil.copy2(file, folder / file.name)
        if not self.options.mtp and self.checkpoint_mtp_layers:
            declared = text_model_config(self.hf_config)
            config = with_text_model_fields(self.hf_config, **{key: 0 for key in MTP_CONFIG_KEYS if key in declared})
            (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _add_to_shard(file: Path, extras: dict[str, torch.Tensor]) -> None:
    """Rewrite a written shard with `extras` added (its layout, fixed before the export, could not hold them)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as reader:
        tensors = {name: reader.get_tensor(name).clone() for name in reader.keys()}  # not views of the file
    write_shard_files(file.parent, {file.name: {**tensors, **extras}})


BridgeClass = TypeVar("BridgeClass", bound=type[Bridge])

_BACKENDS: dict[str, type[Bridge]] = {}


def register_backend(cls: BridgeClass) -> BridgeClass:
    """Class decorator: make a `Bridge` subclass available as `bridge_type: <cls.name>` (`bridges.create_bridge`)."""
    if cls.name in _BACKENDS and _BACKENDS[cls.name] is not cls:
        raise ValueError(f"bridge_type {cls.name!r} is registered twice ({_BACKENDS[cls.name].__name__}, "
                         f"{cls.__name__}); give one of them another name")
    _BACKENDS[cls.name] = cls
    return cls


def registered_backends() -> dict[str, type[Bridge]]:
    """Every registered backend by its `bridge_type` name, in registration order (importing
    `lightning_megatron.bridges` registers them all)."""
    return dict(_BACKENDS)


def capable_backends(can: Callable[[type[Bridge]], bool]) -> str:
    """The registered `bridge_type`s whose class `can` do something, as the fix an error suggests
    ("megatron-bridge", "a or b"); empty when none can."""
    return " or ".join(name for name, cls in _BACKENDS.items() if can(cls))
