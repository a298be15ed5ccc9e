"""Adam's arithmetic for tests: the epsilon under which two fits whose gradients differ only by rounding end with
comparable weights, and how far two fp32 implementations of one Adam step may put a weight apart.

The epsilon.

Adam moves each weight by lr * m / (sqrt(v) + eps) (m, v: the bias-corrected moments of its gradient). With the
default eps (1e-8) the step of a weight whose gradient is a sum that nearly cancels is about lr * sign(gradient):
two fits that add the same terms in another order (another TP/EP/PP/CP layout, chunked losses) can step such a
weight by lr in opposite directions, so after a few steps their weights differ by the order of lr, whatever bound
a test puts on them (3.5e-5 after three steps at lr 1e-3 on one CPU, under 1e-5 on another).

With eps >= 10 lr the step is a Lipschitz function of the gradients: d step / d m <= lr / eps, and
|d step / d sqrt(v)| <= lr |m| / (sqrt(v) + eps)^2 <= lr / (4 eps) (|m| <= sqrt(v) for the first steps, Cauchy-
Schwarz on the two moving averages), and m and sqrt(v) move by at most the largest change of the gradient. So one
step changes by at most 1.25 lr / eps = 0.125 times the gradients' rounding differences (~1e-7 in fp32 at the
tests' sizes), and k steps' weights differ by about 0.125 k of them: far below the tests' 1e-5 and 1e-6, on every
CPU. The steps are smaller than the default eps gives (a gradient g moves its weight by lr g / (|g| + eps)), which
equivalence tests do not mind.
"""

from __future__ import annotations

import torch

EPS_OVER_LR = 10.0
FP32_UNIT_ROUNDOFF = 2.0 ** -24
"""u: fp32 rounds a real x to x (1 + d), |d| <= u (round to nearest, 24-bit significand)."""


def comparable_adam_eps(lr: float) -> float:
    """`adam_eps` for fits at learning rate `lr` whose weights a test compares with another layout's or another
    computation's after optimizer steps."""
    return EPS_OVER_LR * lr


def fp32_adam_step_bound(params: torch.Tensor, stepped: torch.Tensor, grads: torch.Tensor, *, step: int, lr: float,
                         betas: tuple[float, float], eps: float, exp_avgs: torch.Tensor | float = 0.0,
                         exp_avg_sqs: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per weight, how far two fp32 implementations of one AdamW step (torch's for-loop, foreach or fused) may put
    it apart, both starting from `params`, the moments `exp_avgs`, `exp_avg_sqs` (0 before the first step) and the
    gradients `grads`; `stepped`: either's result. float64.

    Each rounds every operation it computes once (relative error <= u, `FP32_UNIT_ROUNDOFF`), in its own order and
    grouping; first-order terms only. With M = b1 |m| + (1 - b1) |g| (what the new first moment m' is made of,
    |m'| <= M), v' = b2 v + (1 - b2) g^2 and c_k = 1 - b_k^step, one implementation is at most
    - 2u |p| from exact in the decoupled decay p (1 - lr wd) (the factor, the product),
    - 18u lr M / (c1 (sqrt(v' / c2) + eps)) in the update lr / c1 * m' / (sqrt(v' / c2) + eps): m' 6u M (a lerp
      or two products and a sum, each intermediate at most 2M), sqrt(v' / c2) + eps 8u relative (v' 4u: sums of
      non-negative terms; half of it through the root, the root, the division, eps's addition), the step size
      lr / c1 2u, the quotient and the product 1u each,
    - u |p'| in the sum that writes the weight,
    so two of them are at most twice that apart. After one step from zero moments the update's term is 36u lr at
    most (|m'| / c1 = |g| = sqrt(v' / c2)).
    """
    u = FP32_UNIT_ROUNDOFF
    beta1, beta2 = betas
    params, stepped, grads = params.double(), stepped.double(), grads.double()
    exp_avgs = torch.as_tensor(exp_avgs, dtype=torch.float64)
    exp_avg_sqs = torch.as_tensor(exp_avg_sqs, dtype=torch.float64)
    first = beta1 * exp_avgs.abs() + (1 - beta1) * grads.abs()
    second = beta2 * exp_avg_sqs + (1 - beta2) * grads.square()
    denominator = (second / (1 - beta2 ** step)).sqrt() + eps
    update = lr * first / ((1 - beta1 ** step) * denominator)
    return 4 * u * params.abs() + 2 * u * stepped.abs() + 36 * u * update
