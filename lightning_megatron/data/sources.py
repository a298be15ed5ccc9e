"""Where SFT rows come from: a JSONL file, a Parquet file, or a folder an HF ``datasets`` ``save_to_disk`` wrote.

Every format has the same row schemas (``messages``; ``prompt`` + ``response`` or TRL's ``completion``; either with
``response_token_ids``) and the same checks (``jsonl.parse_record``), and a bad row is named by where it is: the
line of a JSONL file (``path:line``, counting from 1 as editors do) or the row of a table (``path:row N``, counting
from 0 as ``dataset[N]`` and ``pandas.DataFrame.iloc[N]`` do). A null field counts as an absent key in every format,
since a Parquet column exists for every row and pandas' JSONL of the same frame writes its empty cells as null.

Tables are read with pyarrow, one record batch at a time, so a large file is never held whole. A saved HF
``datasets`` folder is Arrow IPC streams listed in its ``state.json``: pyarrow reads them directly, so reading
needs no ``datasets`` (the GPU machine has none) and gives exactly the rows ``datasets.load_from_disk`` would.

``fingerprint`` is the content hash the tokenized-data cache keys on: xxh3-128 of the file's bytes (of a saved
folder's ``state.json`` and data files), so a renamed or copied file finds its cache and an edited one does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_megatron.data.jsonl import (
    PREDICT_ROW_HELP,
    VALID_ROW_HELP,
    DataValidationError,
    Example,
    decoded,
    jsonl_lines,
    parse_json_row,
    parse_record,
    parse_rows,
)

_JOIN_FILES = ("Several files are one path once joined: JSONL files with cat, Parquet files with "
               "datasets.load_dataset('parquet', data_files=[...], split='train').save_to_disk(folder)")
RawRow = tuple[int, Any]  # (line or row number, the row: a JSONL line as bytes or a table row as a dict)
_HASH_BLOCK = 8 << 20


def data_format(path: str | Path) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"hf_datasets"`` for ``path``; a clear error for what cannot be read."""
    path = Path(path)
    if path.is_dir():
        if (path / "state.json").is_file():
            return "hf_datasets"
        if (path / "dataset_dict.json").is_file():
            splits = sorted(child.name for child in path.iterdir() if (child / "state.json").is_file())
            raise ValueError(f"{path} is a saved HF DatasetDict; point the path at one of its splits: "
                             + ", ".join(str(path / split) for split in splits))
        raise ValueError(f"{path} is a folder but not one HF datasets' save_to_disk wrote (no state.json); SFT data "
                         f"is a JSONL file, a Parquet file or a saved HF datasets folder. {_JOIN_FILES}")
    if not path.is_file():
        if any(character in path.name for character in "*?["):
            raise FileNotFoundError(f"SFT data file {str(path)!r} does not exist: a data path is one file or folder, "
                                    f"not a pattern. {_JOIN_FILES}")
        raise FileNotFoundError(f"SFT data file {str(path)!r} does not exist")
    return "parquet" if path.suffix.lower() in (".parquet", ".pq") else "jsonl"


def iter_raw_rows(path: str | Path) -> Iterator[RawRow]:
    """Every row of ``path`` unparsed, with its line (JSONL, from 1) or row (tables, from 0) number; blank JSONL
    lines are skipped (they still count lines), a byte order mark is dropped (``jsonl.jsonl_lines``)."""
    path = Path(path)
    kind = data_format(path)
    if kind == "jsonl":
        yield from jsonl_lines(path)
        return
    row = 0
    for batch in _record_batches(path, kind):
        for record in batch.to_pylist():
            yield row, record
            row += 1


def source_name(path: str | Path, number: int, lines: bool) -> str:
    """``path:line`` (JSONL, ``lines``) or ``path:row N`` (a table), the prefix of every message about a row."""
    return f"{path}:{number}" if lines else f"{path}:row {number}"


def parse_raw_row(raw: Any, source: str, for_prediction: bool = False) -> Example:
    """An unparsed row as an :class:`Example`; ``ValueError`` says what is wrong."""
    if isinstance(raw, bytes):
        return parse_json_row(decoded(raw), source, for_prediction)
    return parse_record(raw, source, for_prediction)


def read_examples(path: str | Path, *, for_prediction: bool = False) -> list[Example]:
    """Every row of a JSONL, Parquet or saved HF datasets ``path``, validated; all problems raised together."""
    help_text = PREDICT_ROW_HELP if for_prediction else VALID_ROW_HELP
    lines = data_format(path) == "jsonl"
    rows = ((source_name(path, number, lines), raw) for number, raw in iter_raw_rows(path))
    return parse_rows(path, rows, lambda raw, source: parse_raw_row(raw, source, for_prediction), help_text)


def fingerprint(path: str | Path) -> str:
    """xxh3-128 of the data's bytes (a saved folder: its ``state.json`` and data files, in order)."""
    import xxhash

    digest = xxhash.xxh3_128()
    files = _content_files(Path(path))
    for file in files:
        if len(files) > 1:  # a saved folder: its file names are part of its content
            digest.update(file.name.encode() + b"\0")
        with file.open("rb", buffering=0) as handle:
            while block := handle.read(_HASH_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def size_of(path: str | Path) -> int:
    """The bytes the data holds (for progress as a share of the input)."""
    return sum(file.stat().st_size for file in _content_files(Path(path)))


def _content_files(path: Path) -> list[Path]:
    if data_format(path) == "hf_datasets":
        return [path / "state.json", *_arrow_files(path)]
    return [path]


def _arrow_files(folder: Path) -> list[Path]:
    state = json.loads((folder / "state.json").read_text())
    files = [folder / entry["filename"] for entry in state.get("_data_files", [])]
    missing = [str(file) for file in files if not file.is_file()]
    if missing or not files:
        raise ValueError(f"{folder}/state.json lists data files that are not there: {missing or 'none listed'}; "
                         "save the dataset again with save_to_disk")
    return files


def _record_batches(path: Path, kind: str) -> Iterator[Any]:
    """The table's record batches; a file pyarrow cannot read (not Parquet, truncated, damaged) is named, with
    what to do, as a :class:`DataValidationError` (pyarrow's own error names neither the file nor the fix)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        try:
            yield from pq.ParquetFile(path).iter_batches(batch_size=4096)
        except pa.ArrowException as error:
            raise DataValidationError(f"{path} is not a readable Parquet file ({error}); a file ending in .parquet "
                                      "or .pq is read as Parquet: write it again (pandas' to_parquet, "
                                      "pyarrow.parquet.write_table) or name a JSONL file .jsonl") from None
        return
    for file in _arrow_files(path):
        try:
            with pa.memory_map(str(file)) as source:
                yield from pa.ipc.open_stream(source)
        except pa.ArrowException as error:
            raise DataValidationError(f"{file} is not a readable Arrow stream ({error}); save the dataset again "
                                      "with save_to_disk") from None
