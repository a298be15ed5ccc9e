"""The tokenized-data cache and the table formats: two ranks tokenize a file once and a second run not at all, with
the batches and losses of the in-memory pipeline; a changed input makes a new cache, a damaged one is rebuilt;
Parquet and saved HF datasets folders give JSONL's batches and name their bad rows; tokenizing is quiet."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from lightning_megatron.data import DataValidationError, SFTDataModule, first_fit, read_jsonl, tokenize_examples
from lightning_megatron.data.cache import CacheSpec, cache_key, open_or_build
from lightning_megatron.data.packing import PackedSFTDataset, sequence_alignment
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_distributed

SPEC = CacheSpec(seq_length=128, overlong="truncate", packing=True, alignment=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cache") / "qwen3")


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Any:
    return AutoTokenizer.from_pretrained(checkpoint)


def chat_rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of every schema: messages (one or two assistant turns), prompt/response, prompt/completion, and a
    messages row whose answer is given as token ids."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta data token rank cache answer question".split()
    rows: list[dict[str, Any]] = []
    for index in range(count):
        text = " ".join(rng.choices(words, k=rng.randint(2, 10)))
        kind = index % 4
        if kind == 0:
            rows.append({"messages": [{"role": "user", "content": f"Q{index}?"},
                                      {"role": "assistant", "content": text}]})
        elif kind == 1:
            rows.append({"prompt": f"Say {index}.", "response": text})
        elif kind == 2:
            rows.append({"prompt": f"Tell {index}.", "completion": text})
        else:
            rows.append({"messages": [{"role": "user", "content": f"Q{index}?"},
                                      {"role": "assistant", "content": "ok"},
                                      {"role": "user", "content": text}, {"role": "assistant", "content": "done"}],
                         "response_token_ids": [rng.randrange(5, 300) for _ in range(rng.randint(1, 6))]})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    """As most SFT Parquet files are made: a DataFrame, its absent cells null."""
    pandas = pytest.importorskip("pandas")
    pandas.DataFrame(rows).to_parquet(path)
    return str(path)


def write_hf_datasets(path: Path, rows: list[dict[str, Any]]) -> str:
    """``save_to_disk`` of a dataset holding every row's keys (``from_list`` would keep the first row's only)."""
    datasets, pandas = pytest.importorskip("datasets"), pytest.importorskip("pandas")
    datasets.Dataset.from_pandas(pandas.DataFrame(rows), preserve_index=False).save_to_disk(str(path))
    return str(path)


def batches(datamodule: SFTDataModule) -> list[dict[str, torch.Tensor]]:
    datamodule.setup("fit")
    return list(datamodule.train_dataloader())


def assert_same_batches(ours: list[dict[str, torch.Tensor]], reference: list[dict[str, torch.Tensor]]) -> None:
    assert len(ours) == len(reference) > 0
    for step, (got, expected) in enumerate(zip(ours, reference)):
        assert got.keys() == expected.keys()
        for key in expected:  # `max_seqlen` of a packed row is a host int (no device read per microbatch)
            same = torch.equal(got[key], expected[key]) if torch.is_tensor(expected[key]) else got[key] == expected[key]
            assert same, (step, key)


class TodaysPipeline(SFTDataModule):
    """The pipeline before the cache: every row read and tokenized in memory, one tensor pair per row, packed."""

    def _build_dataset(self, split: str, path: str) -> PackedSFTDataset:
        examples, _ = tokenize_examples(read_jsonl(path), self.tokenizer, max_tokens=self.seq_length,
                                        overlong=self.overlong)
        return PackedSFTDataset(examples, self.seq_length, self.pad_id, sequence_alignment(self.context_parallel_size))


# --- two ranks, two runs -------------------------------------------------------------------------------------------


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batches.append(torch.utils._pytree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, batch))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _fits(rank: int, world_size: int, tmp: str, hf_checkpoint: str, train: str) -> dict[str, Any]:
    from lightning_megatron.module import SFTModule
    from lightning_megatron.strategy import MegatronStrategy

    results: dict[str, Any] = {}
    cache = Path(tmp) / "cache"
    for run in ("today", "first", "second"):
        kind = TodaysPipeline if run == "today" else SFTDataModule
        datamodule = kind(train, seq_length=128, packing=True, cache_dir=str(cache), tokenize_workers=1)
        recorder = Recorder()
        strategy = MegatronStrategy(hf_checkpoint=hf_checkpoint, micro_batch_size=1, global_batch_size=2,
                                    precision="fp32")
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=4, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, default_root_dir=Path(tmp) / run / f"rank{rank}",
                             callbacks=[recorder])
        trainer.fit(SFTModule(lr=1e-3, warmup_steps=1), datamodule)
        files = {str(file): (file.stat().st_ino, file.stat().st_mtime_ns) for file in cache.rglob("*.*")
                 if not file.name.endswith(".lock")}
        results[run] = {"batches": recorder.batches, "losses": recorder.losses, "files": files,
                        "built": datamodule.cache_built.get("train")}
    return results


@pytest.mark.slow
def test_two_ranks_tokenize_once_a_second_run_not_at_all_with_the_in_memory_batches_and_losses(checkpoint, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(48))
    ranks = run_distributed(_fits, tmp_path, str(tmp_path), str(checkpoint), train)

    assert [rank["first"]["built"] for rank in ranks].count(True) == 1  # one rank wrote the cache, one read it
    assert [rank["second"]["built"] for rank in ranks] == [False, False]  # the second run tokenized nothing
    assert ranks[0]["first"]["files"] == ranks[0]["second"]["files"] != {}  # and wrote nothing
    for rank in ranks:
        for run in ("first", "second"):
            assert len(rank[run]["batches"]) == 4
            for got, expected in zip(rank[run]["batches"], rank["today"]["batches"]):
                got, expected = tensors(got), tensors(expected)
                assert got.keys() == expected.keys()
                assert all(torch.equal(got[key], expected[key]) for key in expected), run
            assert rank[run]["losses"] == rank["today"]["losses"]
    first = [tensors(rank["first"]["batches"][0]) for rank in ranks]
    names = {key.rsplit("['", 1)[-1].rstrip("']"): key for key in first[0]}  # "[0]['input_ids']": micro-batch 0
    assert {"input_ids", "labels", "loss_mask", "cu_seqlens"} <= names.keys()
    ids = names["input_ids"]
    assert not torch.equal(first[0][ids], first[1][ids])  # each rank reads its own shard


def tensors(batch: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a batch by its place in it (``['input_ids']``)."""
    leaves, _ = torch.utils._pytree.tree_flatten_with_path(batch)
    return {torch.utils._pytree.keystr(path): leaf for path, leaf in leaves if torch.is_tensor(leaf)}


# --- keys, damage, concurrency -------------------------------------------------------------------------------------


def test_a_changed_file_tokenizer_or_seq_length_makes_a_new_cache(tmp_path: Path, checkpoint: Path,
                                                                   tokenizer: Any) -> None:
    rows = chat_rows(12)
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    root = tmp_path / "cache"
    first, built = open_or_build(path, tokenizer, SPEC, cache_root=root)
    assert built and len(first) == 12 and first.plan is not None
    again, built = open_or_build(path, tokenizer, SPEC, cache_root=root)
    assert not built and again.key == first.key
    copy = write_jsonl(tmp_path / "copy.jsonl", rows)  # the same bytes elsewhere: found by content
    assert not open_or_build(copy, tokenizer, SPEC, cache_root=root)[1]

    edited = write_jsonl(tmp_path / "a.jsonl", rows[:-1] + [{"prompt": "Hi", "response": "changed"}])
    retemplated = AutoTokenizer.from_pretrained(checkpoint)
    retemplated.chat_template = retemplated.chat_template.replace("<|im_start|>", "<|im_start|> ")
    changes = {"file": (edited, tokenizer, SPEC), "tokenizer": (copy, retemplated, SPEC),
               "seq_length": (copy, tokenizer, CacheSpec(96, "truncate", True, 1)),
               "alignment": (copy, tokenizer, CacheSpec(128, "truncate", True, 4)),
               "overlong": (copy, tokenizer, CacheSpec(128, "drop", True, 1))}
    keys = {first.key}
    for what, (data, tok, spec) in changes.items():
        rows_now, built = open_or_build(data, tok, spec, cache_root=root)
        assert built and rows_now.key not in keys, what
        keys.add(rows_now.key)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == sorted(keys)
    assert cache_key(copy, tokenizer, SPEC) == first.key


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte", "drop_the_manifest"])
def test_a_damaged_cache_is_rebuilt_not_read(tmp_path: Path, tokenizer: Any, damage: str, capfd) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", chat_rows(20))
    rows, _ = open_or_build(path, tokenizer, SPEC, cache_root=tmp_path / "cache")
    expected = [(row.input_ids.tolist(), row.response_mask.tolist()) for row in rows]
    data = rows.folder / "rows.arrow"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "flip_a_byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:
        (rows.folder / "manifest.json").unlink()
    del rows
    rebuilt, built = open_or_build(path, tokenizer, SPEC, cache_root=tmp_path / "cache")
    assert built
    assert "damaged tokenized-data cache" in capfd.readouterr().err
    assert [(row.input_ids.tolist(), row.response_mask.tolist()) for row in rebuilt] == expected


def test_what_a_killed_build_left_is_removed_by_the_next_build(tmp_path: Path, tokenizer: Any, capfd) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", chat_rows(6))
    root = tmp_path / "cache"
    key = cache_key(path, tokenizer, SPEC)
    abandoned = [root / f".{key}.partial-999999", root / f".{key}.old-999998"]  # a build killed mid-way
    other = root / ".another-key.partial-999999"  # another key's build, maybe running: not this one's to remove
    for folder in (*abandoned, other):
        folder.mkdir(parents=True)
        (folder / "rows.arrow").write_bytes(b"half-written")
    rows, built = open_or_build(path, tokenizer, SPEC, cache_root=root)
    assert built and len(rows) == 6
    assert not any(folder.exists() for folder in abandoned) and other.is_dir()
    assert "removing what an interrupted build of this cache left" in capfd.readouterr().err


def test_a_pool_of_workers_writes_the_same_cache_as_one_process(tmp_path: Path, tokenizer: Any, capfd) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", chat_rows(700))  # three chunks of 256 rows
    one, _ = open_or_build(path, tokenizer, SPEC, cache_root=tmp_path / "one")
    two, built = open_or_build(path, tokenizer, SPEC, cache_root=tmp_path / "two", workers=2, progress_every_s=0)
    assert built and one.manifest["files"] == two.manifest["files"]  # byte for byte (sizes and checksums)
    assert "rows/s" in capfd.readouterr().err  # the progress line


def test_first_fit_equals_the_scan_over_every_bin() -> None:
    def scan(lengths: list[int], capacity: int) -> list[list[int]]:
        remaining: list[int] = []
        bins: list[list[int]] = []
        for index, length in enumerate(lengths):
            target = next((b for b, room in enumerate(remaining) if room >= length), len(bins))
            if target == len(bins):
                bins.append([])
                remaining.append(capacity)
            bins[target].append(index)
            remaining[target] -= length
        return bins

    rng = random.Random(0)
    for _ in range(300):
        capacity = rng.randint(1, 64)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(0, 200))]
        assert first_fit(lengths, capacity) == scan(lengths, capacity)


# --- formats -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_parquet_and_hf_datasets_give_the_same_batches_as_jsonl(tmp_path: Path, checkpoint: Path,
                                                                packing: bool) -> None:
    rows = chat_rows(30)
    sources = {"jsonl": write_jsonl(tmp_path / "rows.jsonl", rows),
               "parquet": write_parquet(tmp_path / "rows.parquet", rows),
               "hf_datasets": write_hf_datasets(tmp_path / "rows_hf", rows)}
    options = dict(hf_checkpoint=str(checkpoint), seq_length=128, packing=packing, micro_batch_size=1 if packing else 2,
                   seed=5, cache_dir=str(tmp_path / "cache"))
    reference = batches(TodaysPipeline(sources["jsonl"], **options)) if packing else None
    jsonl = batches(SFTDataModule(sources["jsonl"], **options))
    if reference is not None:
        assert_same_batches(jsonl, reference)
    for kind in ("parquet", "hf_datasets"):
        assert_same_batches(batches(SFTDataModule(sources[kind], **options)), jsonl)


def test_a_bad_row_is_named_by_its_location_in_each_format(tmp_path: Path, checkpoint: Path) -> None:
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    bad = {"messages": [{"role": "bot", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    rows = [good, good, bad, good]
    cases = {write_jsonl(tmp_path / "rows.jsonl", rows): "rows.jsonl:3: ",
             write_parquet(tmp_path / "rows.parquet", rows): "rows.parquet:row 2: ",
             write_hf_datasets(tmp_path / "rows_hf", rows): "rows_hf:row 2: "}
    for path, where in cases.items():
        datamodule = SFTDataModule(path, hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1,
                                   cache_dir=str(tmp_path / "cache"))
        with pytest.raises(DataValidationError) as error:
            datamodule.setup("fit")
        assert f"{Path(path).parent}/{where}messages[0].role 'bot' is unknown" in str(error.value)
        assert "1 of 4 rows are malformed" in str(error.value)
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]  # nothing cached


def test_a_folder_that_is_not_one_saved_split_says_what_to_point_at(tmp_path: Path, checkpoint: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(chat_rows(4))}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "plain").mkdir()
    for folder, message in [("dict", r"is a saved HF DatasetDict; point the path at one of its splits: .*dict/train"),
                            ("plain", "not one HF datasets' save_to_disk wrote.*Several files are one path once "
                                      "joined"),
                            ("plain/*.parquet", r"does not exist: a data path is one file or folder, not a pattern. "
                                                "Several files are one path once joined")]:
        datamodule = SFTDataModule(str(tmp_path / folder), hf_checkpoint=str(checkpoint), seq_length=32,
                                   micro_batch_size=1)
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            datamodule.setup("fit")


def test_a_cache_dir_that_cannot_be_written_is_named_before_tokenizing(tmp_path: Path, checkpoint: Path) -> None:
    """A read-only folder, or a file where the folder should be (what a test running as root can make)."""
    path = write_jsonl(tmp_path / "rows.jsonl", chat_rows(4))
    occupied = tmp_path / "occupied"
    occupied.write_text("not a folder")
    for cache_dir in (occupied, occupied / "below"):
        datamodule = SFTDataModule(path, hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1,
                                   cache_dir=str(cache_dir))
        with pytest.raises(ValueError, match=rf"^{path} has no tokenized-data cache in {cache_dir} yet, and one "
                                             r"cannot be written there \(.*\); set data.cache_dir"):
            datamodule.setup("fit")


# --- noise ---------------------------------------------------------------------------------------------------------


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_tokenizing_drops_transformers_maximum_length_warning_only(tmp_path: Path, checkpoint: Path) -> None:
    rows = [{"prompt": "Hi", "response": "word " * 300}]  # truncated to seq_length, its start trained on
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    records = Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        direct = AutoTokenizer.from_pretrained(checkpoint)
        assert len(direct(rows[0]["response"])["input_ids"]) > direct.model_max_length  # a user's own call warns
        assert any("Token indices sequence length is longer" in message for message in records.messages)
        records.messages.clear()
        datamodule = SFTDataModule(path, hf_checkpoint=str(checkpoint), seq_length=64, micro_batch_size=1,
                                   cache_dir=str(tmp_path / "cache"))
        datamodule.setup("fit")
        assert len(datamodule.datasets["train"]) == 1
        tokenize_examples(read_jsonl(path), AutoTokenizer.from_pretrained(checkpoint), max_tokens=64)
        assert not [message for message in records.messages if "Token indices" in message]
    finally:
        logging.getLogger("transformers").removeHandler(records)


def test_a_rank_holds_the_rows_memory_mapped_not_as_tensors(tmp_path: Path, checkpoint: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", chat_rows(40))
    datamodule = SFTDataModule(path, hf_checkpoint=str(checkpoint), seq_length=128, packing=True, micro_batch_size=1,
                               cache_dir=str(tmp_path / "cache"))
    datamodule.setup("fit")
    rows = datamodule.datasets["train"].examples
    assert not isinstance(rows, list) and isinstance(rows.lengths, np.ndarray)
    assert not rows._ids[0].flags.owndata  # a view of the mapped file
    assert rows[3].source == f"{path}:4"



def _resident_kib(path: Path) -> int:
    """This process's resident pages of its maps of `path`, from /proc/self/smaps."""
    resident, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1])
    return resident


def test_a_rank_gives_back_the_pages_of_the_rows_it_has_read(tmp_path: Path, checkpoint: Path) -> None:
    """Reading rows faults pages of the map in (and the kernel reads ahead around each): every
    RELEASE_EVERY_ROWS reads they are dropped from the process, and the rows read afterwards are still right."""
    from lightning_megatron.data.cache import RELEASE_EVERY_ROWS

    path = write_jsonl(tmp_path / "rows.jsonl", chat_rows(RELEASE_EVERY_ROWS + 8))
    datamodule = SFTDataModule(path, hf_checkpoint=str(checkpoint), seq_length=128, micro_batch_size=1,
                               cache_dir=str(tmp_path / "cache"))
    datamodule.setup("fit")
    rows = datamodule.datasets["train"].examples
    mapped = rows.folder / "rows.arrow"
    first = [rows[index] for index in range(RELEASE_EVERY_ROWS - 1)]
    assert _resident_kib(mapped) > 0  # the rows read so far are resident
    rows[RELEASE_EVERY_ROWS - 1]
    assert _resident_kib(mapped) == 0  # given back
    again = [rows[index] for index in range(RELEASE_EVERY_ROWS - 1)]
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.response_mask, b.response_mask)
               for a, b in zip(first, again, strict=True))

# --- where the cache lives -----------------------------------------------------------------------------------------


def test_the_default_cache_is_in_the_users_cache_directory(tmp_path: Path, checkpoint: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user_cache"))
    path = write_jsonl(tmp_path / "rows.jsonl", chat_rows(8))
    datamodule = SFTDataModule(path, hf_checkpoint=str(checkpoint), seq_length=128, micro_batch_size=1)
    datamodule.setup("fit")
    rows = datamodule.datasets["train"].examples
    assert rows.folder == tmp_path / "user_cache" / "lightning_megatron" / "data" / rows.key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl", "user_cache"]  # nothing beside the data


def test_the_command_line_takes_the_cache_options() -> None:
    import yaml

    from tests.cli.test_megatron_cli import ROOT, _env

    completed = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "fit", "--config",
                                "configs/tiny/mtp_only.yaml", "--data.cache_dir", "/data/cache",
                                "--data.tokenize_workers", "3", "--print_config"],
                               cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed = yaml.safe_load(completed.stdout)["data"]
    assert (printed["cache_dir"], printed["tokenize_workers"]) == ("/data/cache", 3)
