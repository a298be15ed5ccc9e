"""Reading SFT JSONL and rejecting malformed rows before a run starts, with every bad row named by file and line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROLES = ("system", "user", "assistant", "tool")

VALID_ROW_HELP = (
    "A valid row is one JSON object per line, either "
    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} '
    f"(roles: {', '.join(ROLES)}; the loss is on every assistant turn; other keys of a message, such as "
    '"tool_calls", reach the chat template as they are) '
    'or {"prompt": "...", "response": "..."} (the loss is on the response; "completion", TRL\'s name, works as '
    '"response"); either may add '
    '"response_token_ids": [...], the answer\'s exact token ids, trained on instead of its re-tokenized text.'
)
PREDICT_ROW_HELP = (
    'A valid prediction row is {"prompt": "..."} or {"messages": [..., {"role": "user", "content": "..."}]} '
    "(a conversation that ends with a turn to answer)."
)
_SHOWN_ERRORS = 5
_UTF8_BOM = b"\xef\xbb\xbf"
_COMPRESSED = {b"\x1f\x8b": ("gzip", "gunzip -k"), b"\x28\xb5\x2f\xfd": ("zstd", "zstd -d"),
               b"BZh": ("bzip2", "bunzip2 -k"), b"\xfd7zXZ\x00": ("xz", "unxz -k")}

T = TypeVar("T")


@dataclass(frozen=True)
class Example:
    """One validated row. Prompt/response rows keep their two fields: without a chat template they are tokenized
    as plain text, with one they are rendered as a user turn and an assistant turn."""

    source: str  # "path:line", for error messages
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    response: str | None = None  # None only for prompt-only prediction rows
    # the answer's exact token ids as a model generated them (ContinuationWriter writes them): trained on instead
    # of re-tokenizing the answer's text, which need not give the same ids back (byte-level BPE, cut-off bytes)
    response_token_ids: tuple[int, ...] | None = None

    def as_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return [dict(message) for message in self.messages]
        turns = [{"role": "user", "content": self.prompt}]
        if self.response is not None:
            turns.append({"role": "assistant", "content": self.response})
        return turns

    def without_answer(self) -> Example:
        """The row as a prediction prompt: the last assistant turn (or the response) removed."""
        if self.messages is not None:
            return Example(self.source, messages=self.messages[:-1])
        return Example(self.source, prompt=self.prompt)


class DataValidationError(ValueError):
    """Raised when rows of an SFT file are malformed; the message lists the first few as ``path:line: problem``."""


def raise_for_bad_rows(problems: list[str], total: int, help_text: str = VALID_ROW_HELP,
                       count: int | None = None) -> None:
    """Raise one :class:`DataValidationError` naming the first few of ``problems`` (each ``path:line: what``);
    ``count``: how many problems there are when ``problems`` keeps only the first few (default: all listed)."""
    count = len(problems) if count is None else count
    if not count:
        return
    shown = "\n".join(f"  {problem}" for problem in problems[:_SHOWN_ERRORS])
    more = f"\n  ... and {count - _SHOWN_ERRORS} more" if count > _SHOWN_ERRORS else ""
    raise DataValidationError(f"{count} of {total} rows are malformed:\n{shown}{more}\n{help_text}")


def read_jsonl(path: str | Path, *, for_prediction: bool = False) -> list[Example]:
    """Read and validate every row of ``path``; raise :class:`DataValidationError` if any row is malformed.

    Blank lines are skipped (line numbers still count them); keys other than ``messages``, ``prompt`` and
    ``response`` (or TRL's ``completion``) are ignored, so rows may carry ids or metadata. ``for_prediction`` accepts
    rows without an answer.
    """
    help_text = PREDICT_ROW_HELP if for_prediction else VALID_ROW_HELP
    return read_rows(path, lambda line, source: parse_json_row(line, source, for_prediction), help_text)


def read_rows(path: str | Path, parse_row: Callable[[str, str], T], help_text: str) -> list[T]:
    """Every non-blank row of ``path`` parsed by ``parse_row(line, source)``; all problems raised together as one
    :class:`DataValidationError`, each as ``path:line: what`` (``parse_row`` raises ``ValueError`` for a bad row)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file {str(path)!r} does not exist")
    lines = ((f"{path}:{line_number}", raw) for line_number, raw in jsonl_lines(path))
    return parse_rows(path, lines, lambda raw, source: parse_row(decoded(raw), source), help_text)


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Every non-blank line of a JSONL file as bytes, with its number (from 1, blank lines counted).

    A UTF-8 byte order mark before the first line (what Windows editors and Excel's "CSV UTF-8" write) is not part
    of the row; a compressed file is refused as a whole, naming how to decompress it, instead of as every line."""
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if line_number == 1:
                raw = raw.removeprefix(_UTF8_BOM)
                _refuse_compressed(path, raw)
            if raw.strip():
                yield line_number, raw


def _refuse_compressed(path: Path, first_line: bytes) -> None:
    for magic, (name, command) in _COMPRESSED.items():
        if first_line.startswith(magic):
            raise DataValidationError(f"{path} is {name}-compressed, not JSONL text; decompress it first "
                                      f"({command} {path.name}) and point the path at the .jsonl file")


def parse_rows(path: str | Path, rows: Iterable[tuple[str, Any]], parse_row: Callable[[Any, str], T],
               help_text: str) -> list[T]:
    """``parse_row(row, source)`` of every ``(source, row)``; all problems raised together (see :func:`read_rows`)."""
    examples: list[T] = []
    problems: list[str] = []
    count = 0
    for source, raw in rows:
        count += 1
        try:
            examples.append(parse_row(raw, source))
        except ValueError as error:
            problems.append(f"{source}: {error}")
    if count == 0:
        raise DataValidationError(f"{path} has no rows. {help_text}")
    raise_for_bad_rows(problems, count, help_text)
    return examples


def decoded(raw: bytes) -> str:
    """A line's text; ``ValueError`` when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not valid UTF-8") from None


def parse_json_row(line: str, source: str, for_prediction: bool) -> Example:
    """One JSONL line as an :class:`Example`; ``ValueError`` says what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON ({error.msg} at column {error.colno})") from None
    return parse_record(row, source, for_prediction)


def parse_record(row: Any, source: str, for_prediction: bool) -> Example:
    """One row (a JSON object, or a Parquet / Arrow row as a dict) as an :class:`Example`; ``ValueError`` says what
    is wrong with it. The same schemas and messages for every format."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {_type_name(row)}")
    # a null field is an absent key: a table has every column in every row, and pandas' to_json(lines=True) of a
    # frame mixing both schemas writes the other schema's fields as null
    row = {key: value for key, value in row.items() if value is not None}
    if "messages" in row and ("prompt" in row or "response" in row or "completion" in row):
        raise ValueError("has both 'messages' and 'prompt'/'response'; use one format per row")
    if "response" in row and "completion" in row:
        raise ValueError("has both 'response' and 'completion' (the same field under two names); keep one")
    answer_key = "completion" if "completion" in row else "response"
    token_ids = _parse_token_ids(row["response_token_ids"]) if "response_token_ids" in row else None
    if "messages" in row:
        messages = _parse_messages(row["messages"], for_prediction, answer_has_ids=token_ids is not None)
        if token_ids is not None and messages[-1]["role"] != "assistant":
            raise ValueError("has 'response_token_ids' but its last message is not the assistant turn they encode")
        return Example(source, messages=messages, response_token_ids=token_ids)
    if "prompt" not in row:
        raise ValueError(f"missing key 'messages' or 'prompt' (keys present: {sorted(row)})")
    prompt = row["prompt"]
    if not isinstance(prompt, str):
        raise ValueError(f"'prompt' must be a string, got {_type_name(prompt)}")
    if answer_key not in row:
        if for_prediction:
            return Example(source, prompt=prompt)
        raise ValueError("missing key 'response'")
    response = row[answer_key]
    if not isinstance(response, str):
        raise ValueError(f"{answer_key!r} must be a string, got {_type_name(response)}")
    if not response.strip() and token_ids is None:
        raise ValueError(f"{answer_key!r} is empty")
    return Example(source, prompt=prompt, response=response, response_token_ids=token_ids)


def _parse_token_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"'response_token_ids' must be a non-empty list of token ids (integers >= 0), "
                         f"got {_type_name(value)}")
    return tuple(value)


def _parse_messages(messages: Any, for_prediction: bool, answer_has_ids: bool = False) -> tuple[dict[str, Any], ...]:
    """The conversation as the chat template gets it: every message's ``role`` and ``content`` checked, its other
    keys (``tool_calls``, ``name``, ``tool_call_id``, ``reasoning_content``, ...) kept as they are, so a template
    that renders them does (a null one is left out: a table has every key in every message). An assistant turn that
    calls tools may have empty or null content, as OpenAI's format writes it."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' must be a non-empty list, got {_type_name(messages)}")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content', got {_type_name(message)}")
        calls_tools = bool(message.get("tool_calls"))
        for key in ("role", "content"):
            if key == "content" and message.get(key) is None and calls_tools:
                continue
            if key not in message:
                raise ValueError(f"{where} is missing key {key!r}")
            if key == "content" and isinstance(message[key], list):
                raise ValueError(f"{where}.content is a list of items (images and text): image + text rows are read by "
                                 "VLSFTDataModule; run `lightning-megatron-vl fit` with a Qwen2.5-VL or Qwen3-VL "
                                 "checkpoint, or give the content as a string")
            if not isinstance(message[key], str):
                raise ValueError(f"{where}.{key} must be a string, got {_type_name(message[key])}")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}.role {message['role']!r} is unknown (known roles: {', '.join(ROLES)})")
        content = message.get("content") or ""
        blank_allowed = for_prediction or calls_tools or (answer_has_ids and index == len(messages) - 1)
        if message["role"] == "assistant" and not blank_allowed and not content.strip():
            raise ValueError(f"{where} is an assistant turn with empty content; give it the answer's text, or "
                             "leave the turn out")
        others = {key: value for key, value in message.items() if key not in ("role", "content") and value is not None}
        parsed.append({"role": message["role"], "content": content, **others})
    if for_prediction and parsed[-1]["role"] == "assistant":
        raise ValueError("a prediction conversation must not end with an assistant turn")
    if not for_prediction and not any(message["role"] == "assistant" for message in parsed):
        raise ValueError("'messages' has no assistant turn to train on")
    return tuple(parsed)


def _type_name(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
