"""Tree packing: the trie builder against direct checks per original sequence (its ids along its path, the interval
rule against its ancestors, one label per row, weights that count original trainable tokens), the chain-only special
case against today's packing, and the datamodule's tree mode with its guards."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_megatron.data import SFTDataModule, TokenizedExample
from lightning_megatron.data.packing import first_fit, pack_examples
from lightning_megatron.data.tree import TreePacking, build_tree_rows, collate_tree
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PAD = 0


def _example(ids: list[int], prompt_length: int = 1, source: str = "t") -> TokenizedExample:
    mask = [False] * min(prompt_length, len(ids)) + [True] * max(0, len(ids) - prompt_length)
    return TokenizedExample(source, torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool))


def _random_forest(seed: int) -> list[TokenizedExample]:
    """Prompts with several responses that branch at random depths, exact duplicates, one-token sequences, and
    sequences that are prefixes of others; tokens from a small vocabulary so that accidental sharing happens too."""
    rng = random.Random(seed)
    examples = []
    for _ in range(rng.randint(2, 5)):
        prompt = [rng.randint(1, 4) for _ in range(rng.randint(1, 6))]
        responses = [[rng.randint(1, 4) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 4))]
        for response in responses:
            examples.append(_example(prompt + response, len(prompt)))
            if rng.random() < 0.3:
                examples.append(_example(prompt + response, len(prompt)))  # a duplicate
            if rng.random() < 0.3 and len(response) > 1:
                examples.append(_example(prompt + response[: rng.randint(1, len(response) - 1)], len(prompt)))
        if rng.random() < 0.5:
            examples.append(_example(prompt[:1], 1))  # one token, nothing to train
    rng.shuffle(examples)
    return examples


def _visible(subtree_end: torch.Tensor) -> torch.Tensor:
    """[s, s] bool, True where key k is visible to query q: k <= q < subtree_end[k]."""
    index = torch.arange(subtree_end.numel())
    return (index[None, :] <= index[:, None]) & (index[:, None] < subtree_end[None, :])


def _check_packing(examples: list[TokenizedExample], packing: TreePacking, seq_length: int) -> None:
    rows = packing.rows
    assert len(packing.paths) == len(examples)
    weights_seen = [torch.zeros(seq_length) for _ in rows]
    on_some_path = [torch.zeros(seq_length, dtype=torch.bool) for _ in rows]
    visible = [_visible(row["subtree_end"]) for row in rows]
    for example, (row_index, path) in zip(examples, packing.paths):
        row, n = rows[row_index], len(example)
        assert path.numel() == n
        assert torch.equal(row["input_ids"][path], example.input_ids)  # the ids along the path are the sequence
        assert torch.equal(row["position_ids"][path], torch.arange(n))  # depth = index in the sequence
        assert torch.equal(row["labels"][path[:-1]], example.input_ids[1:])  # one label per row, right everywhere
        for t in range(n):  # the interval rule gives exactly the ancestors (the path so far) and the token itself
            expected = torch.zeros(seq_length, dtype=torch.bool)
            expected[path[: t + 1]] = True
            assert torch.equal(visible[row_index][path[t]], expected)
        weights_seen[row_index][path[:-1]] += example.response_mask[1:].float()
        on_some_path[row_index][path] = True
    for row, weights, used in zip(rows, weights_seen, on_some_path):
        assert torch.equal(row["loss_mask"], weights)  # each row's weight counts the sequences training its label
        pads = ~used
        assert (row["input_ids"][pads] == PAD).all() and (row["loss_mask"][pads] == 0).all()
        assert torch.equal(row["subtree_end"][pads], torch.arange(1, seq_length + 1)[pads])  # self-only
        assert (row["position_ids"][pads] == 0).all()
        assert all(value.shape == (seq_length,) for value in row.values())
    assert sum(float(row["loss_mask"].sum()) for row in rows) == sum(e.trainable_tokens for e in examples)
    assert packing.tree_tokens == sum(int(used.sum()) for used in on_some_path)
    assert packing.original_tokens == sum(len(e) for e in examples)


@pytest.mark.parametrize("seed", range(6))
def test_random_forests_keep_every_sequence_exact(seed: int) -> None:
    examples = _random_forest(seed)
    seq_length = max(len(e) for e in examples) + random.Random(seed).randint(0, 12)
    packing = build_tree_rows(examples, seq_length, PAD)
    _check_packing(examples, packing, seq_length)
    again = build_tree_rows(examples, seq_length, PAD)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(packing.rows, again.rows, strict=True) for k in a)


def test_shared_prefixes_are_computed_once_and_branch_with_one_label_per_row() -> None:
    prompt = [5, 6, 7]
    examples = [_example(prompt + [1, 2], 3), _example(prompt + [1, 3], 3), _example(prompt + [1, 2], 3),
                _example(prompt + [1], 3), _example([9], 1)]
    packing = build_tree_rows(examples, 16, PAD)
    _check_packing(examples, packing, 16)
    row = packing.rows[0]
    # lookahead-1: 5 6 7 shared; "1" is duplicated per next token (2, 3, end); [9] is its own root
    assert row["input_ids"][:9].tolist() == [5, 6, 7, 1, 2, 1, 3, 1, 9]
    assert row["labels"][:9].tolist() == [6, 7, 1, 2, PAD, 3, PAD, PAD, PAD]
    assert row["loss_mask"][:9].tolist() == [0, 0, 4, 2, 0, 1, 0, 0, 0]
    assert row["subtree_end"][:9].tolist() == [8, 8, 8, 5, 5, 7, 7, 8, 9]
    assert packing.tree_tokens == 9 and packing.original_tokens == 20


def test_a_trie_too_large_for_a_row_is_split_and_tries_first_fit_in_order() -> None:
    prompt = list(range(1, 7))
    examples = [_example(prompt + [10 + i, 20 + i], 6) for i in range(5)] + [_example([30, 31, 32], 1)]
    packing = build_tree_rows(examples, 12, PAD)
    _check_packing(examples, packing, 12)
    # lookahead-1 shares 1..5 (the 6 has a different next token per response): 5 + 3 + 3 = 11 tokens per trie, a
    # third response would overflow, so each pair starts a new trie with the prompt again; [30, 31, 32] fits the
    # first row with room, the third (8 tokens)
    assert [row for row, _ in packing.paths] == [0, 0, 1, 1, 2, 2]
    assert packing.tree_tokens == 11 + 11 + 8 + 3
    with pytest.raises(ValueError, match="seq_length=4"):
        build_tree_rows([_example([1, 2, 3, 4, 5])], 4, PAD)


def test_chain_only_input_is_todays_packing() -> None:
    """Without shared prefixes every trie is a chain: the rows are first-fit packing's, token for token."""
    rng = random.Random(0)
    examples = [_example([100 + i] + [rng.randint(1, 50) for _ in range(rng.randint(1, 9))], 2) for i in range(9)]
    seq_length = 24
    packing = build_tree_rows(examples, seq_length, PAD)
    bins = first_fit([len(e) for e in examples], seq_length)
    assert len(packing.rows) == len(bins)
    for row, members in zip(packing.rows, bins):
        packed = pack_examples([examples[i] for i in members], seq_length, PAD)
        used = int(packed["cu_seqlens"][-2]) if len(packed["cu_seqlens"]) > len(members) + 1 else seq_length
        for key in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert torch.equal(row[key][:used], packed[key][:used]), key
        starts = packed["cu_seqlens"][:-1].tolist()
        ends = packed["cu_seqlens"][1:].tolist()
        for start, end in zip(starts[: len(members)], ends):  # a chain's subtree ends where its sequence does
            assert row["subtree_end"][start:end].tolist() == [end] * (end - start)


def test_collate_makes_one_row_micro_batches() -> None:
    row = build_tree_rows([_example([1, 2, 3])], 4, PAD).rows[0]
    batch = collate_tree([row])
    assert {key: tuple(value.shape) for key, value in batch.items()} == dict.fromkeys(row, (1, 4))
    with pytest.raises(ValueError, match="micro_batch_size=1"):
        collate_tree([row, row])


# --- the datamodule ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tree") / "qwen3")


def _datamodule(checkpoint: Path, **kwargs: Any) -> SFTDataModule:
    settings = dict(train_path=str(ROOT / "configs/data/tiny_tree_sft.jsonl"), hf_checkpoint=str(checkpoint),
                    seq_length=256, packing="tree", micro_batch_size=1, context_parallel_size=1)
    return SFTDataModule(**{**settings, **kwargs})


def test_datamodule_tree_mode_merges_the_responses_to_each_prompt(checkpoint: Path) -> None:
    tree = _datamodule(checkpoint)
    tree.setup("fit")
    padded = _datamodule(checkpoint, packing=False)
    padded.setup("fit")
    packing = tree.datasets["train"].packing
    originals = padded.datasets["train"].examples
    _check_packing(originals, packing, 256)
    assert 0.3 < tree.tree_token_ratio["train"] == packing.tree_token_ratio < 0.7  # 4 responses share each prompt
    batch = next(iter(tree.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "loss_mask", "position_ids", "subtree_end"}
    assert batch["input_ids"].shape == (1, 256)


@pytest.mark.parametrize(("settings", "message"), [
    ({"micro_batch_size": 2}, "packing='tree' needs micro_batch_size=1"),
    ({"context_parallel_size": 2}, "packing='tree' needs context_parallel_size=1"),
    ({"packing": "trie"}, "packing must be false, true or 'tree'"),
])
def test_datamodule_refuses_what_tree_rows_cannot_do(checkpoint: Path, settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _datamodule(checkpoint, **settings).setup("fit")


@pytest.mark.slow
def test_the_tree_config_fits_and_prints_the_tree_token_ratio(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "configs/tiny/tree_sft.yaml").read_text())
    config["trainer"].update(max_steps=2, default_root_dir=str(tmp_path))
    config["trainer"]["strategy"]["init_args"]["hf_checkpoint"] = str(tmp_path / "tiny")
    config["trainer"]["logger"][0]["init_args"]["save_dir"] = str(tmp_path)
    config["data"]["train_path"] = str(ROOT / config["data"]["train_path"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    completed = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "fit", "--config", str(path)],
                               cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed = re.search(r"tree_token_ratio=([0-9.]+)", completed.stdout + completed.stderr)
    assert printed is not None and 0 < float(printed.group(1)) < 1
    metrics = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    assert {"tree_token_ratio", "lm_loss"} <= set(metrics[0].split(","))


def test_an_mtp_head_with_tree_rows_is_refused_before_the_first_step(process_group, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_megatron import MegatronStrategy, SFTModule

    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3_mtp", "qwen3", mtp=True)
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", precision="fp32")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    data = SFTDataModule(train_path=str(ROOT / "configs/data/tiny_tree_sft.jsonl"), seq_length=256, packing="tree")
    with pytest.raises(ValueError, match="packing='tree' cannot run the MTP head"):
        trainer.fit(SFTModule(enable_mtp=True), data)
