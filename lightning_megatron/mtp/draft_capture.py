"""The draft head's teacher-forced acceptance at every MTP depth, read off the model's own forward.

With `mtp_num_layers = K` (Megatron-Core's repeated MTP layer), depth k's draft at position t predicts token
t + 1 + k; the target's own prediction of that token is the main head at t + k. Per depth and position:
greedy acceptance (the draft's argmax is the main head's greedy token), sampled acceptance
(`sum_x min(p, q)`, main `p` at t + k and depth-k `q` at t, both at the sampling temperature) and whether the
position counts (the loss mask says the drafted token is trained). "t + k" is Megatron-Core's own `roll_tensor`
applied k times, the roll its MTP labels and mask get: within each packed sequence and across context-parallel
chunks, so every CP rank counts its own positions and a position whose token lies past its sequence never counts.
Logits stay vocabulary-parallel under TP (`vocab_parallel_argmax`, `sampled_acceptance_overlap`).

`DraftCapture` wraps a module's `forward_step` for Megatron's schedule (validation reads depth 1, the draft probe
every depth); `reduce_draft_totals` pools a probe's counts over data-parallel and CP ranks and hands them to every
pipeline stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from lightning_megatron.generate import vocab_parallel_argmax
from lightning_megatron.microbatch import CU_SEQLENS, Microbatch, packed_seq_params
from lightning_megatron.mtp.acceptance import sampled_acceptance_overlap

ForwardStep = Callable[[torch.nn.Module, Microbatch], torch.Tensor]


@dataclass(frozen=True)
class DraftPositions:
    """One depth's acceptance on one microbatch, per position `[b, s]` as this rank holds the rows: `greedy` (1
    where the draft's argmax is the target's greedy token), `sampled` (`sum_x min(p, q)`) and `counted` (1 where the
    drafted token is trained)."""

    greedy: torch.Tensor
    sampled: torch.Tensor
    counted: torch.Tensor

    def totals(self) -> torch.Tensor:
        """`[greedy accepted, sampled overlap, counted]` summed over the counted positions, float64."""
        counted = self.counted.to(torch.float64)
        return torch.stack([(self.greedy.to(torch.float64) * counted).sum(),
                            (self.sampled.to(torch.float64) * counted).sum(), counted.sum()])


class DraftCapture:
    """`forward_step` for Megatron's schedule that reads the output-layer calls of the last stage as they happen
    (the MTP depths first, then the main logits: Megatron-Core's `GPTModel._postprocess` order) and, at the main
    call, makes the first `depths` depths' `DraftPositions`; `positions()` hands them to the loss function of the
    same microbatch. Megatron-Core's cross-entropy overwrites logits in place (fp32 logits are not copied), so each
    depth's logits are copied when made and nothing reads logits after their loss ran."""

    def __init__(self, forward_step: ForwardStep, depths: int, temperature: float) -> None:
        if depths < 1:
            raise ValueError(f"depths: {depths} must be at least 1")
        self.inner, self.depths, self.temperature = forward_step, depths, temperature
        self._positions: list[DraftPositions] | None = None

    def forward_step(self, model: torch.nn.Module, microbatch: Microbatch) -> torch.Tensor:
        from megatron.core.utils import unwrap_model

        unwrapped = unwrap_model(model)
        output_layer = getattr(unwrapped, "output_layer", None)
        if output_layer is None or not unwrapped.post_process:
            return self.inner(model, microbatch)
        model_depths = unwrapped.config.mtp_num_layers or 0
        if self.depths > model_depths:
            raise ValueError(f"the draft head's acceptance at {self.depths} depth(s) needs as many MTP depths; the "
                             f"model runs {model_depths} (SFTModule(enable_mtp=True, mtp_depths=...))")
        calls: list[int] = []
        drafts: list[tuple[torch.Tensor, torch.Tensor]] = []  # per depth: argmax ids [b, s], logits [s, b, V/TP]

        def read(_module: torch.nn.Module, _args: tuple, output: tuple) -> None:
            calls.append(len(calls) + 1)
            if calls[-1] <= self.depths:
                drafts.append((vocab_parallel_argmax(output[0]).transpose(0, 1), output[0].clone()))
            elif calls[-1] == model_depths + 1:
                self._positions = self._read_depths(microbatch, drafts, output[0])
                drafts.clear()

        handle = output_layer.register_forward_hook(read)
        try:
            output = self.inner(model, microbatch)
        finally:
            handle.remove()
        if len(calls) != model_depths + 1:
            raise RuntimeError(f"expected {model_depths} MTP depth(s) and the main output-layer call, saw "
                               f"{len(calls)} calls")
        return output

    def positions(self) -> list[DraftPositions]:
        """The depths of the microbatch the last `forward_step` ran (once: they are dropped when taken)."""
        if self._positions is None:
            raise RuntimeError("no draft positions: forward_step did not run the last stage's output layer")
        positions, self._positions = self._positions, None
        return positions

    def _read_depths(self, microbatch: Microbatch, drafts: list[tuple[torch.Tensor, torch.Tensor]],
                     main_logits: torch.Tensor) -> list[DraftPositions]:
        from megatron.core import parallel_state
        from megatron.core.transformer.multi_token_prediction import roll_tensor

        packed = packed_seq_params(microbatch) if CU_SEQLENS in microbatch else None
        roll_once = partial(roll_tensor, shifts=-1, dims=-1, cp_group=parallel_state.get_context_parallel_group(),
                            packed_seq_params=packed)

        def roll(tensor: torch.Tensor, times: int) -> torch.Tensor:
            for _ in range(times):
                tensor = roll_once(tensor)[0]
            return tensor

        main_ids = vocab_parallel_argmax(main_logits).transpose(0, 1)
        loss_mask = microbatch["loss_mask"].to(main_ids.device).float()
        positions = []
        for depth, (draft_ids, draft_logits) in enumerate(drafts, start=1):
            sampled = sampled_acceptance_overlap(draft_logits, main_logits, self.temperature,
                                                 partial(roll, times=depth),
                                                 parallel_state.get_tensor_model_parallel_group())
            positions.append(DraftPositions(greedy=(draft_ids == roll(main_ids, depth)).float(), sampled=sampled,
                                            counted=roll(loss_mask, depth)))
        return positions


def reduce_draft_totals(totals: torch.Tensor) -> torch.Tensor:
    """A probe's `[depths, 3]` totals (`DraftPositions.totals` summed on this rank) summed over data-parallel and
    context-parallel ranks (tensor-parallel ranks hold the same counts) and sent from the last pipeline stage, where
    they were counted, to every stage."""
    from megatron.core import parallel_state

    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return totals
