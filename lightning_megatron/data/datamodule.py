"""``SFTDataModule``: chat or prompt/response rows (JSONL, Parquet, a saved HF datasets folder) to response-masked
micro-batches, padded or packed, through the tokenized-data cache (``cache.py``) that every rank and run shares."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_megatron.data.cache import CacheSpec, TokenizedRows, open_or_build
from lightning_megatron.data.jsonl import Example
from lightning_megatron.data.packing import (
    PackedSFTDataset,
    PaddedSFTDataset,
    PromptDataset,
    collate_packed,
    prompt_collate,
    sequence_alignment,
)
from lightning_megatron.data.settings import DataSettings
from lightning_megatron.data.sources import read_examples, size_of
from lightning_megatron.data.tokenize import Overlong, tokenize_prompts
from lightning_megatron.data.tree import TreeSFTDataset, collate_tree
from lightning_megatron.families import LINEAR_ATTENTION_MODEL_TYPES


class SFTDataModule(pl.LightningDataModule):
    """Supervised fine-tuning data, tokenized with the checkpoint's tokenizer.

    A path (``train_path``, ``val_path``, ``test_path``, ``predict_path``) is a JSONL file, a Parquet file
    (``.parquet``) or a folder HF ``datasets``' ``save_to_disk`` wrote. Rows are ``{"messages": [...]}`` (loss on every assistant turn) or ``{"prompt": ..., "response": ...}``
    (loss on the response; ``"completion"`` works as ``"response"``). Every file of the stage is read, validated
    and tokenized in :meth:`setup`, so a malformed row stops the run before training starts, named by ``path:line``
    (``path:row N`` in a table).

    Training, validation and test files are tokenized once into a memory-mapped cache (``data/cache.py``) that
    every rank reads and later runs find again: ``cache_dir`` (default: ``~/.cache/lightning_megatron/data``) holds
    one folder per cache key, which is printed; the process that builds it tokenizes with ``tokenize_workers``
    processes while the others wait.

    Micro-batches are padded rows ``[micro_batch_size, seq_length]``, or with ``packing=True`` one row of
    ``seq_length`` tokens holding several sequences (greedy first-fit in file order) with ``cu_seqlens``; each
    attends to itself only (``lightning_megatron.microbatch``). With ``context_parallel_size > 1`` every packed sequence
    is padded to a multiple of ``2 * context_parallel_size``, so that :func:`split_for_context_parallel` can cut it.
    ``packing="tree"`` merges sequences that share a token prefix (several responses to one prompt) into tries laid
    out in one row (``data/tree.py``), so shared tokens are computed once; it logs ``tree_token_ratio`` (tree tokens
    over original tokens) and needs ``micro_batch_size=1``, ``context_parallel_size=1`` and no MTP head.

    ``hf_checkpoint``, ``micro_batch_size`` and ``context_parallel_size`` default to what ``MegatronStrategy``
    hands in before ``setup`` (:meth:`take_data_settings`; ``context_parallel_size`` to 1 without it), and so
    does whether the model runs an MTP head. The training rows are sharded over data-parallel ranks by the
    strategy's ``distributed_sampler_kwargs`` and shuffled with ``seed`` (Lightning's own sampler would shuffle with
    ``seed_everything``'s); the other splits' sampler is left to Lightning.

    Args:
        train_path: the training rows (``fit``).
        val_path: the validation rows (``validate``; optional during ``fit``).
        test_path: the test rows (``test``).
        predict_path: the prompts to continue (``predict``): rows with a ``prompt`` or ``messages``.
        hf_checkpoint: the checkpoint whose tokenizer is used (default: the strategy's).
        seq_length: the tokens of one row (at least 2: a token and its label).
        packing: false: padded rows; true: several sequences packed into one row; ``"tree"``: sequences that share
            a token prefix merged into tries (see above).
        micro_batch_size: rows per micro-batch (default: the strategy's).
        num_workers: the data loaders' worker processes.
        seed: the seed of the training data's shuffle (every epoch in a new order, the same in every run).
        overlong: a row longer than ``seq_length`` is cut to its first ``seq_length`` tokens (``"truncate"``), left
            out (``"drop"``) or refused, naming it (``"error"``); the rows cut or left out are counted in a warning.
        context_parallel_size: (default: the strategy's, else 1) the context-parallel size the packed sequences are
            aligned for.
        cache_dir: where tokenized caches live (default: ``lightning_megatron/data`` in the user's cache
            directory, ``$XDG_CACHE_HOME`` or ``~/.cache``; several nodes share one only on a file system whose locks
            work across them).
        tokenize_workers: the processes that tokenize a file when its cache is missing (default: every CPU this
            process may use; the other ranks wait meanwhile).
    """

    def __init__(
        self,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        predict_path: str | None = None,
        hf_checkpoint: str | None = None,
        seq_length: int = 2048,
        packing: bool | Literal["tree"] = False,
        micro_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        overlong: Overlong = "truncate",
        context_parallel_size: int | None = None,
        cache_dir: str | None = None,
        tokenize_workers: int | None = None,
    ) -> None:
        super().__init__()
        if packing not in (False, True, "tree"):
            raise ValueError(f"packing must be false, true or 'tree', got {packing!r}")
        if seq_length < 2:
            raise ValueError(f"seq_length must be at least 2 (a token and its label), got {seq_length}")
        if overlong not in ("truncate", "drop", "error"):
            raise ValueError(f"overlong must be 'truncate', 'drop' or 'error', got {overlong!r}")
        self.train_path, self.val_path = train_path, val_path
        self.test_path, self.predict_path = test_path, predict_path
        self.hf_checkpoint = hf_checkpoint
        self.seq_length = seq_length
        self.packing = packing
        self.micro_batch_size = micro_batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.overlong = overlong
        self.context_parallel_size = context_parallel_size
        self.cache_dir = cache_dir
        self.tokenize_workers = tokenize_workers
        self.cache_built: dict[str, bool] = {}  # per split: whether this process tokenized it (else: cache read)
        self.tokenizer: Any = None
        self.datasets: dict[str, Dataset] = {}
        self.predict_examples: list[Example] = []  # the rows behind the predict dataset's indices
        self.tree_token_ratio: dict[str, float] = {}  # per split, with packing="tree"
        self.handed_settings: DataSettings | None = None  # from the strategy, before setup

    def take_data_settings(self, settings: DataSettings) -> None:
        """What the run decided (`TakesDataSettings`); `setup` uses it where this data module was given nothing."""
        self.handed_settings = settings

    def setup(self, stage: str) -> None:
        """Resolve the settings the strategy owns, then read, validate and tokenize the stage's files."""
        handed = self.handed_settings
        self.micro_batch_size = _resolved("micro_batch_size", self.micro_batch_size,
                                          handed and handed.micro_batch_size)
        self.context_parallel_size = _resolved("context_parallel_size", self.context_parallel_size,
                                               handed and handed.parallel.context, default=1)
        self.hf_checkpoint = _resolved("hf_checkpoint", self.hf_checkpoint, handed and handed.hf_checkpoint)
        self._check_layout()
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.hf_checkpoint)
        paths = {
            "fit": {"train": self.train_path, "val": self.val_path},
            "validate": {"val": self.val_path},
            "test": {"test": self.test_path},
            "predict": {"predict": self.predict_path},
        }[stage]
        for split, path in paths.items():
            if path is None:
                if split != "val" or stage == "validate":  # validation during fit is optional
                    raise ValueError(f"{split}_path is not set, but trainer.{getattr(stage, 'value', stage)}() needs "
                                     f"it: set data.{split}_path (SFTDataModule({split}_path=...))")
                continue
            if split not in self.datasets:
                self.datasets[split] = self._build_dataset(split, path)

    def train_dataloader(self) -> DataLoader:
        return self._dataloader("train")

    def val_dataloader(self) -> DataLoader | list:
        return self._dataloader("val") if "val" in self.datasets else []

    def test_dataloader(self) -> DataLoader:
        return self._dataloader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._dataloader("predict")

    @property
    def pad_id(self) -> int:
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError(f"the tokenizer of {self.hf_checkpoint} has neither a pad token nor an eos token")
        return pad_id

    def _build_dataset(self, split: str, path: str) -> Dataset:
        if split == "predict":
            prompts, dropped, truncated = tokenize_prompts(
                read_examples(path, for_prediction=True), self.tokenizer, max_tokens=self.seq_length,
                overlong=self.overlong,
            )
            self._warn_dropped(path, dropped, len(prompts))
            self._warn_truncated(path, truncated, dropped + len(prompts), kept="last")
            if not prompts:
                raise ValueError(f"{path}: no prompt is left after overlong='drop'; raise seq_length")
            self.predict_examples = [example for example, _ in prompts]
            return PromptDataset([ids for _, ids in prompts])
        rows = self._tokenized_rows(split, path)
        self._warn_dropped(path, rows.dropped, len(rows))
        self._warn_truncated(path, rows.truncated, rows.dropped + len(rows))
        if not len(rows):
            raise ValueError(f"{path}: no row is left to train on after overlong='drop'; raise seq_length")
        if self.packing == "tree":
            dataset = TreeSFTDataset(list(rows), self.seq_length, self.pad_id)
            self._report_tree_token_ratio(split, path, dataset)
            return dataset
        if self.packing:
            alignment = sequence_alignment(self.context_parallel_size)
            return PackedSFTDataset(rows, self.seq_length, self.pad_id, alignment, bins=rows.plan)
        return PaddedSFTDataset(rows, self.seq_length, self.pad_id)

    def _tokenized_rows(self, split: str, path: str) -> TokenizedRows:
        """The split's rows from the cache, tokenized first by the process that takes the key's lock."""
        spec = CacheSpec(self.seq_length, self.overlong, self.packing, sequence_alignment(self.context_parallel_size))
        workers = self.tokenize_workers or _default_workers(path)
        rows, built = open_or_build(path, self.tokenizer, spec, cache_root=self.cache_dir, workers=workers)
        self.cache_built[split] = built
        rank_zero_info(f"{path}: {len(rows)} tokenized rows in {Path(rows.folder)} (cache key {rows.key}, "
                       f"{'built now' if built else 'found'})")
        return rows

    def _dataloader(self, split: str) -> DataLoader:
        if split not in self.datasets:
            raise RuntimeError(f"no {split} data: call setup() for the stage that reads {split}_path first")
        dataset = self.datasets[split]
        training = split == "train"
        if split == "predict":
            collate_fn = prompt_collate(self.pad_id)
        else:
            collate_fn = collate_tree if self.packing == "tree" else collate_packed if self.packing else None
        sampler = self._training_sampler(dataset) if training else None
        return DataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            shuffle=training and sampler is None,
            sampler=sampler,
            generator=torch.Generator().manual_seed(self.seed) if training and sampler is None else None,
            drop_last=training,
            num_workers=self.num_workers,
            collate_fn=collate_fn,
        )

    def _training_sampler(self, dataset: Dataset) -> DistributedSampler | None:
        """The data-parallel shard of the shuffled training rows, shuffled with ``seed``: the sampler Lightning
        would put in (same ranks, same padding), which would shuffle with the run's ``seed_everything`` instead.
        None outside a trainer that shards the data (the loader shuffles with ``seed`` itself)."""
        sharding = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if not sharding:
            return None
        return DistributedSampler(dataset, shuffle=True, seed=self.seed, **sharding)

    def _check_layout(self) -> None:
        if self.packing == "tree":
            mtp_head = self.handed_settings is not None and self.handed_settings.mtp_head
            _check_tree_layout(self.micro_batch_size, self.context_parallel_size, mtp_head)
        if self.packing:
            _check_linear_attention_packing(self.packing, self.context_parallel_size, self.hf_checkpoint)
        alignment = sequence_alignment(self.context_parallel_size)
        if self.seq_length % alignment != 0:
            raise ValueError(
                f"seq_length={self.seq_length} must be a multiple of 2 * context_parallel_size = {alignment}: "
                "context parallelism cuts every sequence into that many equal chunks"
            )
        if self.packing and self.micro_batch_size != 1:
            raise ValueError(
                f"packing=True needs micro_batch_size=1, got {self.micro_batch_size}: a packed micro-batch is one "
                "row of seq_length tokens holding several sequences; raise seq_length to put more in it"
            )
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1, got {self.micro_batch_size}")

    def _report_tree_token_ratio(self, split: str, path: str, dataset: TreeSFTDataset) -> None:
        """Print the ratio and log it to the trainer's logger (``tree_token_ratio``, ``val_tree_token_ratio``)."""
        packing = dataset.packing
        self.tree_token_ratio[split] = packing.tree_token_ratio
        rank_zero_info(
            f"{path}: tree packing puts {packing.original_tokens} tokens of {len(packing.paths)} sequences into "
            f"{packing.tree_tokens} tree tokens in {len(dataset)} rows: tree_token_ratio={packing.tree_token_ratio:.4f}"
        )
        logger = self.trainer.logger if self.trainer is not None else None
        if logger is not None:
            name = "tree_token_ratio" if split == "train" else f"{split}_tree_token_ratio"
            logger.log_metrics({name: packing.tree_token_ratio}, step=0)

    def _warn_truncated(self, path: str, truncated: int, total: int, kept: str = "first") -> None:
        """Rows cut to fit (``kept``: their ``"first"`` tokens, training rows; their ``"last"``, prompts)."""
        if truncated:
            lost = "what follows in them is not trained on" if kept == "first" else "their beginning is not seen"
            rank_zero_warn(
                f"{path}: cut {truncated} of {total} rows to their {kept} seq_length={self.seq_length} tokens "
                f"(overlong='truncate'): {lost}; raise seq_length, or set overlong='drop' to leave such rows out "
                "or 'error' to list them"
            )

    def _warn_dropped(self, path: str, dropped: int, kept: int) -> None:
        if dropped:
            rank_zero_warn(
                f"{path}: dropped {dropped} of {dropped + kept} rows that do not fit seq_length={self.seq_length} "
                "or have no response token to train on (overlong='drop')"
            )


def _resolved(name: str, value: Any, handed: Any, **fallback: Any) -> Any:
    """``value`` if given, else what the strategy ``handed`` in, else ``fallback``'s ``default``."""
    if value is not None:
        return value
    if handed is not None:
        return handed
    if "default" in fallback:
        return fallback["default"]
    raise ValueError(f"{name} is not set and no MegatronStrategy handed it in: pass SFTDataModule({name}=...)")


def _default_workers(path: str) -> int:
    """Every CPU this process may use, for data of a few MB and more (below, a pool costs more than it saves)."""
    if size_of(path) < 4 << 20:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _check_linear_attention_packing(packing: bool | str, context_parallel_size: int, hf_checkpoint: str) -> None:
    """Models whose linear-attention layers carry a state along the row (Qwen3.5's gated DeltaNet) run packed rows
    one sequence at a time: tree rows (a mask over tokens) cannot branch that state, and packed rows cut for
    context parallelism are not tested."""
    config = Path(hf_checkpoint) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type not in LINEAR_ATTENTION_MODEL_TYPES:
        return
    if packing == "tree":
        raise ValueError(
            f"packing='tree' cannot run {model_type!r} checkpoints: their linear-attention layers carry a state along "
            "the row instead of attending through a mask, so a branch would read its siblings' tokens; use "
            "packing: true (one state per sequence) or packing: false"
        )
    if context_parallel_size > 1:
        raise ValueError(
            f"packing=True with context_parallel_size={context_parallel_size} is not supported for {model_type!r} "
            "checkpoints (their linear-attention layers run packed sequences one by one, untested across context-"
            "parallel ranks); set packing: false or context_parallel_size: 1"
        )


def _check_tree_layout(micro_batch_size: int, context_parallel_size: int, with_mtp_head: bool) -> None:
    """What tree rows cannot do yet, refused before any data is read."""
    if micro_batch_size != 1:
        raise ValueError(
            f"packing='tree' needs micro_batch_size=1, got {micro_batch_size}: a tree micro-batch is one row of "
            "seq_length tree tokens; raise seq_length to put more sequences in it"
        )
    if context_parallel_size != 1:
        raise ValueError(
            f"packing='tree' needs context_parallel_size=1, got {context_parallel_size}: a tree row cannot be cut "
            "into context-parallel chunks (an ancestor may lie on another rank); set context_parallel_size: 1 "
            "or use packing: true"
        )
    if with_mtp_head:
        raise ValueError(
            "packing='tree' cannot run the MTP head: Megatron-Core's MTP rolls input ids and labels along the flat "
            "row, which takes the wrong child at branch points; set model.enable_mtp: false or use packing: true"
        )
