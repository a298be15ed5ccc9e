"""Inputs of the MTP quality benchmark: a code corpus, a tokenizer and a random-init model, all made offline.

An MTP head can only be judged on a model that predicts real text. Every machine that runs the benchmark has the
same real text at hand: the Python standard library the interpreter ships with. Its ``.py`` files are split *by
file* into train and held-out files by a hash of their relative path, so two interpreters of the same minor
version (patch releases differ in a handful of files) put nearly every file on the same side.

    python -m lightning_megatron.recipes.stdlib_corpus OUT_DIR --size gpu   # or --size cpu

writes into ``OUT_DIR``::

    corpus/train.jsonl            {"prompt", "response"} rows cut from the train files, each fitting seq_length
    corpus/val.jsonl              the same from the held-out files, for the validation loss
    corpus/heldout_prompts.jsonl  {"prompt"}: heads of held-out code, for acceptance and generation
    corpus/train_prompts.jsonl    {"prompt"}: heads of train code, for the model's own continuations (MTP-only fit)
    corpus/tokenizer.json         byte-level BPE trained on the train files only
    model/                        Qwen3-style HF checkpoint with one MTP layer, random init, the tokenizer above
    manifest.json                 settings, the split (both file lists), counts

and prints a JSON summary. The tokenizer has no chat template, so ``SFTDataModule`` tokenizes a row as
``prompt + response + <|endoftext|>`` and trains on the response and the end token (``data/tokenize.py``); a row
is a chunk of one file cut at line ends, its prompt the chunk's first line (at most ``prompt_tokens`` tokens),
so nearly every token is trained on (the cutting lives in ``code_rows.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from operator import attrgetter
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer

from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.recipes.code_rows import Row, Source, chunk_rows, head_prompt
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.tokenizer import train_byte_level_bpe

SizeName = Literal["cpu", "gpu"]

EOS = "<|endoftext|>"
"""The only special token: end of a row (the eos SFTDataModule appends), pad, and where generation stops."""

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
"""Test suites (``test/``, ``lib2to3/tests``, ``idlelib/idle_test``) and installed packages are left out."""

GENERATED_DIRS = frozenset({"encodings", "pydoc_data"})
"""Machine-generated files: codec tables (gencodec.py) and pydoc's topic dump. Their near-perfect predictability
would inflate the acceptance of any draft head, so they are left out too."""

_SIZE_SETTINGS = ("max_files", "max_val_rows", "vocab_size", "seq_length", "prompt_tokens", "heldout_prompts",
                  "train_prompts")  # the Size fields that build_corpus takes, and the CLI can override


@dataclass(frozen=True)
class Size:
    """One benchmark size: the corpus settings and the model shape that go together."""

    vocab_size: int
    seq_length: int
    prompt_tokens: int  # at most this many tokens of a training row are its untrained prompt
    max_files: int | None  # None: every file
    max_val_rows: int | None
    heldout_prompts: int
    train_prompts: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


SIZES: dict[SizeName, Size] = {
    # ~96M parameters (12 x 6.3M decoder layers, 2 x 6.3M embedding/output, 7.5M MTP layer): trains to a
    # useful code model in minutes on one H200.
    "gpu": Size(vocab_size=8192, seq_length=1024, prompt_tokens=16, max_files=None, max_val_rows=None,
                heldout_prompts=64, train_prompts=1024, hidden_size=768, num_layers=12, num_attention_heads=12,
                num_key_value_heads=4, head_dim=64, intermediate_size=2048),
    # Small enough that building, training and measuring it fits a CPU test of a few minutes on 2 cores.
    "cpu": Size(vocab_size=1024, seq_length=128, prompt_tokens=8, max_files=64, max_val_rows=64,
                heldout_prompts=16, train_prompts=128, hidden_size=128, num_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, intermediate_size=256),
}


@dataclass(frozen=True)
class CorpusPaths:
    """What :func:`build_corpus` wrote."""

    train: Path
    val: Path
    heldout_prompts: Path
    train_prompts: Path
    tokenizer: Path
    manifest: Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> tuple[list[Source], dict[str, int]]:
    """Every UTF-8 ``.py`` file under ``root`` (the stdlib) outside the excluded folders, sorted by path, and the
    counts of files skipped for each reason."""
    root = stdlib_root() if root is None else root
    sources: list[Source] = []
    skipped = {"not_utf8": 0, "blank": 0}
    for file in sorted(root.rglob("*.py")):
        relative = file.relative_to(root)
        if (EXCLUDED_DIRS | GENERATED_DIRS) & set(relative.parts[:-1]) or not file.is_file():
            continue
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if not text.strip():
            skipped["blank"] += 1
            continue
        sources.append(Source(relative.as_posix(), text))
    if not sources:
        raise FileNotFoundError(f"no Python source files found under {root}; is this a full Python install?")
    return sources, skipped


def split_sources(
    sources: Sequence[Source], *, held_out_fraction: float, seed: int, max_files: int | None = None
) -> tuple[list[Source], list[Source]]:
    """``(train, held_out)``: a file is held out when the hash of ``seed`` and its path falls below the fraction.

    The decision depends on the file's path alone, not on which other files exist or their order. ``max_files``
    keeps the files of lowest hash on each side, ``max(1, round(max_files * held_out_fraction))`` of them held out.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be between 0 and 1 (exclusive), got {held_out_fraction}")
    ranked = sorted(sources, key=lambda source: _unit_hash(seed, "split", source.path))
    held_out = [s for s in ranked if _unit_hash(seed, "split", s.path) < held_out_fraction]
    train = [s for s in ranked if _unit_hash(seed, "split", s.path) >= held_out_fraction]
    if max_files is not None:
        if max_files < 2:
            raise ValueError(f"max_files must be at least 2 (one train file, one held-out file), got {max_files}")
        keep_held_out = max(1, round(max_files * held_out_fraction))
        held_out, train = held_out[:keep_held_out], train[: max_files - keep_held_out]
    if not held_out or not train:
        raise ValueError(
            f"the split left {len(train)} train and {len(held_out)} held-out files; "
            "change held_out_fraction or max_files"
        )
    return sorted(train, key=attrgetter("path")), sorted(held_out, key=attrgetter("path"))


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (any text round-trips) with ``<|endoftext|>`` as id 0 and exactly ``vocab_size`` ids: if the
    texts run out of merges, ``<|reserved_N|>`` special tokens fill up."""
    minimum = 256 + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes + {EOS}), got {vocab_size}")
    return train_byte_level_bpe(list(texts), vocab_size, [EOS])


def build_corpus(
    out_dir: str | Path,
    *,
    held_out_fraction: float = 0.05,
    seed: int = 0,
    max_files: int | None = None,
    vocab_size: int = 8192,
    seq_length: int = 1024,
    prompt_tokens: int = 16,
    eval_prompt_tokens: int = 32,
    heldout_prompts: int = 64,
    train_prompts: int = 1024,
    max_val_rows: int | None = None,
    stdlib: str | Path | None = None,
) -> CorpusPaths:
    """Write the corpus JSONL files, the tokenizer and ``manifest.json`` into ``out_dir`` (see the module doc).

    ``prompt_tokens`` caps a training row's untrained head, ``eval_prompt_tokens`` the length of the prompts.
    ``max_val_rows`` keeps that many held-out rows (chosen by hash) for a cheaper validation. Prompts come from
    the starts of rows, other than a file's first (licence and docstring headers) when there are enough.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = stdlib_root() if stdlib is None else Path(stdlib)
    sources, skipped = stdlib_sources(root)
    train_files, held_out_files = split_sources(
        sources, held_out_fraction=held_out_fraction, seed=seed, max_files=max_files
    )
    tokenizer = train_tokenizer([source.text for source in train_files], vocab_size)

    train_rows, val_rows = (chunk_rows(files, tokenizer, seq_length=seq_length, prompt_tokens=prompt_tokens)
                            for files in (train_files, held_out_files))
    if max_val_rows is not None:
        kept = set(sorted(val_rows, key=lambda r: _unit_hash(seed, "val", f"{r.path}:{r.index}"))[:max_val_rows])
        val_rows = [row for row in val_rows if row in kept]
    heldout = _prompts(val_rows, tokenizer, heldout_prompts, eval_prompt_tokens, seed, "heldout_prompts")
    train_heads = _prompts(train_rows, tokenizer, train_prompts, eval_prompt_tokens, seed, "train_prompts")

    corpus = out_dir / "corpus"
    corpus.mkdir(exist_ok=True)
    paths = CorpusPaths(
        train=corpus / "train.jsonl",
        val=corpus / "val.jsonl",
        heldout_prompts=corpus / "heldout_prompts.jsonl",
        train_prompts=corpus / "train_prompts.jsonl",
        tokenizer=corpus / "tokenizer.json",
        manifest=out_dir / "manifest.json",
    )
    _write_jsonl(paths.train, [{"prompt": r.prompt, "response": r.response} for r in train_rows])
    _write_jsonl(paths.val, [{"prompt": r.prompt, "response": r.response} for r in val_rows])
    _write_jsonl(paths.heldout_prompts, [{"prompt": prompt} for prompt in heldout])
    _write_jsonl(paths.train_prompts, [{"prompt": prompt} for prompt in train_heads])
    tokenizer.save(str(paths.tokenizer))
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "split": f"sha256('{seed}:split:' + relative path) / 2**64 < held_out_fraction: held out",
        "seed": seed,
        "held_out_fraction": held_out_fraction,
        "max_files": max_files,
        "excluded_dirs": sorted(EXCLUDED_DIRS | GENERATED_DIRS),
        "files": {"train": len(train_files), "held_out": len(held_out_files), "skipped": skipped},
        "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "eos": EOS, "eos_id": tokenizer.token_to_id(EOS),
                      "chat_template": None},
        "seq_length": seq_length,
        "prompt_tokens": prompt_tokens,
        "eval_prompt_tokens": eval_prompt_tokens,
        "rows": {"train": len(train_rows), "val": len(val_rows)},
        "tokens": {
            "train": sum(r.tokens for r in train_rows),
            "train_trained": sum(r.trained for r in train_rows),
            "val": sum(r.tokens for r in val_rows),
            "val_trained": sum(r.trained for r in val_rows),
        },
        "prompts": {"heldout": len(heldout), "train": len(train_heads)},
        "paths": {name: str(path.relative_to(out_dir)) for name, path in asdict(paths).items()},
        "train_files": [source.path for source in train_files],
        "held_out_files": [source.path for source in held_out_files],
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    return paths


def make_model(
    out_dir: str | Path,
    tokenizer: Tokenizer | str | Path,
    size: SizeName = "gpu",
    *,
    seed: int = 0,
    seq_length: int | None = None,
) -> Path:
    """Write the benchmark's HF checkpoint into ``out_dir``: Qwen3-style, untied, one MTP layer, random init,
    float32 (speculative decoding is checked token for token against greedy in float32), with ``tokenizer``
    (a ``tokenizers.Tokenizer`` or a ``tokenizer.json`` path, whose size is the vocab) and no chat template.
    ``max_position_embeddings`` is twice ``seq_length`` (default: the size's), room for generation."""

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    shape = SIZES[size]
    return make_tiny_checkpoint(
        out_dir,
        "qwen3",
        mtp=True,
        seed=seed,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        vocab_size=tokenizer.get_vocab_size(),
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        head_dim=shape.head_dim,
        max_position_embeddings=2 * (shape.seq_length if seq_length is None else seq_length),
        tokenizer=tokenizer,
    )


def parameter_counts(checkpoint: str | Path) -> dict[str, int]:
    """Parameters of an HF checkpoint from its safetensors headers: ``total``, ``mtp`` (its MTP head) and
    ``embedding`` (input embedding and LM head)."""
    from safetensors import safe_open

    counts = {"total": 0, "mtp": 0, "embedding": 0}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                numel = 1
                for dim in handle.get_slice(name).get_shape():
                    numel *= dim
                counts["total"] += numel
                if is_hf_mtp_tensor(name):
                    counts["mtp"] += numel
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    counts["embedding"] += numel
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_megatron.recipes.stdlib_corpus",
        description="Build the MTP benchmark's stdlib corpus, tokenizer and random-init MTP checkpoint.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--seed", type=int, default=0, help="of the split, the prompt choice and the weights")
    parser.add_argument("--held-out-fraction", type=float, default=0.05)
    for field in _SIZE_SETTINGS:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help="default: the size's")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    size = SIZES[args.size]
    settings = {field: getattr(args, field) if getattr(args, field) is not None else getattr(size, field)
                for field in _SIZE_SETTINGS}
    paths = build_corpus(args.out_dir, held_out_fraction=args.held_out_fraction, seed=args.seed, **settings)
    corpus_seconds = time.perf_counter() - started
    checkpoint = make_model(args.out_dir / "model", paths.tokenizer, args.size, seed=args.seed,
                            seq_length=settings["seq_length"])
    manifest = json.loads(paths.manifest.read_text())
    summary = {
        "size": args.size,
        "out_dir": str(args.out_dir),
        "checkpoint": str(checkpoint),
        **{name: str(path) for name, path in asdict(paths).items()},
        "seq_length": manifest["seq_length"],
        "files": manifest["files"],
        "rows": manifest["rows"],
        "tokens": manifest["tokens"],
        "prompts": manifest["prompts"],
        "vocab_size": manifest["tokenizer"]["vocab_size"],
        "parameters": parameter_counts(checkpoint),
        "corpus_seconds": round(corpus_seconds, 2),
        "seconds": round(time.perf_counter() - started, 2),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _unit_hash(seed: int, tag: str, key: str) -> float:
    """A number in [0, 1) that depends only on its arguments (not on the process, the platform or other keys)."""
    digest = hashlib.sha256(f"{seed}:{tag}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _prompts(rows: list[Row], tokenizer: Tokenizer, count: int, max_tokens: int, seed: int, name: str) -> list[str]:
    """``count`` different prompts from the starts of ``rows``, in an order fixed by hash, a file's first row
    last."""
    ranked = sorted(rows, key=lambda r: (r.index == 0, _unit_hash(seed, name, f"{r.path}:{r.index}")))
    prompts: list[str] = []
    seen: set[str] = set()  # thousands of prompts: a list's membership test would be quadratic
    for row in ranked:
        if len(prompts) == count:
            return prompts
        prompt = head_prompt(row.prompt + row.response, tokenizer, max_tokens)
        if prompt is not None and prompt not in seen:
            prompts.append(prompt)
            seen.add(prompt)
    if len(prompts) < count:
        raise ValueError(
            f"{name}={count} asks for more prompts than the {len(rows)} rows give ({len(prompts)}); "
            f"lower {name} or use more files (max_files)"
        )
    return prompts


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    """ASCII JSON lines (non-ASCII escaped), so any reader's default encoding reads them."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="ascii")


if __name__ == "__main__":
    sys.exit(main())
