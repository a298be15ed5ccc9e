"""MTP-only training without the main LM head's backward pass.

With every non-MTP parameter frozen, the main SFT loss is kept in the graph for one reason: Megatron-Core hangs the
MTP loss's backward off it. `process_mtp_loss` returns the main hidden states through `MTPLossAutoScaler`, whose
backward passes the incoming gradient on unchanged and injects `main_loss_backward_scale` as the MTP loss gradient,
whatever that incoming gradient's values. The main logits are then computed from those hidden states, so a plain
backward runs the main cross-entropy backward over `[s, b, vocab]` and the LM head's input-gradient matmul, and
keeps the main logits alive until then, only to reach that node. The main-loss gradient itself ends in frozen
parameters: it never reaches an MTP one (the MTP layer's output is not an input of the main logits).

`skip_main_lm_head_backward` hooks each last-stage chunk with an MTP block so the main output layer reads a
detached copy of those hidden states, and ties the model's output (the per-token loss, or the logits without
labels) back to them through `ZeroGradientTie`, whose backward sends zeros. The output still requires grad, so the
schedule still runs backward, `MTPLossAutoScaler.backward` still fires with the same scale and the MTP gradients
are the same; the main-loss values are computed exactly as before.

With `chunk_tokens` (the default) neither head's loss keeps a `[tokens, vocab]` fp32 tensor: the main loss is
computed in Megatron-Core's own way (its output layer, its `compute_language_model_loss`), `chunk_tokens` tokens
at a time under `no_grad` (its backward is skipped anyway), through `GPTModel.forward`'s `output_processor` hook,
so its logits never exist whole; the MTP head's loss, which does backpropagate into the MTP layer, goes through
`chunked_cross_entropy` (the model's `compute_language_model_loss`, which `GPTModel` hands `process_mtp_loss`, is
replaced for the fit by `self_distill.MTPDepthLoss`, which self-distillation shares) and keeps each chunk's
gradient, made in the forward, instead of an fp32 softmax. Values and gradients are the same to fp32 rounding;
`chunk_tokens=None` is the previous implementation.

With chunked losses the main head also runs on demand (`MainLossOnDemand`): in MTP-only training `lm_loss` is only
a number to log, so on training steps that do not log it neither the main output layer nor its cross-entropy runs.
The model's output is then `_SkippedMainLoss`: zeros of the per-token loss's shape, tied to the same hidden states
with the same zero gradient, so the MTP loss's backward and every MTP gradient are unchanged; `main_loss_skipped`
tells a loss function the output holds no main loss (SFTModule then logs no `lm_loss`). Validation (no grad) always
runs the main head.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from lightning_megatron.mtp.chunked_cross_entropy import DEFAULT_CHUNK_TOKENS
from lightning_megatron.mtp.parameters import mtp_parameter_flags
from lightning_megatron.mtp.self_distill import DepthLossHandle, use_mtp_depth_loss


class ZeroGradientTie(torch.autograd.Function):
    """`main_output` unchanged, made to depend on `hidden` with a zero gradient (only the shape of it is kept)."""

    @staticmethod
    def forward(ctx: Any, main_output: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        ctx.hidden_layout = (hidden.shape, hidden.dtype, hidden.device)
        return main_output.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, torch.Tensor]:
        shape, dtype, device = ctx.hidden_layout
        return None, torch.zeros(shape, dtype=dtype, device=device)


class _SkippedMainLoss(torch.autograd.Function):
    """The model's output on a step that skips the main head: zeros in the per-token loss's place, tied to `hidden`
    with a zero gradient like `ZeroGradientTie`; its own class so `main_loss_skipped` can tell it apart."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, loss_shape: torch.Size) -> torch.Tensor:
        ctx.hidden_layout = (hidden.shape, hidden.dtype, hidden.device)
        return torch.zeros(loss_shape, dtype=torch.float32, device=hidden.device)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        shape, dtype, device = ctx.hidden_layout
        return torch.zeros(shape, dtype=dtype, device=device), None


def main_loss_skipped(output: torch.Tensor) -> bool:
    """Whether a model output is `_SkippedMainLoss`'s: no main head ran, so it holds no main loss to report."""
    return isinstance(getattr(output, "grad_fn", None), _SkippedMainLoss._backward_cls)


class MainLossOnDemand:
    """Whether the next training forwards compute the main loss (`compute`), shared by every hooked chunk; its
    owner (`MTPOnlyCallback`) sets it before each step."""

    def __init__(self) -> None:
        self.compute = True


class _MainHeadShortcut:
    """The hooks of one GPTModel chunk. Per forward, `process_mtp_loss` calls the output layer once per MTP depth,
    then `_postprocess` calls it for the main logits on the hidden states `MTPLossAutoScaler` returned; anything
    else under grad is refused rather than silently trained differently."""

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        self.mtp_depths = model.config.mtp_num_layers
        self.autoscaler_node = MTPLossAutoScaler._backward_cls
        self.calls = 0
        self.hidden: torch.Tensor | None = None

    def before_model(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls, self.hidden = 0, None

    def before_output_layer(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self.calls += 1
        if not torch.is_grad_enabled():
            return None
        if not args:
            raise RuntimeError("MTPOnlyCallback: the output layer was called without a positional input; "
                               "megatron-core's call pattern changed, pass MTPOnlyCallback(skip_main_head_backward="
                               "False)")
        hidden = args[0]
        if not isinstance(hidden.grad_fn, self.autoscaler_node):
            return None  # an MTP depth's logits: its backward is the MTP loss's
        if self.calls != self.mtp_depths + 1 or self.hidden is not None:
            raise RuntimeError(f"MTPOnlyCallback: output-layer call {self.calls} of this forward reads "
                               f"MTPLossAutoScaler's output; expected exactly call {self.mtp_depths + 1} (after "
                               f"{self.mtp_depths} MTP depth(s)); megatron-core's call pattern changed, pass "
                               "MTPOnlyCallback(skip_main_head_backward=False)")
        _refuse_trainable_head(module, kwargs.get("weight"))
        self.hidden = hidden
        return (hidden.detach(), *args[1:]), kwargs

    def after_model(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        hidden, self.hidden = self.hidden, None
        if hidden is not None:
            return ZeroGradientTie.apply(output, hidden)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            raise RuntimeError("MTPOnlyCallback: the model's output requires grad but no main output-layer call "
                               "read MTPLossAutoScaler's output; megatron-core's call pattern changed, pass "
                               "MTPOnlyCallback(skip_main_head_backward=False)")
        return None


def _refuse_trainable_head(output_layer: torch.nn.Module, weight: torch.Tensor | None) -> None:
    trainable = [p for p in (weight if weight is not None else output_layer.weight,
                             getattr(output_layer, "bias", None)) if p is not None and p.requires_grad]
    if trainable:
        raise RuntimeError("MTPOnlyCallback: the main output layer's weight requires grad, so its backward is "
                           "needed; something unfroze it after setup")


class _ChunkedMainLoss:
    """The main head of one GPTModel chunk, through `GPTModel.forward`'s `output_processor`: per token chunk its
    output layer and `compute_language_model_loss` under `no_grad`, the per-token loss tied to the hidden states
    `MTPLossAutoScaler` returned with a zero gradient (so the MTP loss's backward still runs)."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int, on_demand: MainLossOnDemand) -> None:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        self.autoscaler_node = MTPLossAutoScaler._backward_cls
        self.chunk_tokens = chunk_tokens
        self.on_demand = on_demand
        # Megatron-Core's own (fused when configured) loss: nothing backpropagates through the main head's chunks,
        # so they need no chunked backward
        self.language_model_loss = type(model).compute_language_model_loss.__get__(model)

    def before_model(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None  # validation: the plain forward (its output-layer calls are what it captures)
        if kwargs.get("output_processor") is not None:
            raise RuntimeError("MTPOnlyCallback: the model was called with an output_processor of its own; pass "
                               "MTPOnlyCallback(loss_chunk_tokens=None)")
        return args, {**kwargs, "output_processor": self.main_loss}

    def main_loss(self, *, hidden_states: torch.Tensor, output_layer: torch.nn.Module,
                  output_weight: torch.Tensor | None, labels: torch.Tensor | None,
                  runtime_gather_output: bool | None, scale_logits: Any, **_: Any) -> torch.Tensor:
        if labels is None:
            raise RuntimeError("MTPOnlyCallback: MTP-only training needs labels in the forward call")
        if not isinstance(hidden_states.grad_fn, self.autoscaler_node):
            raise RuntimeError("MTPOnlyCallback: the main head's input is not MTPLossAutoScaler's output; "
                               "megatron-core's call pattern changed, pass MTPOnlyCallback(loss_chunk_tokens=None)")
        _refuse_trainable_head(output_layer, output_weight)
        if not self.on_demand.compute:
            return _SkippedMainLoss.apply(hidden_states, labels.shape)
        loss = torch.empty(labels.shape, dtype=torch.float32, device=hidden_states.device)
        with torch.no_grad():
            for hidden_slice, label_slice in self._token_chunks(hidden_states, output_layer.sequence_parallel):
                logits, _ = output_layer(hidden_states[hidden_slice], weight=output_weight,
                                         runtime_gather_output=runtime_gather_output)
                loss[label_slice] = self.language_model_loss(labels[label_slice], scale_logits(logits))
        return ZeroGradientTie.apply(loss, hidden_states)

    def _token_chunks(self, hidden: torch.Tensor, sequence_parallel: bool) -> list[tuple[tuple, tuple]]:
        """(hidden `[s, b]` index, labels `[b, s]` index) pairs. Under sequence parallelism the output layer gathers
        the sequence dimension itself, so a chunk is whole sequences; otherwise `chunk_tokens` tokens."""
        seq, batch = hidden.shape[0], hidden.shape[1]
        if sequence_parallel:
            per_chunk = max(1, self.chunk_tokens // (seq * _tensor_parallel_size()))
            return [((slice(None), slice(b, b + per_chunk)), (slice(b, b + per_chunk), slice(None)))
                    for b in range(0, batch, per_chunk)]
        per_chunk = max(1, self.chunk_tokens // batch)
        return [((slice(s, s + per_chunk), slice(None)), (slice(None), slice(s, s + per_chunk)))
                for s in range(0, seq, per_chunk)]


def _tensor_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


_MAIN_LOSS_PROCESSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _ProcessorHandle:
    """Forgets a model's chunked main loss when the hooks are removed (the handles' `remove`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = weakref.ref(model)

    def remove(self) -> None:
        model = self.model()
        if model is not None:
            _MAIN_LOSS_PROCESSORS.pop(model, None)


def main_loss_processor(model: torch.nn.Module) -> Any:
    """The chunked main head `skip_main_lm_head_backward` installed on `model`, as a `GPTModel.forward`
    `output_processor` (on demand: zeros on the training steps that log no `lm_loss`), for callers that run
    `GPTModel._postprocess` themselves (the trunk cache)."""
    if model not in _MAIN_LOSS_PROCESSORS:
        raise RuntimeError("the chunked main loss is not installed on this model: MTPOnlyCallback needs "
                           "skip_main_head_backward: true and loss_chunk_tokens set for this")
    return _MAIN_LOSS_PROCESSORS[model]


def skip_main_lm_head_backward(chunks: list[torch.nn.Module], *, chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                               on_demand: MainLossOnDemand | None = None
                               ) -> list[RemovableHandle | DepthLossHandle | _ProcessorHandle]:
    """Hook every last-stage chunk with an MTP block (unwrapped GPTModels, before DDP); returns the handles.

    Only valid when every non-MTP parameter is frozen on this rank (checked: `freeze_non_mtp_parameters` first).
    Chunks without the output layer (earlier pipeline stages, virtual chunks before the last) get no hooks.
    `chunk_tokens`: both heads' losses in chunks of that many tokens (module docstring); None: whole logits.
    `on_demand` (with `chunk_tokens`): training forwards skip the main head while its `compute` is false.
    """
    from megatron.core.utils import unwrap_model

    trainable = [name for name, parameter, is_mtp in mtp_parameter_flags(chunks).values()
                 if parameter.requires_grad and not is_mtp]
    if trainable:
        raise ValueError(f"skipping the main LM head's backward needs every non-MTP parameter frozen; trainable: "
                         f"{trainable[:5]}")
    handles: list[RemovableHandle | DepthLossHandle | _ProcessorHandle] = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        if not (getattr(model, "post_process", False) and getattr(model.config, "mtp_num_layers", None)):
            continue
        if chunk_tokens is not None:
            chunked = _ChunkedMainLoss(model, chunk_tokens, on_demand or MainLossOnDemand())
            _MAIN_LOSS_PROCESSORS[model] = chunked.main_loss
            handles += [model.register_forward_pre_hook(chunked.before_model, with_kwargs=True),
                        _ProcessorHandle(model), *use_mtp_depth_loss([model], label_chunk_tokens=chunk_tokens)]
            continue
        shortcut = _MainHeadShortcut(model)
        handles += [
            model.register_forward_pre_hook(shortcut.before_model, with_kwargs=True),
            model.output_layer.register_forward_pre_hook(shortcut.before_output_layer, with_kwargs=True),
            model.register_forward_hook(shortcut.after_model, with_kwargs=True),
        ]
    return handles
