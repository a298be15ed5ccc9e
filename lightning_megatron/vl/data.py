"""Image + text SFT data for Qwen vision-language checkpoints: JSONL chat rows with images, response-only loss.

A row is ``{"messages": [...]}`` whose ``content`` is a string or a list of ``{"type": "text", "text": ...}`` and
``{"type": "image", "image": "relative/or/absolute.png"}`` items (paths relative to the JSONL file). Each row goes
through the checkpoint's chat template (every image becomes ``<|vision_start|><|image_pad|><|vision_end|>``) and
its image processor; each ``<|image_pad|>`` is then expanded to the image's token count (``t * h * w /
merge_size**2`` of its patch grid), as Hugging Face's processor does. The loss is on the assistant turns only,
never on an image token.

Micro-batches are the text layouts of :mod:`~lightning_megatron.data.packing` (padded rows, or packed THD rows with
``cu_seqlens``) plus the vision inputs of the sequences they hold, in token order: ``pixel_values``
``[patches, channels * temporal_patch * patch**2]`` and ``image_grid_thw`` ``[images, 3]``. Rows are *not* cut for
context parallelism here: the Qwen3-VL model fuses the image embeddings into the full packed row first and then
keeps its rank's part of each sequence (Megatron's load-balanced chunks, the same positions as
:func:`~lightning_megatron.microbatch.split_for_context_parallel`), labels and loss mask included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_megatron.data.datamodule import SFTDataModule
from lightning_megatron.data.jsonl import ROLES, raise_for_bad_rows, read_rows
from lightning_megatron.data.packing import SEQUENCE_KEYS, first_fit, pack_examples, pad_example, sequence_alignment
from lightning_megatron.data.tokenize import TokenizedExample

IMAGE_TOKEN = "<|image_pad|>"
VALID_VL_ROW_HELP = (
    'A valid row is {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"}, '
    '{"type": "text", "text": "What is this?"}]}, {"role": "assistant", "content": "A cat."}]}: content is a '
    "string or a list of text and image items, image paths are relative to the JSONL file, the loss is on every "
    "assistant turn."
)
VISION_KEYS = ("pixel_values", "image_grid_thw")


@dataclass(frozen=True)
class VLExample:
    """One validated row: its messages (image items keep their resolved path) and its images, in order."""

    source: str
    messages: tuple[dict[str, Any], ...]
    image_paths: tuple[Path, ...] = ()


@dataclass(frozen=True)
class VLTokenizedExample(TokenizedExample):
    """Token ids with every image's tokens in place, the response mask, and the images' patches and grids."""

    pixel_values: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    image_grid_thw: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.int64))


def read_vl_jsonl(path: str | Path) -> list[VLExample]:
    """Read and validate every row of ``path``: structure, roles, and that every image exists and decodes.

    All problems are raised together as one :class:`DataValidationError`, each as ``path:line: what`` (a missing
    or unreadable image also names the path as written and as resolved).
    """
    path = Path(path)
    return read_rows(path, lambda line, source: _parse_vl_row(line, source, path.parent), VALID_VL_ROW_HELP)


def _parse_vl_row(line: str, source: str, folder: Path) -> VLExample:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise ValueError("expected an object with a non-empty 'messages' list")
    messages, images = [], []
    for index, message in enumerate(row["messages"]):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"{where} must be an object with 'role' (one of {', '.join(ROLES)}) and 'content'")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise ValueError(f"{where}.content must be a string or a non-empty list of text and image items")
        items = []
        for item_index, item in enumerate(content):
            item_where = f"{where}.content[{item_index}]"
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text" and isinstance(item.get("text"), str):
                items.append({"type": "text", "text": item["text"]})
            elif kind == "image" and isinstance(item.get("image"), str):
                if message["role"] == "assistant":
                    raise ValueError(f"{item_where}: an assistant turn cannot hold an image (it would be trained on)")
                images.append(_checked_image(item["image"], folder, item_where))
                items.append({"type": "image"})
            else:
                raise ValueError(f"{item_where} must be {{'type': 'text', 'text': str}} or "
                                 "{'type': 'image', 'image': 'path'}")
        messages.append({"role": message["role"], "content": items})
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("'messages' has no assistant turn to train on")
    return VLExample(source, tuple(messages), tuple(images))


def _checked_image(written: str, folder: Path, where: str) -> Path:
    from PIL import Image, UnidentifiedImageError

    resolved = (folder / written).resolve()
    if not resolved.is_file():
        raise ValueError(f"{where}: image {written!r} not found (looked for {resolved})")
    try:
        with Image.open(resolved) as image:
            image.verify()
    except (OSError, UnidentifiedImageError, SyntaxError) as error:
        raise ValueError(f"{where}: image {written!r} ({resolved}) cannot be read: {error}") from None
    return resolved


def load_image_processor(hf_checkpoint: str | Path) -> Any:
    """The checkpoint's Qwen image processor, PIL backend (the fast one and the video processor need
    torchvision), from its ``preprocessor_config.json``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config_file = Path(hf_checkpoint) / "preprocessor_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{hf_checkpoint}: no preprocessor_config.json; a VL checkpoint needs its image "
                                "processor settings to turn images into patches")
    settings = json.loads(config_file.read_text())
    known = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "do_resize",
             "do_rescale", "do_normalize", "do_convert_rgb", "rescale_factor", "size", "min_pixels", "max_pixels")
    return Qwen2VLImageProcessorPil(**{key: settings[key] for key in known if key in settings})


def tokenize_vl_example(example: VLExample, tokenizer: Any, image_processor: Any) -> VLTokenizedExample:
    """Token ids (image tokens expanded), response mask (assistant turns), and the row's image patches."""
    from PIL import Image

    rendered = tokenizer.apply_chat_template(list(example.messages), tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    ids, mask = list(rendered["input_ids"]), list(rendered["assistant_masks"])
    if not any(mask):
        raise ValueError("the chat template marks no assistant token; use a template with a {% generation %} block "
                         "around the assistant content")
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if example.image_paths:
        images = []
        for image_path in example.image_paths:
            with Image.open(image_path) as image:
                images.append(image.convert("RGB"))
        vision = image_processor(images=images, return_tensors="pt")
        pixel_values, grid = vision["pixel_values"].float(), vision["image_grid_thw"].to(torch.int64)
    else:
        pixel_values = torch.zeros(0, 0)
        grid = torch.zeros(0, 3, dtype=torch.int64)
    placeholders = [position for position, token in enumerate(ids) if token == image_token_id]
    if len(placeholders) != len(example.image_paths):
        raise ValueError(f"the chat template rendered {len(placeholders)} {IMAGE_TOKEN} tokens for "
                         f"{len(example.image_paths)} images; its image items must render one {IMAGE_TOKEN} each")
    merge = image_processor.merge_size**2
    expanded_ids: list[int] = []
    expanded_mask: list[int] = []
    previous = 0
    for placeholder, thw in zip(placeholders, grid.tolist()):
        expanded_ids += ids[previous:placeholder] + [image_token_id] * (thw[0] * thw[1] * thw[2] // merge)
        expanded_mask += mask[previous:placeholder] + [0] * (thw[0] * thw[1] * thw[2] // merge)
        previous = placeholder + 1
    expanded_ids += ids[previous:]
    expanded_mask += mask[previous:]
    return VLTokenizedExample(
        example.source, torch.tensor(expanded_ids, dtype=torch.int64), torch.tensor(expanded_mask, dtype=torch.bool),
        pixel_values, grid,
    )


def tokenize_vl_examples(
    examples: list[VLExample], tokenizer: Any, image_processor: Any, *, max_tokens: int, drop_overlong: bool
) -> tuple[list[VLTokenizedExample], int]:
    """Tokenize rows; one longer than ``max_tokens`` is dropped (``drop_overlong``) or reported (a VL row is never
    cut: a cut could split an image's tokens from its patches). Returns ``(kept, number dropped)``."""
    kept: list[VLTokenizedExample] = []
    problems: list[str] = []
    dropped = 0
    for example in examples:
        try:
            tokenized = tokenize_vl_example(example, tokenizer, image_processor)
        except (ValueError, OSError) as error:
            problems.append(f"{example.source}: {error}")
            continue
        if len(tokenized) > max_tokens:
            if drop_overlong:
                dropped += 1
                continue
            problems.append(f"{example.source}: has {len(tokenized)} tokens (images included), more than the "
                            f"{max_tokens} that fit; raise seq_length, lower the image processor's max_pixels, "
                            "or set overlong: drop")
            continue
        kept.append(tokenized)
    raise_for_bad_rows(problems, len(examples), VALID_VL_ROW_HELP)
    return kept, dropped


def _vision_inputs(examples: list[VLTokenizedExample]) -> dict[str, torch.Tensor]:
    with_images = [example for example in examples if example.image_grid_thw.numel()]
    if not with_images:
        return {}
    return {"pixel_values": torch.cat([example.pixel_values for example in with_images]),
            "image_grid_thw": torch.cat([example.image_grid_thw for example in with_images])}


class PaddedVLDataset(Dataset):
    """One sequence per sample, padded to ``seq_length``, with its own images; use :func:`collate_vl`."""

    def __init__(self, examples: list[VLTokenizedExample], seq_length: int, pad_id: int) -> None:
        self.examples, self.seq_length, self.pad_id = examples, seq_length, pad_id

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        example = self.examples[index]
        return {**pad_example(example, self.seq_length, self.pad_id), **_vision_inputs([example])}


class PackedVLDataset(Dataset):
    """Sequences packed by first-fit (file order) into THD rows, each row with the images of its sequences."""

    def __init__(self, examples: list[VLTokenizedExample], seq_length: int, pad_id: int, alignment: int = 1) -> None:
        self.examples, self.seq_length, self.pad_id, self.alignment = examples, seq_length, pad_id, alignment
        self.bins = first_fit([-(-len(example) // alignment) * alignment for example in examples], seq_length)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        members = [self.examples[i] for i in self.bins[index]]
        return {**pack_examples(members, self.seq_length, self.pad_id, self.alignment), **_vision_inputs(members)}


def collate_vl(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack the token tensors into ``[b, s]`` and concatenate the rows' images in row order (the order in which
    the model meets their tokens). A packed micro-batch is one row (its ``cu_seqlens`` kept)."""
    if "cu_seqlens" in samples[0] and len(samples) != 1:
        raise ValueError(f"a packed micro-batch holds one row, got {len(samples)}: use micro_batch_size=1")
    batch: dict[str, torch.Tensor] = {key: torch.stack([s[key] for s in samples]) for key in SEQUENCE_KEYS}
    if "cu_seqlens" in samples[0]:
        batch["cu_seqlens"] = samples[0]["cu_seqlens"]
    if "max_seqlen" in samples[0]:  # a host int: the step never reads it back from the GPU
        batch["max_seqlen"] = int(samples[0]["max_seqlen"])
    with_images = [s for s in samples if "pixel_values" in s]
    if with_images:
        for key in VISION_KEYS:
            batch[key] = torch.cat([s[key] for s in with_images])
    return batch


class VLSFTDataModule(SFTDataModule):
    """:class:`SFTDataModule` for image + text rows (format in this module's docstring) and a Qwen-VL checkpoint.

    Same options and layouts (padded rows, or ``packing=True`` for THD rows); ``overlong`` is ``"drop"`` or
    ``"error"`` (a VL row is never truncated). Prediction is not supported.
    """

    def setup(self, stage: str) -> None:
        if self.overlong == "truncate":
            self.overlong = "error"
        if stage == "predict":
            raise ValueError("VLSFTDataModule trains and evaluates; predict (generation) is text-only: use "
                             "SFTDataModule with a text checkpoint")
        super().setup(stage)

    def _build_dataset(self, split: str, path: str) -> Dataset:
        image_processor = load_image_processor(self.hf_checkpoint)
        examples, dropped = tokenize_vl_examples(read_vl_jsonl(path), self.tokenizer, image_processor,
                                                 max_tokens=self.seq_length, drop_overlong=self.overlong == "drop")
        self._warn_dropped(path, dropped, len(examples))
        if not examples:
            raise ValueError(f"{path}: no row is left to train on after overlong='drop'; raise seq_length")
        if self.packing:
            alignment = sequence_alignment(self.context_parallel_size)
            return PackedVLDataset(examples, self.seq_length, self.pad_id, alignment)
        return PaddedVLDataset(examples, self.seq_length, self.pad_id)

    def _dataloader(self, split: str) -> Any:
        loader = super()._dataloader(split)
        loader.collate_fn = collate_vl
        return loader
