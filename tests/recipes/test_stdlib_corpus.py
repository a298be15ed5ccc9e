"""The MTP benchmark's inputs: a by-file, deterministic split of the stdlib; rows that SFTDataModule takes whole;
prompts the speculative evaluator reads; a checkpoint transformers loads, whose tokenizer round-trips code."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_megatron.data import SFTDataModule, read_jsonl, tokenize_examples
from lightning_megatron.data.jsonl import DataValidationError
from lightning_megatron.recipes.code_rows import Source, chunk_rows
from lightning_megatron.recipes.stdlib_corpus import (
    EOS,
    SIZES,
    parameter_counts,
    split_sources,
    stdlib_sources,
    train_tokenizer,
)
from lightning_megatron.speculative.mtp_head import load_mtp_head, load_target
from lightning_megatron.speculative.report import encode_prompt, read_prompts

ROOT = Path(__file__).resolve().parents[2]
CODE = 'def greet(name: str) -> str:\n    """Say hello, «politely»."""\n    return f"hello, {name}!\\n"\n'


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The CPU size, written by the command line as the recipe runs it; its printed JSON summary."""
    out_dir = tmp_path_factory.mktemp("recipe") / "cpu"
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    completed = subprocess.run(
        [sys.executable, "-m", "lightning_megatron.recipes.stdlib_corpus", str(out_dir), "--size", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout)


@pytest.fixture(scope="module")
def manifest(built: dict[str, Any]) -> dict[str, Any]:
    return json.loads(Path(built["manifest"]).read_text())


@pytest.fixture(scope="module")
def sources() -> list[Source]:
    return stdlib_sources()[0]


def test_split_is_by_file_and_deterministic(sources: list[Source]) -> None:
    train, held_out = split_sources(sources, held_out_fraction=0.05, seed=0)
    train_paths, held_out_paths = {s.path for s in train}, {s.path for s in held_out}
    assert not train_paths & held_out_paths
    assert train_paths | held_out_paths == {s.path for s in sources}
    assert 0.02 < len(held_out) / len(sources) < 0.1
    assert not any("/test/" in f"/{path}" or "site-packages" in path for path in train_paths | held_out_paths)

    # a file's side depends on its path alone: not on the input order, nor on which other files exist
    shuffled = list(sources)
    random.Random(1).shuffle(shuffled)
    assert split_sources(shuffled, held_out_fraction=0.05, seed=0) == (train, held_out)
    half_train, half_held_out = split_sources(sources[::2], held_out_fraction=0.05, seed=0)
    assert {s.path for s in half_held_out} == {s.path for s in sources[::2]} & held_out_paths
    assert {s.path for s in half_train} == {s.path for s in sources[::2]} & train_paths

    other_train, other_held_out = split_sources(sources, held_out_fraction=0.05, seed=1)
    assert {s.path for s in other_held_out} != held_out_paths

    small_train, small_held_out = split_sources(sources, held_out_fraction=0.05, seed=0, max_files=40)
    assert len(small_train) == 38 and len(small_held_out) == 2
    assert {s.path for s in small_held_out} <= held_out_paths


def test_manifest_records_the_split(built: dict[str, Any], manifest: dict[str, Any]) -> None:
    assert manifest["files"]["train"] == len(manifest["train_files"]) == built["files"]["train"]
    assert manifest["files"]["held_out"] == len(manifest["held_out_files"]) >= 1
    assert not set(manifest["train_files"]) & set(manifest["held_out_files"])
    assert manifest["files"]["train"] + manifest["files"]["held_out"] == SIZES["cpu"].max_files
    assert manifest["seq_length"] == SIZES["cpu"].seq_length
    assert manifest["tokenizer"]["chat_template"] is None


def test_chunks_cover_the_file_at_line_ends_and_fit(sources: list[Source]) -> None:
    tokenizer = train_tokenizer([s.text for s in sources[:20]], 512)
    long_line = "table = [" + ", ".join(str(i) for i in range(3000)) + "]\n"
    synthetic = Source("synthetic.py", "import os\n\n\n" + long_line + "def f():\n    return os.sep\n" * 40)
    real = max(sources[:20], key=lambda s: len(s.text))
    for source in (synthetic, real):
        rows = chunk_rows([source], tokenizer, seq_length=96, prompt_tokens=8)
        assert [row.index for row in rows] == list(range(len(rows)))
        position = 0
        for row in rows:
            text = row.prompt + row.response
            start = source.text.index(text, position)
            # a skipped stretch is only whitespace or one line with nothing after its prompt
            assert not source.text[position:start].strip() or source.text[position:start].count("\n") <= 1
            line_start = source.text.rfind("\n", 0, start) + 1
            line = source.text[line_start : source.text.find("\n", start) + 1 or None]
            assert start == line_start or len(tokenizer.encode(line).ids) > 40  # cut in a line only if it is long
            position = start + len(text)
            assert row.tokens == len(tokenizer.encode(row.prompt).ids) + len(tokenizer.encode(row.response).ids) + 1
            assert row.tokens <= 96 and row.prompt.strip() and row.response.strip()
        assert not source.text[position:].strip() or source.text[position:].count("\n") <= 1
    assert any(len(row.response) > 96 for row in chunk_rows([synthetic], tokenizer, seq_length=96,
                                                             prompt_tokens=8))


def test_rows_fit_seq_length_through_sft_datamodule(built: dict[str, Any], manifest: dict[str, Any]) -> None:
    seq_length = built["seq_length"]
    data = SFTDataModule(train_path=built["train"], val_path=built["val"], hf_checkpoint=built["checkpoint"],
                         seq_length=seq_length, micro_batch_size=4, overlong="error")
    data.setup("fit")  # raises if any row is longer than seq_length
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, seq_length)

    tokenizer = AutoTokenizer.from_pretrained(built["checkpoint"])
    for split in ("train", "val"):
        examples, dropped = tokenize_examples(read_jsonl(built[split]), tokenizer, max_tokens=seq_length,
                                              overlong="error")
        assert dropped == 0 and len(examples) == manifest["rows"][split]
        assert sum(len(example) for example in examples) == manifest["tokens"][split]
        assert sum(example.trainable_tokens for example in examples) == manifest["tokens"][f"{split}_trained"]
        assert all(example.input_ids[-1] == tokenizer.eos_token_id for example in examples)
    assert manifest["tokens"]["train_trained"] > 0.9 * manifest["tokens"]["train"]
    assert manifest["tokens"]["train"] > 0.8 * seq_length * manifest["rows"]["train"]  # rows are nearly full

    with pytest.raises(DataValidationError, match="overlong='error'"):
        SFTDataModule(train_path=built["train"], hf_checkpoint=built["checkpoint"], seq_length=seq_length // 2,
                      micro_batch_size=1, overlong="error").setup("fit")


def test_prompts_load_with_read_prompts(built: dict[str, Any], manifest: dict[str, Any]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built["checkpoint"])
    stdlib = Path(manifest["stdlib"])
    for name, files, count in (("heldout_prompts", manifest["held_out_files"], SIZES["cpu"].heldout_prompts),
                               ("train_prompts", manifest["train_files"], SIZES["cpu"].train_prompts)):
        prompts = read_prompts(built[name])
        assert len(prompts) == count == built["prompts"][name.removesuffix("_prompts")]
        assert len(set(prompts)) == len(prompts)
        texts = [(stdlib / path).read_text(encoding="utf-8") for path in files]
        for prompt in prompts:
            assert 8 <= len(encode_prompt(tokenizer, prompt)) <= manifest["eval_prompt_tokens"]
            assert prompt == prompt.rstrip() and any(prompt in text for text in texts)
        assert len(read_jsonl(built[name], for_prediction=True)) == count  # SFTDataModule's predict rows


def test_checkpoint_loads_and_tokenizer_round_trips(built: dict[str, Any], manifest: dict[str, Any]) -> None:
    checkpoint = Path(built["checkpoint"])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.chat_template is None
    assert tokenizer.eos_token == tokenizer.pad_token == EOS and tokenizer.eos_token_id == 0
    assert len(tokenizer) == SIZES["cpu"].vocab_size
    held_out_text = (Path(manifest["stdlib"]) / manifest["held_out_files"][0]).read_text(encoding="utf-8")
    for text in (CODE, held_out_text):
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert len(tokenizer(held_out_text)["input_ids"]) < 0.75 * len(held_out_text.encode())  # merges learnt from code

    config = json.loads((checkpoint / "config.json").read_text())
    shape = SIZES["cpu"]
    assert config["model_type"] == "qwen3" and config["num_nextn_predict_layers"] == 1
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (
        shape.hidden_size, shape.num_layers, shape.head_dim)
    assert config["vocab_size"] == shape.vocab_size and not config["tie_word_embeddings"]

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    counts = parameter_counts(checkpoint)
    assert counts == built["parameters"]
    assert counts["total"] - counts["mtp"] == sum(parameter.numel() for parameter in model.parameters())
    ids = torch.tensor([tokenizer(CODE)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], shape.vocab_size) and torch.isfinite(logits).all()

    head = load_mtp_head(checkpoint, load_target(checkpoint))  # what the speculative evaluator reads
    assert head.family == "qwen3"
