"""Source files cut into SFT rows that ``SFTDataModule`` takes whole, and prompts from the heads of code.

The MTP benchmark's corpus (``stdlib_corpus``) feeds its train and held-out files through here: ``chunk_rows``
cuts each file at line ends into ``{"prompt", "response"}`` rows of at most ``seq_length`` tokens, counted the way
``SFTDataModule`` tokenizes them; ``head_prompt`` takes the first lines of a text that fit a token budget, the
prompts the speculative evaluator reads.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

_SLACK_TOKENS = 2  # a chunk's pieces tokenized alone may take a token or two more than inside the whole file
_MIN_PROMPT_TOKENS = 8


@dataclass(frozen=True)
class Source:
    """One source file: its text and its path (the key of the split and of row order)."""

    path: str  # relative to the stdlib folder, with forward slashes
    text: str


@dataclass(frozen=True)
class Row:
    """One SFT row: a chunk of ``path`` (its ``index``-th), ``tokens`` long as ``SFTDataModule`` tokenizes it."""

    path: str
    index: int
    prompt: str
    response: str
    tokens: int  # prompt + response + eos
    trained: int  # response + eos: every one is some position's label


def chunk_rows(
    sources: Sequence[Source], tokenizer: Tokenizer, *, seq_length: int, prompt_tokens: int
) -> list[Row]:
    """Cut each file at line ends into rows of at most ``seq_length`` tokens, eos included, in file order.

    Lines are grouped greedily by their token count inside the whole file; each row is then tokenized the way
    ``SFTDataModule`` does (prompt and response apart, plus eos), and one that does not fit (the pieces can take a
    token or two more apart) loses lines from its end to a row of its own. A line longer than half a row is cut
    at token boundaries. A chunk with nothing after its prompt is left out. Tokenization runs in batches, on
    every core.
    """
    if seq_length < 4 * _SLACK_TOKENS or prompt_tokens < 1:
        raise ValueError(f"seq_length={seq_length} and prompt_tokens={prompt_tokens} are too small for rows")
    budget = seq_length - 1 - _SLACK_TOKENS
    chunks: list[tuple[Source, list[str]]] = []  # a chunk's pieces: lines, or parts of a long line
    for source, encoding in zip(sources, tokenizer.encode_batch([source.text for source in sources])):
        pieces = _line_pieces(source.text, [start for start, _ in encoding.offsets], budget // 2)
        chunks += [(source, [source.text[start:end] for start, end, _ in group]) for group in _groups(pieces, budget)]
    splits = [_split("".join(chunk), tokenizer, prompt_tokens) for _, chunk in chunks]
    lengths = iter(_token_counts(tokenizer, [part for split in splits if split is not None for part in split]))
    rows: list[Row] = []
    for (source, chunk), split in zip(chunks, splits):
        if split is None:
            continue
        prompt_length, response_length = next(lengths), next(lengths)
        parts = [(*split, prompt_length, response_length)]
        if prompt_length + response_length + 1 > seq_length:
            parts = _fit(chunk, tokenizer, prompt_tokens, seq_length)
        index = rows[-1].index + 1 if rows and rows[-1].path == source.path else 0
        for offset, (prompt, response, prompt_length, response_length) in enumerate(parts):
            rows.append(Row(source.path, index + offset, prompt, response, prompt_length + response_length + 1,
                            response_length + 1))
    return rows


def head_prompt(text: str, tokenizer: Tokenizer, max_tokens: int) -> str | None:
    """The first lines of ``text`` (from its first non-blank line) that fit in ``max_tokens`` tokens, ending before
    a newline, so the model's first step is the next line, as in its training text. A first line longer than that
    is cut before a word. ``None`` if fewer than 8 tokens of content are there."""
    text = text[_first_content_line(text) :]
    limit = _cut(text, tokenizer, max_tokens)
    newline = text.rfind("\n", 0, limit)
    prompt = (text[:newline] if newline > 0 and text[:newline].strip() else text[:limit]).rstrip()
    if len(tokenizer.encode(prompt).ids) < _MIN_PROMPT_TOKENS or not prompt.strip():
        return None
    return prompt


def _line_pieces(text: str, token_starts: list[int], max_tokens: int) -> list[tuple[int, int, int]]:
    """``(start, end, tokens)`` character spans of the lines of ``text`` (newline included) with their token count
    inside the whole text; a line of more than ``max_tokens`` tokens becomes several pieces."""
    starts = [0] + [match.end() for match in re.finditer("\n", text) if match.end() < len(text)]
    pieces: list[tuple[int, int, int]] = []
    for start, end in zip(starts, starts[1:] + [len(text)]):
        first, last = bisect_left(token_starts, start), bisect_left(token_starts, end)
        while last - first > max_tokens:
            cut = token_starts[first + max_tokens]
            pieces.append((start, cut, max_tokens))
            start, first = cut, first + max_tokens
        pieces.append((start, end, max(last - first, 1)))
    return pieces


def _cut(text: str, tokenizer: Tokenizer, max_tokens: int) -> int:
    """Where the first ``max_tokens`` tokens of ``text`` end, moved back to the start of a token that begins with
    whitespace (a word's start, in byte-level BPE) after some content, if there is one: no word is split into a
    prompt's end and a response's start that the tokenizer would never produce for the whole word."""
    starts = [start for start, _ in tokenizer.encode(text[: 16 * max_tokens]).offsets]
    if len(starts) <= max_tokens + 2:  # the window's last word may tokenize differently: use the whole text
        starts = [start for start, _ in tokenizer.encode(text).offsets]
    if len(starts) <= max_tokens:
        return len(text)
    word_starts = [start for start in starts[1 : max_tokens + 1] if text[start].isspace() and text[:start].strip()]
    return word_starts[-1] if word_starts else starts[max_tokens]


def _first_content_line(text: str) -> int:
    """Offset of the first line with a non-whitespace character (0 if there is none)."""
    match = re.search(r"\S", text)
    return 0 if match is None else text.rfind("\n", 0, match.start()) + 1


def _groups(pieces: list[tuple[int, int, int]], budget: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive pieces, greedily grouped so that each group's token count stays within ``budget``."""
    groups: list[list[tuple[int, int, int]]] = []
    total = budget + 1
    for piece in pieces:
        if total + piece[2] > budget:
            groups.append([])
            total = 0
        groups[-1].append(piece)
        total += piece[2]
    return groups


def _split(chunk: str, tokenizer: Tokenizer, prompt_tokens: int) -> tuple[str, str] | None:
    """``(prompt, response)``: the prompt runs through the chunk's first line with content (without the newline),
    at most ``prompt_tokens`` tokens; ``None`` if nothing but whitespace would be left to train on."""
    content = re.search(r"\S", chunk)
    if content is None:
        return None
    newline = chunk.find("\n", content.start())
    line_end = len(chunk) if newline == -1 else newline
    line_end = min(line_end, _cut(chunk[:line_end], tokenizer, prompt_tokens))
    prompt, response = chunk[:line_end], chunk[line_end:]
    return (prompt, response) if response.strip() else None


def _fit(
    lines: list[str], tokenizer: Tokenizer, prompt_tokens: int, seq_length: int
) -> list[tuple[str, str, int, int]]:
    """Rows ``(prompt, response, prompt tokens, response tokens)`` of at most ``seq_length`` tokens from a chunk
    too long for one: each takes as many of the remaining lines as fit (a lone line that does not fit is left
    out)."""
    parts: list[tuple[str, str, int, int]] = []
    first = 0
    while first < len(lines):
        end = len(lines)
        while end > first:
            split = _split("".join(lines[first:end]), tokenizer, prompt_tokens)
            if split is None:
                break
            prompt_length, response_length = _token_counts(tokenizer, list(split))
            if prompt_length + response_length + 1 <= seq_length:
                parts.append((*split, prompt_length, response_length))
                break
            end -= 1
        first = max(end, first + 1)
    return parts


def _token_counts(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
    """Token counts of ``texts``, each tokenized alone (as ``SFTDataModule`` tokenizes a prompt and a response)."""
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts)]
