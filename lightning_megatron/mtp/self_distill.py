"""Self-distillation MTP loss: the MTP head at depth k and position t learns the detached main-head distribution
that predicts the same token (the main head at position t + k), by KL divergence over the whole vocabulary.

Why: a hard-label MTP loss teaches the head the data's next-but-one token, not what the target model would say; to
make the labels say that, the model's own greedy continuations had to be generated first, and even then the head
only learns the target's argmax. Speculative *sampling* accepts a draft with probability `min(1, p/q)`, so what
matters there is the whole distribution: `alpha = sum_x min(p(x), q(x))` is highest when `q = p`. The KL to the
target's own distribution trains exactly that, on any text, with no generation step (SkyRL's and NeMo-RL's choice
for drafts used in RL rollouts).

`mtp_distill_temperature` T softens (T > 1) or sharpens (T < 1) the teacher only: `p = softmax(z_main / T)`,
`q = softmax(z_mtp)`. T = 1 (the default) matches the target's distribution, which is what sampling at any
temperature needs (a serving engine divides both models' logits by the same sampling temperature); T -> 0 is the
hard-label loss on the model's own greedy continuation.

`mtp_distill_weighting` matches the positions to serving. The MTP layer at position t reads token t + 1; on the
corpus that is the corpus token, when serving it is the main head's own choice there (greedy: its argmax; sampled:
a draw from it). "uniform" (the default) weighs every position alike; "greedy" keeps only the positions whose
token t + 1 is the main head's argmax at t (`z_t[x] >= max z_t`), those a greedy server feeds the head;
"sampled" weighs each by the probability the main head gives that token, `softmax(z_t)[x_{t+1}]` (temperature 1),
how often a sampling server feeds it. Depth k reads tokens t + 1 .. t + k and weighs by the product of their k
weights. The weights come from the detached main head (the same chunked, vocabulary-parallel logits as the
teacher's, one position earlier) and the MTP block's own rolled input ids; they multiply the per-token loss
(Adam's step does not depend on the loss's overall scale, so only their relative size matters).

How it is wired: nothing of Megatron-Core's MTP path is replaced. `process_mtp_loss` still rolls labels and mask
(per packed sequence, across CP chunks), masks, scales and attaches the loss through `MTPLossAutoScaler`; what
changes is the per-token loss it asks the model for (`GPTModel.compute_language_model_loss`, an instance override
installed for the fit by :class:`MTPDepthLoss`). The teacher for depth k is the main decoder's final hidden state
(what the output layer reads) rolled k positions left by Megatron-Core's own `roll_tensor` with the same CP group
and packed-sequence parameters the labels are rolled with, so the teacher at t is the main head at t + k exactly
where the rolled label is token t + k + 1, and a position whose target would cross a sequence boundary is one the
rolled mask drops. The teacher logits are made from those hidden states a token chunk at a time (the output
layer's own weight, under no grad); the softmaxes are vocabulary-parallel (max and sum all-reduced over the TP
group, as Megatron-Core's cross-entropy does), and no `[tokens, vocab]` fp32 tensor outlives a chunk. The
per-chunk loss is a `ChunkDivergence` (`KLDivergence` here); `mtp.tv_loss` adds the TV loss and a KL/TV hybrid on
the same machinery (teacher, chunks, roll, weighting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.mtp.chunked_cross_entropy import DEFAULT_CHUNK_TOKENS, chunked_language_model_loss

MTPLossType = Literal["labels", "self_distill", "tv", "tv_kl"]  # tv, tv_kl: `mtp.tv_loss`
MTP_LOSS_TYPES: tuple[MTPLossType, ...] = ("labels", "self_distill", "tv", "tv_kl")
DepthLossSetting = Literal["label_chunk_tokens", "divergence", "depth_scales"]
DistillWeighting = Literal["uniform", "greedy", "sampled"]
DISTILL_WEIGHTINGS: tuple[DistillWeighting, ...] = ("uniform", "greedy", "sampled")
# a chunk holds two fp32 distributions over the vocabulary (student and teacher) where the hard-label loss holds
# one: half the tokens keeps the chunk's transient memory that of the hard-label loss
DISTILL_CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS // 2


def _shifted_fp32(logits: torch.Tensor, tp_group: Any, temperature: float) -> torch.Tensor:
    """An fp32 copy of `logits / temperature` less its row maximum over the whole (vocabulary-parallel)
    vocabulary: the one `[n, vocab / TP]` fp32 tensor the (log-)softmax below is made in."""
    chunk = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        chunk /= temperature
    chunk_max = chunk.max(dim=-1)[0]
    dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=tp_group)
    return chunk.sub_(chunk_max.unsqueeze(-1))


def vocab_parallel_log_softmax(logits: torch.Tensor, tp_group: Any, temperature: float = 1.0) -> torch.Tensor:
    """fp32 `log_softmax(logits / temperature)` over the whole (vocabulary-parallel) vocabulary, made in one fp32
    copy of `logits` (max and sum of exponentials all-reduced over the TP group, as Megatron-Core's
    cross-entropy does)."""
    chunk = _shifted_fp32(logits, tp_group, temperature)
    sum_exp = chunk.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)
    return chunk.sub_(sum_exp.log().unsqueeze(-1))


def vocab_parallel_softmax(logits: torch.Tensor, tp_group: Any, temperature: float = 1.0) -> torch.Tensor:
    """fp32 `softmax(logits / temperature)` over the whole (vocabulary-parallel) vocabulary in one fp32 copy of
    `logits`, the exponentials made in place: two passes over the chunk fewer than `exp` of the log-softmax."""
    chunk = _shifted_fp32(logits, tp_group, temperature).exp_()
    sum_exp = chunk.sum(dim=-1)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)
    return chunk.div_(sum_exp.unsqueeze(-1))


class ChunkDivergence(Protocol):
    """A per-token loss of the student's logits against the teacher's distribution, one chunk of rows at a time:
    what `distillation_loss` computes (KL here, TV and the hybrid in `mtp.tv_loss`).

    Called with the student's `[n, vocab / TP]` logits (this rank's shard, the model's dtype) and the teacher's
    fp32 `log_softmax(z_main / teacher_temperature)` over the same shard, or its `softmax` where
    `teacher_probabilities` is true (the divergence may overwrite it); returns
    the fp32 per-token loss `[n]`, already summed over the TP group, and with `with_gradient` its fp32 gradient
    with respect to the student's logits (per token, `[n, vocab / TP]`)."""

    @property
    def teacher_temperature(self) -> float: ...

    @property
    def teacher_probabilities(self) -> bool: ...

    def __call__(self, student: torch.Tensor, teacher: torch.Tensor, tp_group: Any,
                 with_gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class KLDivergence:
    """`mtp_loss_type: self_distill`: `KL(softmax(z_main / T) || softmax(z_mtp))`, T the teacher's only (module
    docstring); gradient `q - p`."""

    teacher_temperature: float = 1.0
    teacher_probabilities: ClassVar[bool] = False  # the KL reads log p

    def __post_init__(self) -> None:
        if not self.teacher_temperature > 0:
            raise ValueError(f"mtp_distill_temperature: {self.teacher_temperature} must be > 0 (1.0 matches the "
                             "target's distribution)")

    def __call__(self, student: torch.Tensor, log_p: torch.Tensor, tp_group: Any,
                 with_gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        log_q = vocab_parallel_log_softmax(student, tp_group)
        p = log_p.exp()
        gradient = log_q.exp().sub_(p) if with_gradient else None
        kl = log_q.neg_().add_(log_p).mul_(p).sum(dim=-1)
        dist.all_reduce(kl, op=dist.ReduceOp.SUM, group=tp_group)
        return kl, gradient


class _ChunkedDistillation(torch.autograd.Function):
    """Per-token `divergence` of `[n, vocab / TP]` student logits from the teacher, whose logits are
    `teacher_hidden @ weight.T` (its last dimension the hidden size), made per chunk. While a chunk's two
    distributions exist its gradient is kept (in the student's dtype), so the backward only scales it: no second
    teacher matmul, no recomputed softmax (`chunked_cross_entropy` does the same, and says why)."""

    @staticmethod
    def forward(ctx: Any, student: torch.Tensor, teacher_hidden: torch.Tensor, weight: torch.Tensor,
                teacher_logits: Any, divergence: ChunkDivergence, tp_group: Any, chunk_tokens: int) -> torch.Tensor:
        rows = student.size(0)
        loss = torch.empty(rows, dtype=torch.float32, device=student.device)
        gradient = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        with torch.no_grad():
            for start in range(0, rows, chunk_tokens):
                end = min(rows, start + chunk_tokens)
                teacher = teacher_logits(teacher_hidden[start:end], weight)
                make = vocab_parallel_softmax if divergence.teacher_probabilities else vocab_parallel_log_softmax
                log_p = make(teacher, tp_group, divergence.teacher_temperature)
                del teacher
                chunk_loss, chunk_gradient = divergence(student[start:end], log_p, tp_group, gradient is not None)
                del log_p  # nothing of this chunk outlives it but its loss and gradient
                loss[start:end] = chunk_loss
                if gradient is not None:
                    gradient[start:end] = chunk_gradient
                del chunk_gradient
        ctx.gradient = gradient
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gradient, ctx.gradient = ctx.gradient, None
        return gradient.mul_(grad_output.unsqueeze(-1)), None, None, None, None, None, None


def distillation_loss(student_logits: torch.Tensor, teacher_hidden: torch.Tensor, weight: torch.Tensor,
                      tp_group: Any, divergence: ChunkDivergence, chunk_tokens: int = DISTILL_CHUNK_TOKENS,
                      scale_logits: Any = None) -> torch.Tensor:
    """Per-token `divergence` (e.g. `KLDivergence(T)`: `KL(softmax(teacher / T) || softmax(student))`) over the
    whole vocabulary.

    `student_logits`: `[..., vocab / TP]` (this rank's vocabulary shard); `teacher_hidden`: `[..., hidden]`, the
    same leading shape, detached; `weight`: this rank's `[vocab / TP, hidden]` output weight, so that the teacher
    logits are `teacher_hidden @ weight.T` (then `scale_logits`, e.g. MuP's), made `chunk_tokens` rows at a time.
    Only the student gets a gradient (the divergence's, times the incoming one).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: {chunk_tokens} must be at least 1")
    leading = student_logits.shape[:-1]
    if teacher_hidden.shape[:-1] != leading:
        raise ValueError(f"teacher_hidden {list(teacher_hidden.shape)} must have the student's leading shape "
                         f"{list(leading)}")

    def teacher_logits(hidden: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, output_weight)
        return logits if scale_logits is None else scale_logits(logits)

    loss = _ChunkedDistillation.apply(student_logits.reshape(-1, student_logits.size(-1)),
                                      teacher_hidden.detach().reshape(-1, teacher_hidden.size(-1)),
                                      weight.detach(), teacher_logits, divergence, tp_group, chunk_tokens)
    return loss.view(leading)


def serving_weight(hidden: torch.Tensor, next_tokens: torch.Tensor, weight: torch.Tensor, tp_group: Any,
                   weighting: DistillWeighting, chunk_tokens: int = DISTILL_CHUNK_TOKENS,
                   scale_logits: Any = None) -> torch.Tensor:
    """Per position, how a server feeds the main head's choice `next_tokens` (token t + 1) to the MTP layer: "greedy"
    1.0 where it is the argmax of the main logits `hidden @ weight.T` (`z[x] >= max z`), else 0.0; "sampled" its
    probability `softmax(z)[x]`. `hidden`: `[..., hidden]` (detached), `next_tokens`: the same leading shape,
    `weight`: this rank's `[vocab / TP, hidden]` output weight (the vocabulary split as Megatron-Core splits it).
    fp32, no gradient."""
    if weighting not in ("greedy", "sampled"):
        raise ValueError(f"mtp_distill_weighting: {weighting!r} must be one of {list(DISTILL_WEIGHTINGS)}")
    if next_tokens.shape != hidden.shape[:-1]:
        raise ValueError(f"next_tokens {list(next_tokens.shape)} must have the hidden states' leading shape "
                         f"{list(hidden.shape[:-1])}")
    shard = weight.size(0)
    first = dist.get_rank(tp_group) * shard
    rows = hidden.reshape(-1, hidden.size(-1))
    local = next_tokens.reshape(-1).long() - first
    here = (local >= 0) & (local < shard)
    local = local.clamp(0, shard - 1).unsqueeze(-1)
    result = torch.empty(rows.size(0), dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for start in range(0, rows.size(0), chunk_tokens):
            end = min(rows.size(0), start + chunk_tokens)
            logits = F.linear(rows[start:end], weight)
            logits = (logits if scale_logits is None else scale_logits(logits)).float()
            if weighting == "greedy":
                chunk_max = logits.max(dim=-1)[0]
                dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=tp_group)
                chosen = logits.gather(-1, local[start:end]).squeeze(-1) >= chunk_max
            else:
                chosen = vocab_parallel_log_softmax(logits, tp_group).gather(-1, local[start:end]).squeeze(-1).exp()
            value = (chosen & here[start:end]) if weighting == "greedy" else chosen * here[start:end]
            value = value.float()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=tp_group)  # one rank holds the token
            result[start:end] = value
    return result.view(next_tokens.shape)


class _ScaledGradient(torch.autograd.Function):
    """A depth's per-token loss unchanged (what Megatron-Core logs for the depth), its gradient times `scale`."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output * ctx.scale, None


class MTPDepthLoss:
    """The per-token loss `process_mtp_loss` asks each MTP depth for, installed as the model's
    `compute_language_model_loss` while a fit uses it; the main head's own loss calls go to the class's method.

    Its users, in any order: `MTPOnlyCallback` sets `label_chunk_tokens` (the hard-label cross-entropy a chunk of
    tokens at a time), `SFTModule` sets `divergence` (self-distillation or TV, always chunked) and, for
    `mtp_depth_weights`, `depth_scales` (per depth, what its loss's gradient is multiplied by: Megatron-Core weighs
    every depth `1 / mtp_num_layers`; the logged per-depth losses stay unweighted). Each removes its setting with
    `release`; the override goes when none is left. A forward hook on the MTP block keeps the main decoder's hidden
    states and packed-sequence parameters of the forward in flight; the `mtp_num_layers` calls that follow are the
    MTP depths, in order (with the repeated layer, the one layer's K applications).
    """

    ATTRIBUTE = "compute_language_model_loss"

    def __init__(self, model: torch.nn.Module) -> None:
        if self.ATTRIBUTE in vars(model):
            raise RuntimeError(f"{type(model).__name__}.{self.ATTRIBUTE} is already overridden on this model")
        self.model = model
        self.class_loss = type(model).compute_language_model_loss.__get__(model)
        self.label_chunk_tokens: int | None = None
        self.divergence: ChunkDivergence | None = None
        self.depth_scales: tuple[float, ...] | None = None
        self.distill_chunk_tokens = DISTILL_CHUNK_TOKENS
        self.distill_weighting: DistillWeighting = "uniform"
        self._depths = model.config.mtp_num_layers
        self._pending = 0
        self._teacher: torch.Tensor | None = None
        self._packed_seq_params: Any = None
        self._input_ids: torch.Tensor | None = None  # weighting: the token ids the next depth reads, [b, s]
        self._depth_weight: torch.Tensor | None = None  # weighting: the product over the depths so far, [b, s]
        self._hook = model.mtp.register_forward_hook(self._capture, with_kwargs=True)
        setattr(model, self.ATTRIBUTE, self)

    @classmethod
    def of(cls, model: torch.nn.Module) -> MTPDepthLoss:
        """The model's installed depth loss, installed now if there is none."""
        installed = vars(model).get(cls.ATTRIBUTE)
        return installed if isinstance(installed, cls) else cls(model)

    def release(self, setting: DepthLossSetting) -> None:
        setattr(self, setting, None)
        if self.label_chunk_tokens is None and self.divergence is None and self.depth_scales is None:
            self._hook.remove()
            if vars(self.model).get(self.ATTRIBUTE) is self:
                delattr(self.model, self.ATTRIBUTE)

    def _capture(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        self._pending = self._depths
        self._packed_seq_params = kwargs.get("packed_seq_params")
        # what `process_mtp_loss` splits off as the main hidden states: the first of 1 + mtp_num_layers chunks,
        # over the whole sequence (gathered once per forward under sequence parallelism, as the logits are)
        self._teacher = None
        if self.divergence is not None:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            with torch.no_grad():
                self._teacher = output.chunk(1 + self._depths, dim=0)[0].detach()
                if self.model.output_layer.sequence_parallel:
                    self._teacher = gather_from_sequence_parallel_region(self._teacher, group=self.model.tp_group)
        self._input_ids = kwargs.get("input_ids") if self.distill_weighting != "uniform" else None
        self._depth_weight = None

    def __call__(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self._pending == 0:
            return self.class_loss(labels, logits)  # the main head's
        depth = self._depths - self._pending
        self._pending -= 1
        if self.divergence is not None:
            loss = self._self_distillation(logits)
        elif self.label_chunk_tokens is not None:
            loss = chunked_language_model_loss(self.model, self.label_chunk_tokens)(labels, logits)
        else:
            loss = self.class_loss(labels, logits)
        if self._pending == 0:
            self._teacher = self._packed_seq_params = self._input_ids = self._depth_weight = None
        return loss if self.depth_scales is None else _ScaledGradient.apply(loss, self.depth_scales[depth])

    def _self_distillation(self, logits: torch.Tensor) -> torch.Tensor:
        """Depth `mtp_num_layers - pending`: the teacher hidden states rolled once more, then the KL per token."""
        from megatron.core.transformer.multi_token_prediction import roll_tensor

        model = self.model
        if self._teacher is None:
            raise RuntimeError("MTP self-distillation: the MTP block's forward was not seen before its loss; "
                               "megatron-core's call pattern changed, use mtp_loss_type: labels")
        with torch.no_grad():
            teacher = self._teacher
            weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                      else model.output_layer.weight)
            if getattr(model.output_layer, "bias", None) is not None:
                raise ValueError("MTP self-distillation needs an output layer without bias (GPT models have none)")
            scale = model._scale_logits if model.config.use_mup else None
            if self.distill_weighting != "uniform":
                self._weigh_depth(teacher, weight, scale)
            rolled, _ = roll_tensor(teacher.permute(1, 2, 0).contiguous(), shifts=-1, dims=-1,
                                    cp_group=model.pg_collection.cp, packed_seq_params=self._packed_seq_params)
            self._teacher = rolled.permute(2, 0, 1)  # [s, b, h] again, rolled once per depth as the labels are
        loss = distillation_loss(logits, self._teacher, weight, model.tp_group, self.divergence,
                                 self.distill_chunk_tokens, scale)
        loss = loss.transpose(0, 1)  # [b, s], as compute_language_model_loss returns
        return (loss if self._depth_weight is None else loss * self._depth_weight).contiguous()

    def _weigh_depth(self, chooser: torch.Tensor, weight: torch.Tensor, scale: Any) -> None:
        """This depth's serving weight: its last input token (the MTP block's ids rolled once more, as the MTP layer
        rolls them) against the main head one position earlier (`chooser`: the teacher before this depth's roll),
        times the earlier depths' weights."""
        from megatron.core.transformer.multi_token_prediction import roll_tensor

        model = self.model
        if self._input_ids is None:
            raise RuntimeError("MTP self-distillation weighting: the MTP block was called without input_ids; "
                               "megatron-core's call pattern changed, use mtp_distill_weighting: uniform")
        self._input_ids, _ = roll_tensor(self._input_ids, shifts=-1, dims=-1, cp_group=model.pg_collection.cp,
                                         packed_seq_params=self._packed_seq_params)
        step = serving_weight(chooser.transpose(0, 1), self._input_ids, weight, model.tp_group,
                              self.distill_weighting, self.distill_chunk_tokens, scale)
        self._depth_weight = step if self._depth_weight is None else self._depth_weight * step


class DepthLossHandle:
    """What `use_mtp_depth_loss` set on one model; `remove()` takes it back (a hook handle's interface)."""

    def __init__(self, loss: MTPDepthLoss, setting: DepthLossSetting) -> None:
        self.loss, self.setting = loss, setting

    def remove(self) -> None:
        self.loss.release(self.setting)


def use_mtp_depth_loss(chunks: list[torch.nn.Module], *, label_chunk_tokens: int | None = None,
                       divergence: ChunkDivergence | None = None,
                       distill_chunk_tokens: int = DISTILL_CHUNK_TOKENS,
                       distill_weighting: DistillWeighting = "uniform") -> list[DepthLossHandle]:
    """Set the MTP depths' loss of every last-stage chunk with an MTP block (unwrapped GPTModels): hard labels in
    chunks of `label_chunk_tokens`, or distillation by `divergence` (`KLDivergence`, `mtp.tv_loss`'s) with
    `distill_weighting` (one of the two)."""
    if (label_chunk_tokens is None) == (divergence is None):
        raise ValueError("use_mtp_depth_loss sets label_chunk_tokens or divergence, exactly one")
    if distill_weighting not in DISTILL_WEIGHTINGS:
        raise ValueError(f"mtp_distill_weighting: {distill_weighting!r} must be one of {list(DISTILL_WEIGHTINGS)}")
    handles = []
    for loss in _depth_losses(chunks):
        if divergence is not None:
            loss.divergence, loss.distill_chunk_tokens = divergence, distill_chunk_tokens
            loss.distill_weighting = distill_weighting
            handles.append(DepthLossHandle(loss, "divergence"))
        else:
            loss.label_chunk_tokens = label_chunk_tokens
            handles.append(DepthLossHandle(loss, "label_chunk_tokens"))
    return handles


def use_mtp_depth_scales(chunks: list[torch.nn.Module], scales: tuple[float, ...]) -> list[DepthLossHandle]:
    """Multiply the gradient of MTP depth k's loss by `scales[k]` on every last-stage chunk with an MTP block (one
    scale per `mtp_num_layers`), whatever loss the depths compute."""
    handles = []
    for loss in _depth_losses(chunks):
        if len(scales) != loss.model.config.mtp_num_layers:
            raise ValueError(f"{len(scales)} depth scales for a model of mtp_num_layers "
                             f"{loss.model.config.mtp_num_layers}")
        loss.depth_scales = scales
        handles.append(DepthLossHandle(loss, "depth_scales"))
    return handles


def _depth_losses(chunks: list[torch.nn.Module]) -> list[MTPDepthLoss]:
    """The depth loss of every last-stage chunk with an MTP block, installed where there is none yet."""
    from megatron.core.utils import unwrap_model

    losses = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        if not (getattr(model, "post_process", False) and getattr(model.config, "mtp_num_layers", None)):
            continue
        if getattr(model, "mtp", None) is None:
            raise ValueError("the MTP loss needs the MTP block on the last pipeline stage with the output layer; "
                             "this layout puts it elsewhere")
        losses.append(MTPDepthLoss.of(model))
    return losses
