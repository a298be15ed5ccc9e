"""Rows to token ids and a response mask, with the checkpoint's own tokenizer and chat template.

The mask marks the tokens that are *answers* (every assistant turn, with the token that ends it); the loss is taken
where the next token, the label, is one of them. Packing and padding (``packing.py``) turn a token mask into the
label-aligned ``loss_mask``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from lightning_megatron.data.jsonl import Example, raise_for_bad_rows

Overlong = Literal["truncate", "drop", "error"]

_GENERATION_BLOCK = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # the test transformers itself applies
_LENGTH_WARNING = "Token indices sequence length is longer than the specified maximum sequence length"


@dataclass(frozen=True)
class TokenizedExample:
    source: str  # "path:line"
    input_ids: torch.Tensor  # int64 [n]
    response_mask: torch.Tensor  # bool [n]: the token belongs to a response

    def __len__(self) -> int:
        return self.input_ids.numel()

    @property
    def trainable_tokens(self) -> int:
        """Response tokens that are some position's label: every one but a response token at position 0."""
        return int(self.response_mask[1:].sum())


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def tokenize_example(example: Example, tokenizer: Any) -> TokenizedExample:
    """Token ids and response mask of one training row.

    With a chat template, the row is rendered as a conversation (a prompt/response row as one user turn and one
    assistant turn) and every assistant turn is trained on. Without one, only prompt/response rows are possible:
    ``prompt tokens + response tokens + eos``, trained on the response and the eos, so the model learns to stop.
    A row with ``response_token_ids`` is its prompt as :func:`tokenize_prompt` renders it followed by exactly
    those ids (a generated answer ends in its own end-of-sequence token, or is cut off without one).
    """
    if example.response_token_ids is not None:
        prompt = tokenize_prompt(example.without_answer(), tokenizer).tolist()
        response = list(example.response_token_ids)
        vocab_size = len(tokenizer)
        if max(response) >= vocab_size:
            raise ValueError(f"'response_token_ids' holds id {max(response)}, outside the tokenizer's "
                             f"vocabulary of {vocab_size}: the ids come from another model's tokenizer")
        ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
    elif has_chat_template(tokenizer):
        ids, mask = _chat_ids_and_mask(tokenizer, example.as_messages())
    elif example.messages is not None:
        raise ValueError(
            "is a 'messages' row, but the tokenizer has no chat template to render it; "
            "write prompt/response rows or use a checkpoint whose tokenizer has a chat template"
        )
    else:
        if tokenizer.eos_token_id is None:
            raise ValueError("cannot end the response: the tokenizer has no chat template and no eos token")
        prompt = tokenizer(example.prompt, add_special_tokens=True)["input_ids"]
        response = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
    return TokenizedExample(
        example.source, torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)
    )


def tokenize_prompt(example: Example, tokenizer: Any) -> torch.Tensor:
    """Token ids of a prediction row, ending where the model should start answering. A prompt/response row is
    prompted with its prompt alone, with or without a chat template (its response is the answer to replace, as
    ``ContinuationWriter`` writes the row back: an SFT file serves as prompts)."""
    if has_chat_template(tokenizer):
        prompt = example if example.messages is not None else Example(example.source, prompt=example.prompt)
        ids = _render(tokenizer, prompt.as_messages(), add_generation_prompt=True)
    elif example.messages is not None:
        raise ValueError("is a 'messages' row, but the tokenizer has no chat template to render it")
    else:
        ids = tokenizer(example.prompt, add_special_tokens=True)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def tokenize_examples(
    examples: list[Example], tokenizer: Any, *, max_tokens: int, overlong: Overlong = "truncate"
) -> tuple[list[TokenizedExample], int]:
    """Tokenize training rows and fit them into ``max_tokens``; returns ``(kept, number dropped)``.

    A row longer than ``max_tokens`` is cut to its first ``max_tokens`` tokens (``"truncate"``), left out
    (``"drop"``) or reported (``"error"``). A row left with no token to train on is reported (dropped with
    ``"drop"``). Every problem is raised at once as a :class:`DataValidationError` naming ``path:line``.
    """
    kept: list[TokenizedExample] = []
    problems: list[str] = []
    dropped = 0
    with quiet_length_warning():
        for example in examples:
            tokenized, problem, _ = fit_example(example, tokenizer, max_tokens=max_tokens, overlong=overlong)
            if problem is not None:
                problems.append(problem)
            elif tokenized is None:
                dropped += 1
            else:
                kept.append(tokenized)
    raise_for_bad_rows(problems, len(examples))
    return kept, dropped


class FittedRow(NamedTuple):
    """What :func:`fit_example` made of a row: ``row`` (None when left out or refused), ``problem``
    (``"path:line: what"`` when refused) and whether ``row`` was cut to fit (``truncated``)."""

    row: TokenizedExample | None
    problem: str | None = None
    truncated: bool = False


def fit_example(example: Example, tokenizer: Any, *, max_tokens: int, overlong: Overlong = "truncate") -> FittedRow:
    """One training row tokenized and fitted into ``max_tokens`` (the rules of :func:`tokenize_examples`)."""
    try:
        tokenized = tokenize_example(example, tokenizer)
    except ValueError as error:
        return FittedRow(None, f"{example.source}: {error}")
    length = len(tokenized)
    if length > max_tokens:
        if overlong == "drop":
            return FittedRow(None)
        if overlong == "error":
            return FittedRow(None, f"{example.source}: has {length} tokens, more than the {max_tokens} that fit "
                                   "(overlong='error'); raise seq_length or set overlong='truncate' or 'drop'")
        tokenized = TokenizedExample(
            example.source, tokenized.input_ids[:max_tokens], tokenized.response_mask[:max_tokens]
        )
    if tokenized.trainable_tokens == 0:
        if overlong == "drop":
            return FittedRow(None)
        cut = f" after truncating its {length} tokens to {max_tokens}" if length > max_tokens else ""
        return FittedRow(None, f"{example.source}: no response token left to train on{cut}; "
                               "raise seq_length, shorten the prompt, or set overlong='drop'")
    return FittedRow(tokenized, truncated=length > max_tokens)


@contextmanager
def quiet_length_warning() -> Iterator[None]:
    """Drop transformers' "Token indices sequence length is longer than the specified maximum sequence length"
    while the package tokenizes: it truncates, drops or packs rows itself (``overlong``), so the warning about the
    tokenizer's ``model_max_length`` is noise. Every other record of that logger still shows."""
    logger = logging.getLogger("transformers.tokenization_utils_base")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_LENGTH_WARNING)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def tokenize_prompts(
    examples: list[Example], tokenizer: Any, *, max_tokens: int, overlong: Overlong = "truncate"
) -> tuple[list[tuple[Example, torch.Tensor]], int, int]:
    """Tokenize prediction rows into ``(row, prompt ids)`` pairs (the row travels along, so that a continuation
    can be written back next to its prompt); a prompt longer than ``max_tokens`` keeps its *end* (where the turn
    to answer is) with ``"truncate"``, is left out with ``"drop"`` and reported with ``"error"``. Returns the
    pairs and how many prompts were left out and cut."""
    kept: list[tuple[Example, torch.Tensor]] = []
    problems: list[str] = []
    dropped = truncated = 0
    for example in examples:
        try:
            with quiet_length_warning():
                ids = tokenize_prompt(example, tokenizer)
        except ValueError as error:
            problems.append(f"{example.source}: {error}")
            continue
        if ids.numel() > max_tokens:
            if overlong == "drop":
                dropped += 1
                continue
            if overlong == "error":
                problems.append(f"{example.source}: the prompt has {ids.numel()} tokens, more than {max_tokens}")
                continue
            ids = ids[-max_tokens:]
            truncated += 1
        kept.append((example, ids))
    raise_for_bad_rows(problems, len(examples))
    return kept, dropped, truncated


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(_applied(tokenizer, messages, **kwargs)["input_ids"])


def _applied(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """``apply_chat_template`` (tokenized, as a dict); a template that refuses the conversation (Gemma's "System role
    not supported", Mistral's "Conversation roles must alternate": ``raise_exception`` in the template) is a
    ``ValueError`` about this row, so that it is reported with its ``path:line`` among the other bad rows."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except TemplateError as error:
        raise ValueError(f"the chat template refuses this conversation ({type(error).__name__}: {error}); "
                         "rewrite the row in the form the template accepts") from None


def _chat_ids_and_mask(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Render ``messages`` with the chat template and mark the assistant turns.

    A template with a ``{% generation %}`` block marks them itself (``return_assistant_tokens_mask``). Without
    one, each assistant turn ``i`` is found by rendering prefixes: its tokens run from the end of
    ``render(messages[:i], add_generation_prompt=True)`` (the assistant header) to the end of
    ``render(messages[:i + 1])``, cut after the last special token inside that span (the end-of-turn token:
    ChatML's ``<|im_end|>`` is one even where eos is ``<|endoftext|>``, as in base models' tokenizers), so
    separators the template puts after it (ChatML's newline) are not trained on. This needs the template to render a
    conversation's prefix as a prefix of its tokens; a template that does not (one that rewrites earlier turns,
    say) is rejected with a request for a ``{% generation %}`` block.
    """
    if _GENERATION_BLOCK.search(tokenizer.get_chat_template()):  # a dict of named templates: the one applied
        rendered = _applied(tokenizer, messages, return_assistant_tokens_mask=True)
        return list(rendered["input_ids"]), list(rendered["assistant_masks"])
    ids = _render(tokenizer, messages)
    mask = [0] * len(ids)
    special = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    special.add(tokenizer.eos_token_id)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = _render(tokenizer, messages[:turn], add_generation_prompt=True) if turn else []
        through_turn = _render(tokenizer, messages[: turn + 1])
        start, end = len(header), len(through_turn)
        if header != ids[:start] or through_turn != ids[:end] or start >= end:
            raise ValueError(
                "the chat template does not render the conversation's beginning as a prefix of the whole, so the "
                "assistant tokens cannot be found; use a chat template with a {% generation %} block"
            )
        ends_of_turn = [i for i in range(start, end) if ids[i] in special]
        if ends_of_turn:
            end = ends_of_turn[-1] + 1
        mask[start:end] = [1] * (end - start)
    return ids, mask
