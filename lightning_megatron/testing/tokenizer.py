"""The tiny checkpoints' tokenizers: a byte-level BPE trained on a fixed corpus, ChatML specials and chat template.

Nothing is downloaded: the tokenizer is trained here from :data:`TOKENIZER_CORPUS`, so the same call gives the same
``tokenizer.json``. :func:`train_byte_level_bpe` also serves the recipes that train one on their own texts.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# The Qwen vision-language models' tokens: an image's span and its placeholder tokens (one per image token)
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VISION_SPECIAL_TOKENS = (VISION_START, VISION_END, "<|vision_pad|>", IMAGE_PAD, "<|video_pad|>")
VISION_TOKEN_ROLES = {"image_token_id": IMAGE_PAD, "video_token_id": "<|video_pad|>",
                      "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END}
"""The config.json keys of the Qwen-VL configs that name the vision tokens' ids."""

# Qwen-style ChatML. The {% generation %} block lets apply_chat_template(return_assistant_tokens_mask=True) mark
# the assistant reply (content and its <|im_end|>) as the part to train on.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Fixed training text for the byte-level BPE: English prose, chat-like lines and Python, so the merges are
# plausible for the prompts tests and the demo use. Changing it changes every tokenizer (and so every checkpoint).
TOKENIZER_CORPUS = '''\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and predicts the next
one. During training, the model sees many examples and slowly learns which words tend to follow which. The loss
goes down, the learning rate warms up and then decays, and the checkpoint is saved to disk at the end of every
epoch. Multi-token prediction adds a small extra head that guesses the token after the next one, which makes
speculative decoding faster: the draft head proposes tokens and the main model verifies them in one pass.

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: Can you write a function that adds two numbers?
Assistant: Sure. Here is a short Python function that returns the sum of its two arguments.
User: Thank you! How do I run the tests?
Assistant: Install the package, then run pytest from the repository root. Every test should pass in a few seconds.
System: You are a helpful assistant. Answer briefly and correctly, and say when you do not know.

Tensor parallelism splits each weight matrix across devices, pipeline parallelism splits the layers, and data
parallelism splits the batch. The optimizer keeps a copy of the parameters in full precision, while the forward
and backward passes may run in bfloat16 to save memory and time. Gradients are reduced across the data parallel
group before the optimizer step. A learning rate that is too high makes the loss diverge; one that is too low
makes training slow. Always check that the validation loss follows the training loss.

import math
from pathlib import Path


def add(a: int, b: int) -> int:
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def step(self, amount: int = 1) -> int:
        self.value += amount
        return self.value


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle if line.strip()]


for index in range(10):
    if index % 2 == 0:
        print(f"even: {index}")
    else:
        print(f"odd: {index}, square root {math.sqrt(index):.3f}")

config = {"hidden_size": 64, "num_layers": 2, "vocab_size": 384, "learning_rate": 1e-3}
result = [add(x, y) for x, y in zip(range(5), range(5, 10))]
assert result == [5, 7, 9, 11, 13], result
'''


def build_tokenizer(vocab_size: int, extra_special_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """Byte-level BPE trained on the fixed corpus, so any text round-trips.

    The vocab is exactly ``vocab_size``: ChatML specials first (ids 0, 1, 2), then ``extra_special_tokens`` (e.g.
    :data:`VISION_SPECIAL_TOKENS`), the 256 bytes, the merges, and, when the corpus runs out of merges (past about
    900), ``<|reserved_N|>`` special tokens to fill up.
    """
    specials = [*SPECIAL_TOKENS, *extra_special_tokens]
    minimum = 256 + len(specials)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes + special tokens), got {vocab_size}")
    return train_byte_level_bpe([TOKENIZER_CORPUS], vocab_size, specials)


def train_byte_level_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """Byte-level BPE (any text round-trips) trained on ``texts``, ``special_tokens`` first, with exactly
    ``vocab_size`` ids: when the texts run out of merges, ``<|reserved_N|>`` special tokens fill up."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - tokenizer.get_vocab_size())])
    return tokenizer


def tokenizer_config(roles: dict[str, str], max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: tokenizer.json used as-is, its specials, the ChatML chat template if it has ChatML."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": roles["eos"],
        "pad_token": roles["pad"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    if roles["eos"] == IM_END:
        config["chat_template"] = CHAT_TEMPLATE
    return config


def special_token_roles(tokenizer: Tokenizer) -> dict[str, str]:
    """bos/eos/pad token strings: the ChatML ones if the tokenizer has all of them, else its first special token."""
    if all(tokenizer.token_to_id(token) is not None for token in SPECIAL_TOKENS):
        return {"bos": ENDOFTEXT, "eos": IM_END, "pad": ENDOFTEXT}
    specials = sorted((i, t.content) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    if not specials:
        raise ValueError(
            "the given tokenizer has neither the ChatML tokens (<|endoftext|>, <|im_start|>, <|im_end|>) nor any "
            "special token to use as bos/eos/pad; add one with tokenizer.add_special_tokens([...])"
        )
    first = specials[0][1]
    return {"bos": first, "eos": first, "pad": first}

