"""Continuations with the Megatron model itself, for `predict`: the data MTP-only training learns from.

An MTP head is accepted when it drafts what the target would say, so it is trained on the target's own
continuations: greedy ones for a server that decodes greedily, samples at the rollout temperature for one that
samples (the contexts the head then sees are the ones it will draft in). They are generated here by the Megatron
model the strategy built (any tensor-parallel size; the logits are vocab-parallel, so the argmax and the sample are
taken across the shards), one forward of the whole row per new token: no KV cache, which is simple and plenty for
making training data. Serving-speed decoding with the MTP head as drafter is `lightning_megatron.speculative`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def eos_token_ids(hf_path: str | Path, tokenizer: Any) -> set[int]:
    """The end-of-sequence ids of generation_config.json (the ones generation stops at), else the tokenizer's."""
    file = Path(hf_path) / "generation_config.json"
    eos = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()


def vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension of logits split over the vocabulary across tensor-parallel ranks.

    Ties go to the lowest vocabulary id, as `torch.argmax` does on unsplit logits.
    """
    from megatron.core import parallel_state

    local_max, local_index = logits.float().max(dim=-1)
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    if world_size == 1:
        return local_index
    offset = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    group = parallel_state.get_tensor_model_parallel_group()
    maxima = [torch.empty_like(local_max) for _ in range(world_size)]
    indices = [torch.empty_like(local_index) for _ in range(world_size)]
    dist.all_gather(maxima, local_max.contiguous(), group=group)
    dist.all_gather(indices, (local_index + offset).contiguous(), group=group)
    best_rank = torch.stack(maxima).argmax(dim=0)  # the first rank holding the maximum: the lowest id
    return torch.stack(indices).gather(0, best_rank.unsqueeze(0)).squeeze(0)


def vocab_parallel_sample(logits: torch.Tensor, temperature: float,
                          generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One id per row of `logits` ``[rows, vocab / tp]`` (split over the vocabulary across tensor-parallel ranks),
    drawn from softmax(logits / temperature) over the whole vocabulary; row i's randomness from `generators[i]`.

    Gumbel-max: the argmax of ``logits / T - log(E)`` with E ~ Exp(1) independent per vocabulary entry is a sample
    of softmax(logits / T) (softmax's normalization is a shift, which the argmax ignores). Every rank draws the noise
    of the whole vocabulary from the row's generator and keeps its own slice, so the sample does not depend on the
    tensor-parallel size, and the argmax across the shards is `vocab_parallel_argmax`'s.
    """
    from megatron.core import parallel_state

    if not temperature > 0:
        raise ValueError(f"temperature: {temperature} must be > 0 (greedy decoding is vocab_parallel_argmax)")
    if len(generators) != logits.shape[0]:
        raise ValueError(f"{len(generators)} generators for {logits.shape[0]} rows: give one per row")
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    whole = local * parallel_state.get_tensor_model_parallel_world_size()
    noise = torch.stack([torch.empty(whole, dtype=torch.float32, device=logits.device).exponential_(generator=generator)
                         for generator in generators])[:, start:start + local]
    return vocab_parallel_argmax(logits.float() / temperature - noise.log())


def row_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt `index` (below 2**32) under `seed`: splitmix64 of the pair, so that every bit of
    it depends on both. A CPU generator (Mersenne Twister) reads only a seed's low 32 bits, so a plain
    ``seed * 2**32 + index`` would give every `seed` the same draws there."""
    mask = (1 << 64) - 1
    mixed = ((seed << 32 | index) + 0x9E3779B97F4A7C15) & mask
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & mask
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & mask
    return mixed ^ (mixed >> 31)


def continuations(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    *,
    temperature: float = 0.0,
    row_seeds: Sequence[int] | None = None,
    width_multiple: int = 1,
) -> list[list[int]]:
    """The continuation of each prompt row of `input_ids` ``[b, s]`` (right-padded, lengths given).

    `temperature` 0 decodes greedily; above 0 each new token is sampled from softmax(logits / temperature), row i's
    draws from a generator of its own seeded with `row_seeds[i]`: they do not depend on the other rows of the batch
    nor on the tensor-parallel size. Rows are decoded together: causal attention keeps a row's positions blind to
    the padding after them. A row stops after an end-of-sequence token (kept in its output) or `max_new_tokens`
    tokens. `width_multiple` pads each forward's width (sequence parallelism needs a multiple of the tensor-parallel
    size).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: {max_new_tokens} must be at least 1")
    if not temperature >= 0:
        raise ValueError(f"temperature: {temperature} must be >= 0 (0: greedy)")
    batch = input_ids.shape[0]
    generators: list[torch.Generator] = []
    if temperature > 0:
        if row_seeds is None or len(row_seeds) != batch:
            raise ValueError(f"sampling at temperature {temperature} needs one seed per row ({batch} rows)")
        generators = [torch.Generator(input_ids.device).manual_seed(seed) for seed in row_seeds]
    lengths = prompt_lengths.to(input_ids.device).clone()
    width = int(lengths.max()) + max_new_tokens + width_multiple
    tokens = torch.zeros(batch, width, dtype=input_ids.dtype, device=input_ids.device)
    tokens[:, : input_ids.shape[1]] = input_ids
    positions = torch.arange(width, device=input_ids.device).expand(batch, width)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    running = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    rows = torch.arange(batch, device=input_ids.device)
    eos = torch.tensor(sorted(eos_token_ids), dtype=input_ids.dtype, device=input_ids.device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            current = int(lengths.max())  # no row reads a position at or past this one
            current += -current % width_multiple
            logits = model(input_ids=tokens[:, :current], position_ids=positions[:, :current], attention_mask=None)
            last = logits[rows, lengths - 1]
            next_tokens = (vocab_parallel_sample(last, temperature, generators) if temperature > 0
                           else vocab_parallel_argmax(last))
            for row in running.nonzero().flatten().tolist():
                outputs[row].append(int(next_tokens[row]))
            tokens[rows[running], lengths[running]] = next_tokens[running]
            running &= ~torch.isin(next_tokens, eos)
            lengths += running.long()
            if not running.any():
                break
    return outputs
