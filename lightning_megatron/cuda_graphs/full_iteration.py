"""`MegatronStrategy(cuda_graph=...)`: a training step's whole forward-backward captured once as one CUDA graph
(Megatron-Core's `FullCudaGraphWrapper`) and replayed, so that the host no longer paces the GPU. `auto` (the
default) graphs where the refusal table lets it and runs the rest eagerly; `full_iteration` refuses what it
cannot graph, naming the fix; `none` is always eager.

Why: on one H200 (P5's shape, `bench/packing.py`: Qwen3-0.6B, rows of 4096, 48 SFT sequences of 128-2048 tokens,
bf16; `bench/results/h200_2026-12-04d/`) both layouts are host-bound when eager: full rows (cuDNN SDPA) 1.38 s a step
with the GPU busy 83%, packed rows (flex_attention) 2.62 s with the GPU busy 43%, each ~38k kernel launches.
Through this class packed rows take 1.13 s (49.0k real tokens/s) and full rows 1.27 s, the GPU busy 99%, ~590
launches: packed rows at 1.08x graphed and 1.18x eager full rows' real tokens/s.

What it covers, and how:
- Training steps only. `forward_only` schedules (validation, test, predict) always run eagerly, never the graph.
- One graph per run, for the first training batch's signature (microbatch count, every tensor's shape and dtype,
  every host value). The first step with it runs eagerly through the wrapper (flex_attention compiles), the second
  is captured and replayed, later ones replay. A batch with another signature (a shorter last batch, a packed row of
  more than `sequences_per_row` sequences, or one whose single sequence fills the row) runs eagerly: `counts()`.
- Packed rows: `cu_seqlens` padded to `sequences_per_row + 1` boundaries with empty sequences at the row's end and
  `max_seqlen` set to the row length - 1 (`microbatch.with_fixed_sequence_count`: attention, RoPE, MTP's roll and
  the loss are unchanged), so every packed row of a run has the same static shapes.
- One stream for the whole fit: from the graph's making, before Megatron DDP wraps the model, until `release`
  (the strategy's teardown), the current stream is Megatron-Core's capture stream. DDP keeps every parameter's
  `AccumulateGrad` node, whose stream is the one current when it was made; made on the default (legacy) stream,
  the captured backward has to make that stream wait on the capturing one, which CUDA refuses ("operation would
  make the legacy stream depend on a capturing blocking stream": the H200 probe of 2026-12-04 found it behind the
  failed captures of packed, and at times full, rows). Megatron-Core's remedy, torch's
  `set_override_stale_capture_stream`, is not in torch 2.11.
- Full or padded rows: in the graph's own steps (its eager warm-up and its capture) causal attention goes through
  the layout path (flex_attention) instead of SDPA's cuDNN kernel, whose backward did not capture (the same
  legacy-stream error, seen before the one-stream fix and not retried since); validation and the batches that run
  eagerly keep cuDNN SDPA, as without the graph (the two are bf16-close).
- Replays redo the GPU work only: the Python of `forward_step` and `loss_func` runs at warm-up and capture, so the
  step's metrics are what `loss_func` returns, copied out of the graph's static outputs after every replay; host
  side effects inside them do not repeat (under `auto`, a LightningModule says it has none:
  `replayable_training_step`).
- The graph-safe RNG tracker of Megatron-Core (`use_cudagraphable_rng`): the capture registers its generators. The
  strategy seeds with it whenever the graph may still come (`StrategyCudaGraphs.may_graph`, decided in
  `setup_environment`, before the model is built); it draws the same numbers as the plain tracker, and checkpoints
  hold its states as tensors either way (`checkpoint.py`), so a run resumes under any `cuda_graph`.

Refused (the `FULL_ITERATION` rows of `refusals.REFUSALS`): no CUDA device; pipeline parallelism (its send/receive
schedule is not captured here); context parallelism (the CP cut reads `cu_seqlens` on the host inside the step);
Mixture of Experts (token routing has data-dependent shapes and host reads); tree rows (`subtree_end`); a core
attention other than `SDPAttention`; MTP-only training (`MTPOnlyCallback` chooses in Python, step by step, whether
the main head runs). `full_iteration` raises on them, naming the option; `auto` steps aside, and also (its
`auto_only` rows) for more than one process, dropout while training and a LightningModule that does not set
`replayable_training_step`.

`auto`, what the user sees: one line, once per fit, at INFO on rank zero: what is graphed ("cuda_graph auto:
training steps from one CUDA graph (full_iteration); validation eager", said at the first training batch), or why
the training steps run eagerly (the first refusal that applies: the run's setting in `setup_environment`, the
model when the graph would be made, the first training batch's rows). A warm-up or capture that fails under `auto`
does not stop the fit: the graph is released, a warning gives the cause once, and that batch and the rest of the
fit run eagerly. What the failed attempt accumulated is dropped first (the gradient buffers are zeroed again and
Megatron-Core's MTP loss tracker cleaned: a capture records without running, but a failure after the wrapper's
first replay, or during the eager warm-up, leaves partial sums), so the eager re-run makes the step's gradients
and metrics once; the optimizer step comes after `forward_backward` in Lightning's loop, so it is applied once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_megatron.cuda_graphs.graphed_forward import failure
from lightning_megatron.cuda_graphs.options import CudaGraphOptions, IterationGraph
from lightning_megatron.cuda_graphs.refusals import Mechanism, Setting, auto_reason, check_setting, refuse
from lightning_megatron.distributed import ParallelSizes
from lightning_megatron.microbatch import CU_SEQLENS, MAX_SEQLEN, Microbatch, with_fixed_sequence_count

if TYPE_CHECKING:
    from lightning_megatron.contract import MegatronLightningModule

logger = logging.getLogger(__name__)


class StrategyCudaGraphs:
    """`MegatronStrategy`'s CUDA graphs: its options, parsed and checked when the strategy is made and against the
    run in `setup_environment` (and MTP-only training, by `MTPOnlyCallback`); a fit's whole-iteration graph
    (`graph`, None: eager), made before DDP wraps the model (the fit's stream changes with it) and released at
    teardown (its counts stay readable). Under `auto` what the refusal table refuses is said once instead."""

    def __init__(self, cuda_graph: str, sequences_per_row: int, parallel: ParallelSizes) -> None:
        self.options = CudaGraphOptions.parse(cuda_graph, sequences_per_row)
        self.setting = Setting(self.options, parallel)
        check_setting(self.setting)
        self.graph: FullIterationGraph | None = None

    def check_run(self, device: torch.device, processes: int, module: MegatronLightningModule) -> None:
        """What `setup_environment` knows: the device, the process count, the LightningModule."""
        self._learn(device=device, processes=processes, module=module)

    def check_mtp_only(self) -> None:
        """`MTPOnlyCallback` trains the run: `full_iteration` is refused, `auto` steps aside."""
        self._learn(mtp_only=True)

    def _learn(self, **facts: Any) -> None:
        self.setting = replace(self.setting, **facts)
        check_setting(self.setting)

    @property
    def may_graph(self) -> bool:
        """Whether training steps may come from the graph, as far as the run is known (what the RNG tracker and
        the seeds are chosen by)."""
        mode = self.options.full_iteration
        return mode is IterationGraph.REQUIRED or (mode is IterationGraph.AUTO and auto_reason(self.setting) is None)

    def make(self, chunks: list[torch.nn.Module]) -> None:
        """The graph of a fit's training steps over `chunks` (not yet wrapped by DDP), if the options ask for it
        and, under `auto`, nothing in the run or the model is in the way (said in one line if something is)."""
        from megatron.core.utils import unwrap_model

        self.graph = None
        mode = self.options.full_iteration
        if mode is IterationGraph.OFF:
            return
        auto = mode is IterationGraph.AUTO
        if auto:
            why = auto_reason(self.setting) or next(
                (why for why in (auto_reason(unwrap_model(chunk)) for chunk in chunks) if why is not None), None)
            if why is not None:
                say_eager(why)
                return
        self.graph = FullIterationGraph(chunks, self.options.sequences_per_row, auto=auto)

    def release(self) -> None:
        """Free the graph's memory and put back the stream the fit ran on."""
        if self.graph is not None:
            self.graph.release()


AUTO_GRAPHED = "cuda_graph auto: training steps from one CUDA graph (full_iteration); validation eager"


@rank_zero_only
def say_eager(why: str) -> None:
    """`auto`'s one line when the training steps run eagerly."""
    logger.info("cuda_graph auto: training steps eager: %s; set cuda_graph: none to silence", why)


@rank_zero_only
def _say_graphed() -> None:
    logger.info(AUTO_GRAPHED)


@rank_zero_only
def _warn_fallback(stage: str, cause: str) -> None:
    logger.warning("cuda_graph auto: the CUDA graph's %s of the training step failed (%s); that step and the rest of "
                   "the fit run eagerly; set cuda_graph: none to silence", stage, cause)


def _use_capture_stream(device: torch.device) -> torch.cuda.Stream | None:
    """Make Megatron-Core's capture stream current on a CUDA `device` (after the work queued so far); return the
    stream it replaces (None on other devices: nothing changed)."""
    if device.type != "cuda":
        return None
    from megatron.core.full_cuda_graph import get_shared_capture_stream

    with torch.cuda.device(device):
        previous = torch.cuda.current_stream()
        stream = get_shared_capture_stream()
        stream.wait_stream(previous)
        torch.cuda.set_stream(stream)
    return previous


def _restore_stream(previous: torch.cuda.Stream | None) -> None:
    """Undo `_use_capture_stream` (after the work queued on the capture stream)."""
    if previous is None:
        return
    with torch.cuda.device(previous.device):
        previous.wait_stream(torch.cuda.current_stream())
        torch.cuda.set_stream(previous)


class FullIterationGraph:
    """One training batch signature's forward-backward, captured once and replayed (see the module docstring).

    `auto`: what the table refuses in a batch runs it eagerly (said once, when it is the first batch, and then the
    whole fit is eager), and a failed warm-up or capture falls back to eager for the rest of the fit
    (`stepped_aside` says why); otherwise both raise."""

    def __init__(self, chunks: list[torch.nn.Module], sequences_per_row: int, *, auto: bool = False) -> None:
        from megatron.core.utils import unwrap_model

        from lightning_megatron.attention import SDPAttention

        if not auto:
            for chunk in chunks:
                refuse(Mechanism.FULL_ITERATION, unwrap_model(chunk))
        self._attention = [module for chunk in chunks for module in chunk.modules() if isinstance(module, SDPAttention)]
        self.sequences_per_row = sequences_per_row
        self.auto = auto
        self.stepped_aside: str | None = None  # auto: why the rest of the fit runs eagerly
        self._first_batch = True
        self._signature: tuple | None = None
        self._wrapper: Any = None
        self.warmups = self.captures = self.replays = self.eager = 0
        release_megatron_graph()  # the wrapper keeps its graph and buffers on the class: a new run starts clean
        self._stream_before = _use_capture_stream(next(chunks[0].parameters()).device)

    def counts(self) -> dict[str, int]:
        return {"warmups": self.warmups, "captures": self.captures, "replays": self.replays, "eager": self.eager}

    def static_microbatches(self, microbatches: list[Microbatch]) -> list[Microbatch]:
        """Packed rows with the fixed sequence count and rotary length; tree rows refused (kept as they are under
        `auto`: the batch runs eagerly)."""
        fixed = []
        for microbatch in microbatches:
            if self.auto and auto_reason(microbatch) is not None:
                fixed.append(microbatch)
                continue
            refuse(Mechanism.FULL_ITERATION, microbatch)
            if CU_SEQLENS not in microbatch:  # full or padded rows
                fixed.append(microbatch)
                continue
            boundaries = microbatch[CU_SEQLENS]
            longest = microbatch.get(MAX_SEQLEN)
            if not isinstance(longest, int):  # a host read, before the step: the data did not say it on the host
                longest = int((boundaries[1:] - boundaries[:-1]).max())
            row = microbatch["input_ids"].shape[1]
            if longest >= row or len(boundaries) - 1 > self.sequences_per_row:
                fixed.append(microbatch)  # another signature: this batch runs eagerly
            else:
                fixed.append(with_fixed_sequence_count(microbatch, self.sequences_per_row, row - 1))
        return fixed

    def run(self, forward_backward: Callable[..., list], microbatches: list[Microbatch], **kwargs: Any) -> list:
        """`forward_backward(data_iterator=..., **kwargs)` of the schedule: captured, replayed or eager."""
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        refused = next((why for why in map(auto_reason, microbatches) if why is not None), None) if self.auto else None
        if self._first_batch and self.auto:
            self._first_batch = False
            if refused is not None:
                self.stepped_aside = refused
                say_eager(refused)
            else:
                _say_graphed()
        signature = _signature(microbatches)
        self._signature = self._signature or signature
        if self.stepped_aside is not None or refused is not None or signature != self._signature:
            self.eager += 1
            return forward_backward(data_iterator=iter(microbatches), **kwargs)
        if self._wrapper is not None and FullCudaGraphWrapper.cuda_graph["training"] is not None:
            self.replays += 1
            return _copied(self._wrapper(data_iterator=iter(microbatches), **kwargs))
        capturing = self._wrapper is not None and FullCudaGraphWrapper.curr_iteration["training"] == 1
        try:
            if self._wrapper is None:
                self._wrapper = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=1)
            with self._layout_path():
                if capturing:
                    _forget_cached_layouts()  # the graph builds its own, in its memory pool
                losses = self._wrapper(data_iterator=iter(microbatches), **kwargs)
        except Exception as error:
            if self.auto:
                return self._fall_back("capture" if capturing else "warm-up", error, forward_backward, microbatches,
                                       kwargs)
            if capturing:
                release_megatron_graph()
                raise RuntimeError(f"cuda_graph: full_iteration: the capture of the training step failed "
                                   f"({type(error).__name__}: {error}); set cuda_graph: none") from error
            raise
        if capturing:
            _forget_cached_layouts()  # eager steps must not reuse tensors that replays overwrite
            self.captures += 1
        else:
            self.warmups += 1
        return _copied(losses)

    @contextmanager
    def _layout_path(self) -> Iterator[None]:
        """Causal rows through flex_attention in the graph's own steps (cuDNN SDPA's backward does not capture)."""
        for module in self._attention:
            module.causal_rows_through_layout = True
        try:
            yield
        finally:
            for module in self._attention:
                module.causal_rows_through_layout = False

    def _fall_back(self, stage: str, error: Exception, forward_backward: Callable[..., list],
                   microbatches: list[Microbatch], kwargs: dict[str, Any]) -> list:
        """`auto`: drop the graph and what the failed attempt accumulated, then run this batch eagerly (the module
        docstring says why the step's gradients, metrics and optimizer step then happen once)."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        release_megatron_graph()
        self._wrapper = None
        self.stepped_aside = f"the {stage} failed: {failure(error)}"
        _warn_fallback(stage, failure(error))
        for chunk in kwargs["model"]:
            chunk.zero_grad_buffer()
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        self.eager += 1
        return forward_backward(data_iterator=iter(microbatches), **kwargs)

    def release(self) -> None:
        """Free the graph and its buffers, and put back the stream that was current before it (idempotent)."""
        release_megatron_graph()
        self._wrapper = None
        _restore_stream(self._stream_before)
        self._stream_before = None


def _copied(losses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The graph's static outputs are overwritten by the next replay: a copy of each tensor."""
    return [{name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in item.items()}
            for item in losses]


def release_megatron_graph() -> None:
    """Drop `FullCudaGraphWrapper`'s class-level training graph, its outputs and its static input buffers."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

    FullCudaGraphWrapper.reset_cuda_graph(FullCudaGraphWrapper, "training")
    StaticBufferLoader.static_buffers["training"].clear()
    _forget_cached_layouts()


def _forget_cached_layouts() -> None:
    from lightning_megatron._compat.packed_rope import forget_last_gather
    from lightning_megatron.attention_layout import forget_cached_layout

    forget_cached_layout()
    forget_last_gather()


def _signature(microbatches: list[Microbatch]) -> tuple:
    """What a captured graph depends on: every tensor's key, shape, dtype and device, every other value."""
    return tuple(tuple(sorted((key, (tuple(value.shape), value.dtype, value.device.type))
                              if isinstance(value, torch.Tensor) else (key, value) for key, value in item.items()))
                 for item in microbatches)
