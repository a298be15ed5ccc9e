"""The Adam epsilon under which two fits whose gradients differ only by rounding end with comparable weights.

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

EPS_OVER_LR = 10.0


def comparable_adam_eps(lr: float) -> float:
    """`adam_eps` for fits at learning rate `lr` whose weights a test compares with another layout's or another
    computation's after optimizer steps."""
    return EPS_OVER_LR * lr
