"""Plain and self-speculative decoding with ``K`` MTP draft tokens per step, greedy or sampled, KV-cached and batched.

One speculative step, with ``m`` the position of the last token already decided (``x_m``) and ``d_1..d_K`` the MTP
head's drafts for ``x_{m+1}..x_{m+K}``:

1. The target reads ``[x_m, d_1, .., d_K]`` at positions ``m..m+K`` in one forward (its cache holds ``0..m-1``).
2. ``sampling.accepted_count`` keeps the first ``n`` drafts (greedy: those equal to the target's greedy token;
   sampled: the accept/reject rule) and one more token is decided (the target's, or ``sampling.correction``'s after
   a rejection): ``n + 1`` tokens for one forward. The rejected drafts' cache slots are never read again.
3. The MTP head reads one position per decided token, ``(h_j, x_{j+1})``, and drafts ``d_1`` after the last. For
   ``d_2..d_K`` it is applied recursively (one layer reused, as SGLang's NEXTN steps do): at the next position it
   reads its own final-normed output in place of the target's hidden state, and its previous draft. Those
   positions are dropped from its cache afterwards, so its cache only ever holds decided tokens.

Linear-attention targets (Qwen3.5's gated DeltaNet layers) keep a recurrent state per layer instead of one cache
slot per token: it cannot be cut back past a rejected draft, and a padded slot would flow into it. So their prompts
decode one at a time, the states are copied before each verification, and after a rejection they are put back and
the decided tokens read again (one more forward, not counted in ``target_forwards``: an engine such as SGLang keeps
the state after every draft position instead).

Several prompts decode at once, each row of the batch at its own positions. The rows share cache slots: a slot that
a row must not read (the right padding of a shorter prompt, a draft it rejected while another row kept more, a
padded MTP position because it decided fewer tokens) is 0 in that row's attention mask, and slots that no row reads
any more are cut off the caches' end (a negative ``crop``, the form transformers keeps). A row leaves the batch when
it finishes. Acceptance is decided per row, with the row's own generator and in the order it would be alone, so a
batch decodes each prompt token for token as decoding it alone does (up to floating-point ties, below).

The output is the target's own: token for token its greedy output at temperature 0 (up to floating-point ties
between the top two logits, which a multi-token or batched forward may break differently from a 1-token one), and
distributed as its own sampling otherwise. Decoding stops after an end-of-sequence token (kept) or
``max_new_tokens`` tokens. Only drafts that could be emitted are made: at most the tokens left in the budget minus
one.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from lightning_megatron.families import LINEAR_ATTENTION_MODEL_TYPES
from lightning_megatron.speculative.mtp_head import MTPDraftHead
from lightning_megatron.speculative.sampling import GREEDY, Sampling, accepted_count, correction, probabilities


@dataclass(frozen=True)
class Decoded:
    """What one decoder produced for one prompt.

    ``tokens``: the new tokens (prompt excluded; an end-of-sequence token is included). ``accepted``: one flag per
    draft, in the order drafted (empty for plain decoding; drafts after a rejection count as not accepted).
    ``accepted_per_step``: drafts accepted at each verification step that had drafts. ``target_forwards``:
    forward passes of the target, prefill included. ``seconds``: wall time from the start of its batch until it
    finished (the whole decode when it is decoded alone).
    """

    tokens: list[int]
    accepted: list[bool]
    target_forwards: int
    seconds: float
    accepted_per_step: list[int] = field(default_factory=list)


def greedy_decode(
    target: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Collection[int]
) -> Decoded:
    """The target's greedy continuation of ``prompt_ids``, one KV-cached forward per token."""
    return sample_decode(target, prompt_ids, max_new_tokens, eos_token_ids, GREEDY)


def sample_decode(
    target: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> Decoded:
    """The target's own continuation of ``prompt_ids`` under ``sampling``, one KV-cached forward per token."""
    return decode_batch(target, [prompt_ids], max_new_tokens, eos_token_ids, sampling=sampling,
                        generators=[generator])[0]


def speculative_decode(
    target: PreTrainedModel,
    head: MTPDraftHead,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    *,
    num_draft_tokens: int = 1,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> Decoded:
    """The target's continuation of ``prompt_ids`` under ``sampling`` (default greedy), drafting up to
    ``num_draft_tokens`` tokens per step with ``head``; ``generator`` seeds the sampling."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: {num_draft_tokens} must be at least 1")
    return decode_batch(target, [prompt_ids], max_new_tokens, eos_token_ids, head=head,
                        num_draft_tokens=num_draft_tokens, sampling=sampling, generators=[generator])[0]


def decode_batch(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    *,
    head: MTPDraftHead | None = None,
    num_draft_tokens: int = 1,
    sampling: Sampling = GREEDY,
    generators: Sequence[torch.Generator | None] | None = None,
    on_finished: Callable[[int, Decoded], None] | None = None,
) -> list[Decoded]:
    """Every prompt's continuation, decoded together: speculatively with ``head`` drafting up to
    ``num_draft_tokens`` tokens per step, plainly without a head.

    ``generators[i]`` seeds prompt ``i``'s sampling (one per prompt, so that its tokens do not depend on the
    batch it is in); ``on_finished(i, decoded)`` is called as each prompt finishes (progress reports).
    """
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    for prompt_ids in prompts:
        _check(prompt_ids, max_new_tokens)
    if head is not None and num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: {num_draft_tokens} must be at least 1 (or decode without a head)")
    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"generators: {len(generators)} given for {len(prompts)} prompts; give one per prompt")
    if len(prompts) > 1 and "sliding_attention" in (getattr(target.config, "layer_types", None) or ()):
        raise ValueError("this target has sliding-window attention layers, whose windows the batch's shared cache "
                         "slots would shift: decode its prompts one at a time (batch size 1)")
    rows = [_Row(index, list(prompt), None if generators is None else generators[index])
            for index, prompt in enumerate(prompts)]
    batches = [[row] for row in rows] if _has_linear_attention(target) else [rows]
    decoder = _Batch(target, head, num_draft_tokens if head is not None else 0, max_new_tokens, eos_token_ids,
                     sampling, on_finished)
    with torch.inference_mode():
        return [decoded for batch in batches for decoded in decoder.run(batch)]


def _has_linear_attention(target: PreTrainedModel) -> bool:
    return target.config.model_type in LINEAR_ATTENTION_MODEL_TYPES


def reference_accepts(
    target: PreTrainedModel,
    head: MTPDraftHead,
    prompt_ids: Sequence[int],
    tokens: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
) -> list[bool]:
    """Brute-force acceptance flags for the greedy continuation ``tokens``: no cache anywhere.

    Replays the positions :func:`speculative_decode` visits; at each it re-runs the full target and the full MTP
    head on the whole prefix to get the draft, and compares it with the greedy token that follows.
    """
    sequence = list(prompt_ids) + list(tokens)
    decided, flags = 1, []
    with torch.inference_mode():
        while not _finished(list(tokens[:decided]), max_new_tokens, eos_token_ids):
            if max_new_tokens - decided < 2:
                decided += 1
                continue
            last = len(prompt_ids) + decided - 1  # position of the last decided token
            prefix = torch.tensor([sequence[: last + 1]], device=target.device)
            hidden = target.model(input_ids=prefix).last_hidden_state
            positions = torch.arange(last, device=target.device).unsqueeze(0)
            draft = int(head(hidden[:, :-1], prefix[:, 1:], positions)[0, -1].argmax())
            flags.append(draft == sequence[last + 1])
            decided += 2 if flags[-1] else 1
    return flags


@dataclass(eq=False)
class _Row:
    """One prompt's decoding state while it is in the batch."""

    index: int
    prompt: list[int]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    target_forwards: int = 1

    @property
    def position(self) -> int:
        """Position of the last decided token."""
        return len(self.prompt) + len(self.tokens) - 1


class _Slots:
    """A KV cache that the rows of a batch share, and which of its slots each row may read (``readable``, kept on
    the CPU: the masks it makes are copied to the device, no step waits on the device to trim)."""

    def __init__(self, rows: int, config: PretrainedConfig | None = None) -> None:
        # with a config, each layer gets its kind of cache (a linear-attention layer's holds recurrent states)
        self.cache = DynamicCache(config=config) if config is not None else DynamicCache()
        self.readable = torch.zeros(rows, 0, dtype=torch.bool)

    def mask_with(self, new: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """The attention mask ``[rows, slots + n]`` once ``new`` (``[rows, n]``: which new slots each row may read)
        is appended; None (plain causal attention, transformers' fast path) while every row reads every slot."""
        self.readable = torch.cat([self.readable, new], dim=1)
        return None if bool(self.readable.all()) else self.readable.to(device, non_blocking=True)

    def keep_rows(self, rows: list[int], device: torch.device) -> None:
        self.readable = self.readable[rows]
        if rows and self.cache.get_seq_length():  # none left: the batch ends (a one-row batch's only way out)
            self.cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=device))

    def drop_last(self, count: int) -> None:
        """Forget the last ``count`` slots. A negative crop: transformers deprecates a positive one (a length to
        keep) in 5.18, and ``crop(0)`` would empty the cache in 5.12 and keep it in 5.18, so it is never called."""
        if count > 0:
            self.cache.crop(-count)
            self.readable = self.readable[:, :-count]

    def linear_states(self) -> list[tuple[LinearAttentionCacheLayerMixin, dict]]:
        """A copy of every linear-attention layer's state (its attributes: their layout differs between
        transformers releases), for `rewind`."""
        return [(layer, copy.deepcopy(vars(layer))) for layer in self.cache.layers
                if isinstance(layer, LinearAttentionCacheLayerMixin)]

    def rewind(self, states: list[tuple[LinearAttentionCacheLayerMixin, dict]], count: int) -> None:
        """Back to before the last ``count`` slots: the linear-attention layers to ``states`` (taken then), the
        other layers' last ``count`` slots dropped (cropping only those: a linear-attention layer cannot be cropped,
        and some transformers releases raise on it)."""
        restored = set()
        for layer, state in states:
            vars(layer).update(state)
            restored.add(id(layer))
        for layer in self.cache.layers:
            if id(layer) not in restored:
                layer.crop(-count)
        self.readable = self.readable[:, :-count]

    def drop_unread_tail(self) -> None:
        """Forget the slots at the end that no row reads."""
        read = self.readable.any(dim=0).nonzero()
        self.drop_last(self.readable.shape[1] - (int(read[-1]) + 1 if len(read) else 0))


class _Batch:
    """One batch decoded step by step: the target's and the MTP head's shared caches and the rows still running."""

    def __init__(self, target: PreTrainedModel, head: MTPDraftHead | None, num_draft_tokens: int,
                 max_new_tokens: int, eos_token_ids: Collection[int], sampling: Sampling,
                 on_finished: Callable[[int, Decoded], None] | None) -> None:
        self.target, self.head, self.num_draft_tokens = target, head, num_draft_tokens
        self.max_new_tokens, self.eos_token_ids, self.sampling = max_new_tokens, eos_token_ids, sampling
        self.on_finished = on_finished
        self.device = target.device
        self.draft_probs: torch.Tensor | None = None  # [rows, drafts, vocab], sampled runs only

    def run(self, rows: list[_Row]) -> list[Decoded]:
        start = time.perf_counter()
        results: dict[int, Decoded] = {}
        typed_cache = self.target.config if _has_linear_attention(self.target) else None
        self.target_slots, self.mtp_slots = _Slots(len(rows), typed_cache), _Slots(len(rows))
        hidden, lengths = self._prefill(rows)
        last = hidden[torch.arange(len(rows), device=self.device), torch.tensor(lengths, device=self.device) - 1]
        for row, token in zip(rows, self._draw(self.target.lm_head(last), rows), strict=True):
            row.tokens.append(token)
        rows, hidden = self._retire(rows, hidden, results, start)
        self._draft(rows, hidden, [row.prompt[1:] + row.tokens for row in rows], [0] * len(rows))
        while rows:
            kept, next_tokens, hidden = self._verify(rows)
            decided, starts = [], []
            for row, count, next_token in zip(rows, kept, next_tokens, strict=True):
                starts.append(row.position)  # of x_m: the MTP head reads its hidden state with the next token
                decided.append([*row.drafts[:count], next_token])
                for token in decided[-1]:
                    if not self._finished(row):
                        row.tokens.append(token)
            rows, hidden, decided, starts = self._retire(rows, hidden, results, start, decided, starts)
            if rows:
                self.target_slots.drop_unread_tail()
                self._draft(rows, hidden, decided, starts)
        return [results[index] for index in sorted(results)]

    def _prefill(self, rows: list[_Row]) -> tuple[torch.Tensor, list[int]]:
        """The target reads every prompt (right-padded); its hidden states ``[rows, longest, hidden]``."""
        lengths = [len(row.prompt) for row in rows]
        longest = max(lengths)
        ids = torch.tensor([row.prompt + [0] * (longest - len(row.prompt)) for row in rows], device=self.device)
        readable = torch.arange(longest).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        positions = torch.arange(longest, device=self.device).expand(len(rows), -1)
        return self._target_hidden(ids, positions, readable), lengths

    def _verify(self, rows: list[_Row]) -> tuple[list[int], list[int], torch.Tensor]:
        """The target reads ``[x_m, drafts]`` of every row: each row's accepted count and next token, and the
        target's hidden states ``[rows, 1 + drafts, hidden]``."""
        width = 1 + max(len(row.drafts) for row in rows)
        ids = torch.tensor([[row.tokens[-1], *row.drafts] + [0] * (width - 1 - len(row.drafts)) for row in rows],
                           device=self.device)
        positions = torch.tensor([row.position for row in rows], device=self.device).unsqueeze(1) + torch.arange(
            width, device=self.device)
        counts = torch.tensor([1 + len(row.drafts) for row in rows])
        before = self.target_slots.linear_states() if _has_linear_attention(self.target) else None
        hidden = self._target_hidden(ids, positions, torch.arange(width).unsqueeze(0) < counts.unsqueeze(1))
        logits = self.target.lm_head(hidden)
        if self.sampling.greedy:
            best = logits.argmax(dim=-1).tolist()
            kept = [accepted_count([float(draft == target) for draft, target in zip(row.drafts, choice)],
                                   [1.0] * len(row.drafts), self.sampling, None) for row, choice in zip(rows, best)]
            next_tokens = [choice[count] for choice, count in zip(best, kept)]
        else:
            kept, next_tokens = self._verify_sampled(rows, probabilities(logits, self.sampling), width - 1)
        readable = torch.arange(width).unsqueeze(0) < torch.tensor(kept).unsqueeze(1) + 1
        self.target_slots.readable[:, -width:] = readable
        if before is not None and kept[0] + 1 < width:  # one row (`decode_batch`); it read a rejected draft
            self.target_slots.rewind(before, width)
            self._target_hidden(ids[:, : kept[0] + 1], positions[:, : kept[0] + 1], readable[:, : kept[0] + 1])
        for row, count in zip(rows, kept, strict=True):
            row.target_forwards += 1
            if row.drafts:
                row.accepted += [index < count for index in range(len(row.drafts))]
                row.accepted_per_step.append(count)
        return kept, next_tokens, hidden

    def _verify_sampled(self, rows: list[_Row], target_probs: torch.Tensor, width: int) -> tuple[list[int], list[int]]:
        """The accept/reject rule per row (``target_probs``: ``[rows, 1 + width, vocab]``), then one token from the
        target (all drafts stood) or from the correction at the first rejection."""
        every = torch.arange(len(rows), device=self.device)
        draft_probs = self.draft_probs if width else None  # the drafts' q, made with them by _draft
        kept = [0] * len(rows)
        if draft_probs is not None:
            drafted = torch.tensor([row.drafts + [0] * (width - len(row.drafts)) for row in rows],
                                   device=self.device).unsqueeze(-1)
            p = target_probs[:, :width].gather(-1, drafted).squeeze(-1).tolist()
            q = draft_probs.gather(-1, drafted).squeeze(-1).tolist()
            kept = [accepted_count(p[i][:len(row.drafts)], q[i][:len(row.drafts)], self.sampling, row.generator)
                    for i, row in enumerate(rows)]
        at = torch.tensor(kept, device=self.device)
        chosen = target_probs[every, at]
        if draft_probs is not None:
            rejected = at < torch.tensor([len(row.drafts) for row in rows], device=self.device)
            corrected = correction(chosen, draft_probs[every, at.clamp(max=width - 1)])
            chosen = torch.where(rejected.unsqueeze(-1), corrected, chosen)
        return kept, self._sample(chosen, rows)

    def _draft(self, rows: list[_Row], hidden: torch.Tensor, decided: list[list[int]], starts: list[int]) -> None:
        """Feed the MTP head each row's decided positions (``starts[i]..``: the target's hidden state there, the
        decided token after it), then draft as many tokens as each row's budget allows, the head reapplied to its
        own output; the drafts go to ``row.drafts`` and their distributions to ``self.draft_probs``."""
        counts = [self._budget(row) for row in rows]
        for row in rows:
            row.drafts = []
        if not rows or self.head is None or max(counts) == 0:
            return
        fed = torch.tensor([len(tokens) for tokens in decided])
        width = int(fed.max())
        ids = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens in decided], device=self.device)
        first = torch.tensor(starts, device=self.device).unsqueeze(1)
        positions = first + torch.arange(width, device=self.device)
        mask = self.mtp_slots.mask_with(torch.arange(width).unsqueeze(0) < fed.unsqueeze(1), self.device)
        every = torch.arange(len(rows), device=self.device)
        own = self.head.hidden(hidden[:, :width], ids, positions, self.mtp_slots.cache, mask)
        own = own[every, fed.to(self.device) - 1].unsqueeze(1)
        position = first + fed.to(self.device).unsqueeze(1)  # of the next recursive MTP position
        draft_probs = []
        for depth in range(max(counts)):
            drafting = [count > depth for count in counts]
            logits = self.head.lm_head(own)[:, 0]
            if self.sampling.greedy:
                tokens = logits.argmax(dim=-1).tolist()
            else:
                draft_probs.append(probabilities(logits, self.sampling))
                tokens = self._sample(draft_probs[-1], rows, drafting)
            for row, token, drafts in zip(rows, tokens, drafting):
                if drafts:
                    row.drafts.append(token)
            if depth + 1 < max(counts):
                mask = self.mtp_slots.mask_with(torch.ones(len(rows), 1, dtype=torch.bool), self.device)
                own = self.head.hidden(own, torch.tensor(tokens, device=self.device).unsqueeze(1), position + depth,
                                       self.mtp_slots.cache, mask)
        self.mtp_slots.drop_last(max(counts) - 1)  # the recursive positions held undecided tokens
        self.draft_probs = torch.stack(draft_probs, dim=1) if draft_probs else None

    def _retire(self, rows: list[_Row], hidden: torch.Tensor, results: dict[int, Decoded], start: float,
                *per_row: list) -> tuple:
        """Take the finished rows out of the batch (their results to ``results``), and their entries out of the
        caches, of ``hidden`` and of each list in ``per_row``."""
        running = [i for i, row in enumerate(rows) if not self._finished(row)]
        if len(running) == len(rows):
            return (rows, hidden, *per_row)
        for row in rows:
            if self._finished(row):
                results[row.index] = Decoded(row.tokens, row.accepted, row.target_forwards,
                                             time.perf_counter() - start, row.accepted_per_step)
                if self.on_finished is not None:
                    self.on_finished(row.index, results[row.index])
        for slots in (self.target_slots, self.mtp_slots):
            slots.keep_rows(running, self.device)
        return ([rows[i] for i in running], hidden[running], *([values[i] for i in running] for values in per_row))

    def _target_hidden(self, ids: torch.Tensor, positions: torch.Tensor, readable: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states ``[rows, n, hidden]`` of the target for ``ids`` at ``positions``; ``readable``
        (``[rows, n]``) marks the new slots that are real tokens."""
        mask = self.target_slots.mask_with(readable, self.device)
        return self.target.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                 past_key_values=self.target_slots.cache, use_cache=True).last_hidden_state

    def _draw(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """One token per row from ``logits [rows, vocab]``."""
        if self.sampling.greedy:
            return logits.argmax(dim=-1).tolist()
        return self._sample(probabilities(logits, self.sampling), rows)

    def _sample(self, probs: torch.Tensor, rows: list[_Row], drawing: list[bool] | None = None) -> list[int]:
        """One token per row from ``probs [rows, vocab]`` where ``drawing`` says so (default: every row; the others
        get 0 and use no random number), each with its row's generator, on the CPU: a seed gives the same tokens on
        any device."""
        on_cpu = probs.float().cpu()
        return [int(torch.multinomial(on_cpu[i], 1, generator=row.generator))
                if drawing is None or drawing[i] else 0 for i, row in enumerate(rows)]

    def _budget(self, row: _Row) -> int:
        """Drafts worth making: none once finished, and never more than could be emitted after the next token."""
        if self._finished(row):
            return 0
        return max(0, min(self.num_draft_tokens, self.max_new_tokens - len(row.tokens) - 1))

    def _finished(self, row: _Row) -> bool:
        return _finished(row.tokens, self.max_new_tokens, self.eos_token_ids)


def _finished(tokens: list[int], max_new_tokens: int, eos_token_ids: Collection[int]) -> bool:
    return len(tokens) >= max_new_tokens or tokens[-1] in eos_token_ids


def _check(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
