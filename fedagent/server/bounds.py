"""``fedagent verify``'s float64 recomputation of a server step, with the bound on fp32's error.

Each server optimizer's :meth:`~fedagent.server.optimizer_base.ServerOptimizer.bound` is built from
these terms; each returns (exact value, bound on |fp32 result − exact|) as a :data:`Bound`.

The merge consumed the *stored* fp32 delta d (checked against the exact one above), the prev
weights p (exact in fp32) and the stored fp32 state m₀, v₀ (round 1: ``init_state``, m₀ = 0,
v₀ = fl(τ²)), so those are exact inputs here and the only error is the fp32 rounding of this
one step. Each fp32 operation, rounding a hyper-parameter to fp32 included, errs by at most u
times its result; an input already off by e carries e (times the factor it is multiplied by).
The bounds are first order with every coefficient raised by one: the spare u·(magnitudes)
exceeds all O(u²) terms (≤ k²u² times the same magnitudes, k ≤ 8) and float64's own 2⁻⁵³.
Each bound also gets TINY = 2⁻¹⁴⁶ (8 subnormal ulps), where relative bounds fail.

- FedAvg   w = p + ηd             e_w = 2u|p| + 4u|ηd|           (η→fp32, ×, +)
- FedAvgM  m = βm₀ + d            e_m = 4u(|βm₀| + |d|)          (β→fp32, ×, +)
           w = p + ηm             e_w = 2u|p| + 4u|ηm| + |η|e_m
- FedAdam  m = β₁m₀ + (1−β₁)d     e_m = 4u(|β₁m₀| + |(1−β₁)d|)
           v = β₂v₀ + (1−β₂)d²    e_v = 4uβ₂v₀ + 5u(1−β₂)d²      (fl(d²) adds one)
- FedYogi  m as FedAdam;  v = v₀ − (1−β₂)d²·s, s = sign(v₀ − d²):  e_v = 2uv₀ + 5u(1−β₂)d²
- Adam/Yogi w = p + q, q = ηm/(√v + τ), through √ (1 rounding), +τ (2), η·m̂ (2), ÷ (1), +p (1):
    e_√   = min(e_v / (√v + √(v − e_v)), √e_v)     (|√a − √b| = |a − b|/(√a + √b) ≤ √|a − b|)
    e_den = e_√ + 3u(√v + τ);   e_num = |η|e_m + 3u|ηm|
    e_q   = (e_num + |q|·e_den) / (√v + τ − e_den) + 2u|q|   (|a'/b' − a/b| ≤ (|a'−a| + |a/b||b'−b|)/|b'|)
    e_w   = 2u(|p| + |q|) + e_q
  i.e. ≈ 14u relative on the quotient when m does not cancel (e_√ ≈ 2.5u√v, e_den ≲ 5.5u·den).

Yogi's sign: fp32 takes sign(v₀ − fl(d²)), which differs from the exact sign (or is 0) only
where |v₀ − d²| ≤ u·d². At elements with |v₀ − d²| ≤ 2u·d² + TINY all of s ∈ {−1, 0, 1} are
honest; the branch nearest the stored v is used for v *and* w, so both must agree on one branch
(another branch is a (1−β₂)·d² change, far outside tolerance). A 1e-4 relative change of any
weight or state element is ~100× these tolerances, unless m itself cancels there.
"""

from __future__ import annotations

import torch

U32 = 2.0**-24
TINY = 2.0**-146

Bound = tuple[torch.Tensor, torch.Tensor]


def axpy(p: torch.Tensor, eta: float, x: torch.Tensor, e_x: torch.Tensor | float) -> Bound:
    """p + η·x as ``p.add_(x̂, alpha=η)`` gives it, x̂ being off by at most e_x."""
    y = eta * x
    return p + y, 2 * U32 * p.abs() + 4 * U32 * y.abs() + abs(eta) * e_x + TINY


def lin(a: float, x: torch.Tensor, b: float, y: torch.Tensor) -> Bound:
    """a·x + b·y as ``x.mul_(a).add_(y, alpha=b)`` gives it (momentum / first moment)."""
    ax, by = a * x, b * y
    return ax + by, 4 * U32 * (ax.abs() + by.abs()) + TINY


def adam_v(v0: torch.Tensor, d2: torch.Tensor, beta2: float) -> Bound:
    """FedAdam's second moment β₂v₀ + (1−β₂)d²."""
    a, b = beta2 * v0, (1 - beta2) * d2
    return a + b, 4 * U32 * a + 5 * U32 * b + TINY


def yogi_v(v0: torch.Tensor, d2: torch.Tensor, beta2: float, got_v: torch.Tensor) -> Bound:
    """FedYogi's v₀ − (1−β₂)d²·sign(v₀ − d²), the sign taken from the stored v where rounding may flip it."""
    c = 1 - beta2
    s = torch.sign(v0 - d2)  # exact: d2 is exact in float64, and a subtraction keeps its sign
    near = (v0 - d2).abs() <= 2 * U32 * d2 + TINY
    if bool(near.any()):
        vb, cd, gb = v0[near], c * d2[near], got_v[near]
        branches = torch.stack([vb + cd, vb, vb - cd])  # s = −1, 0, +1
        s[near] = (gb - branches).abs().argmin(0).to(s.dtype) - 1
    return v0 - c * d2 * s, 2 * U32 * v0 + 5 * U32 * c * d2 + TINY


def adaptive_w(p: torch.Tensor, eta: float, m: Bound, v: Bound, tau: float) -> Bound:
    """p + η·m/(√v + τ) as ``addcdiv_`` gives it from m̂ and v̂ (see the module docstring)."""
    (m, e_m), (v, e_v) = m, v
    r = v.sqrt()
    e_r = torch.minimum(e_v / (r + (v - e_v).clamp_min(0).sqrt()), e_v.sqrt())
    den = r + tau
    e_den = e_r + 3 * U32 * den + TINY
    num = eta * m
    e_num = abs(eta) * e_m + 3 * U32 * num.abs() + TINY
    q = num / den
    # den − e_den ≤ 0 would mean no bound: the division gives inf there (e_num > 0).
    e_q = (e_num + q.abs() * e_den) / (den - e_den).clamp_min(0) + 2 * U32 * q.abs() + TINY
    return p + q, 2 * U32 * (p.abs() + q.abs()) + e_q + TINY
