"""Deterministic Qwen2.5-VL and Qwen3-VL Hugging Face checkpoints with random weights, and image+text SFT data,
written locally for tests, the tiny config and the VL benchmark.

A checkpoint holds everything a VL fine-tune reads: ``config.json`` (text model and vision tower), the safetensors
in the names megatron-bridge 0.6.2 maps (``qwen_vl/qwen25_vl_bridge.py``, ``qwen_vl/qwen3_vl_bridge.py``), a
byte-level BPE tokenizer with the Qwen vision specials and a chat template that renders image content, and a
``preprocessor_config.json`` for ``Qwen2VLImageProcessorPil`` (the image processor that needs no torchvision; the
full ``*VLProcessor`` also wants a video processor, which does). The same arguments give byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_megatron.atomic import write_atomically
from lightning_megatron.testing.checkpoints import random_tensor, write_json
from lightning_megatron.testing.tokenizer import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOKENIZER_CORPUS,
    VISION_SPECIAL_TOKENS,
    VISION_TOKEN_ROLES,
    tokenizer_config,
    train_byte_level_bpe,
)

_MAX_TOKENIZER_SIZE = 1024  # a larger vocab_size gets embedding rows past the tokenizer (padding, as in Qwen's)
VLFamily = Literal["qwen2_5_vl", "qwen3_vl"]
VL_FAMILIES: tuple[VLFamily, ...] = ("qwen2_5_vl", "qwen3_vl")

_VL_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, *VISION_SPECIAL_TOKENS)

# Qwen-VL ChatML: a message's content is a string or a list of {"type": "text", "text": ...} and
# {"type": "image"} items; each image becomes <|vision_start|><|image_pad|><|vision_end|> (the data path expands the
# pad to the image's token count, as the HF processor does). The {% generation %} block marks the assistant replies.
VL_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- render(message['content']) + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tiny_vl_checkpoint(
    path: str | Path,
    family: VLFamily = "qwen2_5_vl",
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 400,
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    vision_num_heads: int = 2,
    vision_intermediate_size: int | None = None,
    vision_full_attention_every: int = 0,
    tied: bool = False,
    max_pixels: int = 112 * 112,
    dtype: torch.dtype = torch.float32,
    with_weights: bool = True,
) -> Path:
    """Write a tiny, deterministic Qwen2.5-VL or Qwen3-VL checkpoint into ``path`` (atomically) and return it.

    Text model: ``num_layers`` decoder layers of ``hidden_size`` with ``num_attention_heads``/``num_key_value_heads``
    heads (head_dim ``hidden_size // num_attention_heads``, whose half is split 1:1.5:1.5 over MRoPE's temporal,
    height and width sections); vision tower: ``vision_depth`` blocks of ``vision_hidden_size`` (Qwen2.5-VL: patch 14,
    window attention with every ``vision_full_attention_every``-th block full, default only the last, windows of
    56 pixels then, else 112 as in the real models; Qwen3-VL: patch 16, deepstack from block 0) with FFN
    ``vision_intermediate_size`` (default twice its width). ``tied`` ties the LM head to the embedding. Images are
    resized to at most ``max_pixels`` pixels, so a sample's image tokens stay few. The tokenizer has
    ``min(vocab_size, 1024)`` tokens (the rest of the vocabulary is padding rows). Real shapes (e.g. Qwen2.5-VL-3B:
    2048 hidden, 36 layers, 16/2 heads, FFN 11008, vision 1280 x 32 blocks) work too, at seconds per 100M parameters;
    ``with_weights=False`` writes everything but the safetensors, for a model that is randomly initialised anyway.
    """
    if family not in VL_FAMILIES:
        raise ValueError(f"family: {family!r} is not one of {VL_FAMILIES}")
    head_dim = hidden_size // num_attention_heads
    if head_dim * num_attention_heads != hidden_size or head_dim % 16:
        raise ValueError(f"hidden_size / num_attention_heads = {hidden_size / num_attention_heads} must be a "
                         "multiple of 16 (MRoPE splits half the head dimension 2:3:3 into 3 sections)")
    tokenizer = train_byte_level_bpe([TOKENIZER_CORPUS], min(vocab_size, _MAX_TOKENIZER_SIZE),
                                     list(_VL_SPECIAL_TOKENS))
    ids = {token: tokenizer.token_to_id(token) for token in _VL_SPECIAL_TOKENS}
    config = _vl_config(family, ids, num_layers, hidden_size, num_attention_heads, num_key_value_heads,
                        intermediate_size or 2 * hidden_size, vocab_size, vision_depth, vision_hidden_size,
                        vision_num_heads, vision_intermediate_size or 2 * vision_hidden_size,
                        vision_full_attention_every, tied, dtype)

    def write(folder: Path) -> None:
        if with_weights:
            model = _hf_model(config)
            model.load_state_dict({name: random_tensor(name, tuple(t.shape), seed).to(dtype)
                                   for name, t in model.state_dict().items()})
            model.save_pretrained(folder)
        else:
            config.architectures = [_hf_model_class(config).__name__]
            config.save_pretrained(folder)
        tokenizer.save(str(folder / "tokenizer.json"))
        roles = {"bos": ENDOFTEXT, "eos": IM_END, "pad": ENDOFTEXT}
        vl_tokenizer_config = tokenizer_config(roles, 4096)
        vl_tokenizer_config["chat_template"] = VL_CHAT_TEMPLATE
        write_json(folder / "tokenizer_config.json", vl_tokenizer_config)
        write_json(folder / "preprocessor_config.json", _preprocessor_config(family, max_pixels))

    path = Path(path)
    write_atomically(path, write)
    return path


def _vl_config(
    family: VLFamily,
    ids: dict[str, int],
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    vocab_size: int,
    vision_depth: int,
    vision_hidden_size: int,
    vision_num_heads: int,
    vision_intermediate_size: int,
    vision_full_attention_every: int,
    tied: bool,
    dtype: torch.dtype,
) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    unit = hidden_size // num_attention_heads // 16  # an eighth of half the head dim
    mrope_section = [2 * unit, 3 * unit, 3 * unit]
    text: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
        bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT],
        tie_word_embeddings=tied, dtype=str(dtype).removeprefix("torch."),
    )
    vision: dict[str, Any] = dict(
        depth=vision_depth, hidden_size=vision_hidden_size, num_heads=vision_num_heads,
        intermediate_size=vision_intermediate_size, out_hidden_size=hidden_size, spatial_merge_size=2,
        temporal_patch_size=2,
    )
    tokens = {role: ids[token] for role, token in VISION_TOKEN_ROLES.items()}
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section}
        every = vision_full_attention_every or vision_depth
        vision.update(patch_size=14, window_size=56 if vision_full_attention_every == 0 else 112,
                      fullatt_block_indexes=list(range(every - 1, vision_depth, every)))
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied,
                                dtype=text["dtype"], **tokens)
    text.update(head_dim=hidden_size // num_attention_heads, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section, "mrope_interleaved": True})
    vision.update(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0],
                  hidden_act="gelu_pytorch_tanh")
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied, dtype=text["dtype"],
                         **tokens)


def _hf_model_class(config: Any) -> type:
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration if config.model_type == "qwen2_5_vl" else Qwen3VLForConditionalGeneration


def _hf_model(config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        model = _hf_model_class(config)(config)
    return model.to_empty(device="cpu").float().eval()


def _preprocessor_config(family: VLFamily, max_pixels: int) -> dict[str, Any]:
    """``Qwen2VLImageProcessorPil`` settings: the family's patch size, CLIP (Qwen2.5-VL) or 0.5 (Qwen3-VL) norms."""
    patch_size = 14 if family == "qwen2_5_vl" else 16
    mean, std = (([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])
                 if family == "qwen2_5_vl" else ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]))
    factor = patch_size * 2
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": patch_size, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": mean, "image_std": std, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True, "rescale_factor": 1 / 255,
        "size": {"shortest_edge": factor * factor, "longest_edge": max(max_pixels, factor * factor)},
    }




_COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
_SHAPES = ("square", "circle", "stripe")


def make_tiny_vl_data(folder: str | Path, num_rows: int = 32, *, seed: int = 0, image_size: tuple[int, int] = (56, 56),
                      text_only_every: int = 4) -> Path:
    """Write ``folder/train.jsonl`` and ``folder/images/*.png``: coloured shapes on grey, drawn by code, with a
    question about the picture and its short answer; every ``text_only_every``-th row (0: none) is text-only,
    and every third image row has two images. Returns the JSONL path. Deterministic in ``seed``."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    colours, rows = list(_COLOURS), []

    def draw(index: int) -> tuple[str, str, str]:
        colour = colours[int(torch.randint(len(colours), (1,), generator=generator))]
        shape = _SHAPES[int(torch.randint(len(_SHAPES), (1,), generator=generator))]
        image = Image.new("RGB", image_size, (128, 128, 128))
        pen = ImageDraw.Draw(image)
        w, h = image_size
        box = (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
        if shape == "square":
            pen.rectangle(box, fill=_COLOURS[colour])
        elif shape == "circle":
            pen.ellipse(box, fill=_COLOURS[colour])
        else:
            pen.rectangle((0, h // 3, w, 2 * h // 3), fill=_COLOURS[colour])
        name = f"images/{index:04d}.png"
        image.save(folder / name)
        return name, colour, shape

    for row in range(num_rows):
        if text_only_every and row % text_only_every == text_only_every - 1:
            rows.append({"messages": [{"role": "user", "content": "Say hello."},
                                      {"role": "assistant", "content": "Hello! How can I help?"}]})
            continue
        pictures = [draw(2 * row + i) for i in range(2 if row % 3 == 2 else 1)]
        content: list[dict[str, str]] = [{"type": "image", "image": name} for name, _, _ in pictures]
        content.append({"type": "text", "text": "What is in the picture?" if len(pictures) == 1
                        else "What is in the pictures?"})
        answer = " Then ".join(f"A {colour} {shape}." for _, colour, shape in pictures)
        rows.append({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]})
    jsonl = folder / "train.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return jsonl
