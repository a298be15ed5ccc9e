"""Sources as users write them: JSONL from Windows tools (a byte order mark, CRLF, no final newline), compressed
files, pandas' JSONL of a frame mixing both schemas (null fields), and files pyarrow cannot read, each refused or
read with the same rows as a plain file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_megatron.data import DataValidationError, SFTDataModule, read_jsonl
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests.data.test_cache import assert_same_batches, batches, chat_rows, write_hf_datasets, write_jsonl
from tests.data.test_data import CONVERSATION, GOOD


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sources") / "qwen3")


def test_a_byte_order_mark_crlf_line_ends_and_no_final_newline_read_as_plain_jsonl(tmp_path: Path,
                                                                                     checkpoint: Path) -> None:
    """What Windows editors and Excel's "CSV UTF-8" write: the first row is a row like any other."""
    rows = [{"prompt": "Hi", "response": "Hello."}, {"messages": CONVERSATION}]
    lines = [json.dumps(row, ensure_ascii=False).encode() for row in rows]
    windows = tmp_path / "windows.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + lines[0] + b"\r\n\r\n" + lines[1])
    plain = write_jsonl(tmp_path / "plain.jsonl", rows)
    assert [example.source for example in read_jsonl(windows)] == [f"{windows}:1", f"{windows}:3"]
    options = dict(hf_checkpoint=str(checkpoint), seq_length=96, micro_batch_size=2, cache_dir=str(tmp_path / "c"))
    got, expected = SFTDataModule(str(windows), **options), SFTDataModule(plain, **options)
    got.setup("fit")
    expected.setup("fit")
    assert [got.datasets["train"][i]["input_ids"].tolist() for i in range(2)] == [
        expected.datasets["train"][i]["input_ids"].tolist() for i in range(2)]


@pytest.mark.parametrize("tokenize_workers", [1, 2])
def test_a_compressed_file_is_refused_once_naming_how_to_decompress(tmp_path: Path, checkpoint: Path,
                                                                     tokenize_workers: int) -> None:
    """With a pool of tokenizing processes too, as the command line's one-line error (raised where it was)."""
    import gzip

    from lightning_megatron.cli.user_errors import is_input_error

    path = tmp_path / "train.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode() * 20))
    datamodule = SFTDataModule(str(path), hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1,
                               cache_dir=str(tmp_path / "cache"), tokenize_workers=tokenize_workers)
    with pytest.raises(DataValidationError, match=rf"^{path} is gzip-compressed, not JSONL text; decompress it first "
                                                  r"\(gunzip -k train.jsonl.gz\)") as error:
        datamodule.setup("fit")
    assert is_input_error(error.value)


def test_a_frame_mixing_both_schemas_gives_the_same_rows_as_jsonl_and_as_parquet(tmp_path: Path,
                                                                                  checkpoint: Path) -> None:
    """pandas writes the other schema's fields of a row as null in JSONL (to_json) and in Parquet alike."""
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame(chat_rows(8))
    jsonl, parquet = tmp_path / "rows.jsonl", tmp_path / "rows.parquet"
    frame.to_json(jsonl, orient="records", lines=True)
    frame.to_parquet(parquet)
    assert '"prompt":null' in jsonl.read_text()
    options = dict(hf_checkpoint=str(checkpoint), seq_length=128, packing=True, micro_batch_size=1,
                   cache_dir=str(tmp_path / "cache"))
    assert_same_batches(batches(SFTDataModule(str(jsonl), **options)), batches(SFTDataModule(str(parquet), **options)))


def test_a_file_pyarrow_cannot_read_is_named_with_the_fix(tmp_path: Path, checkpoint: Path) -> None:
    jsonl = write_jsonl(tmp_path / "rows.jsonl", chat_rows(1))
    not_parquet = tmp_path / "rows.parquet"
    not_parquet.write_bytes(Path(jsonl).read_bytes())  # JSONL under a Parquet name: its bytes' cache is not its own
    SFTDataModule(jsonl, hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1,
                  cache_dir=str(tmp_path / "cache")).setup("fit")
    saved = Path(write_hf_datasets(tmp_path / "rows_hf", chat_rows(4)))
    damaged = next(saved.glob("*.arrow"))
    damaged.write_bytes(damaged.read_bytes()[:40])
    cases = {not_parquet: rf"^{not_parquet} is not a readable Parquet file \(.*\); a file ending in .parquet or .pq is",
             saved: rf"^{damaged} is not a readable Arrow stream \(.*\); save the dataset again with save_to_disk"}
    for path, message in cases.items():
        datamodule = SFTDataModule(str(path), hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1,
                                   cache_dir=str(tmp_path / "cache"))
        with pytest.raises(DataValidationError, match=message):
            datamodule.setup("fit")
