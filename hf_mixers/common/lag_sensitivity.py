"""Lag sensitivity: how strongly the output at t depends on the input l tokens earlier, ||dy_t / dx_{t-l}||.

Protocol (the one the Sessa paper's lag laws use): a **fixed old source** s and a **moving target** t = s + l. At a
fixed target the profile over sources behaves differently (under uniform routing older sources weigh more, and
attention is flat), so every report and plot states the protocol.

The measured quantity is the RMS gain of the Jacobian block J = dy_t / dx_s (D_out x D_in), ||J||_F / sqrt(D_out):
for J = c I it is |c|. It is estimated with Gaussian probes u, since E ||u^T J||^2 = ||J||_F^2: ``probes`` of them
run as one batch of identical inputs, one backward pass per target, so it works through every mixer's custom
backward (no forward-mode AD needed).

Theory where the mixer has one: each mixer's spec declares it (``MixerSpec.lag_theory``, in the mixer's own module):
attention's fixed-routing Jacobian alpha_{t,s} ~ 1/(t + 1) (slope -1 in l for a fixed old source); Sessa's closed form
under uniform routing, K = gamma Gamma(s+1) Gamma(s+l+gamma) / (Gamma(s+1+gamma) Gamma(s+l+1)) ~ l^-(1-gamma)
(``sessa_uniform_kernel`` below); a selective SSM's exp(-lambda sum Delta) through its slowest mode; VORT's retention
w_l(alpha) ~ l^(alpha-1), over its normaliser.
"""

from __future__ import annotations

import math

import numpy as np
import torch

PROTOCOL = "fixed source s, moving target t = s + l: RMS gain ||dy_t/dx_s||_F / sqrt(D_out)"


def lag_grid(max_lag: int, points: int = 48) -> list[int]:
    """About ``points`` lags from 1 to ``max_lag``, log-spaced (a log-log fit weighs every decade alike)."""
    if max_lag < 1:
        raise ValueError(f"lag sensitivity: the sequence leaves no lag after the source (max lag {max_lag})")
    grid = np.unique(np.round(np.geomspace(1, max_lag, num=min(points, max_lag))).astype(int))
    return [int(lag) for lag in grid]


def lag_sensitivity(fn, inputs: torch.Tensor, source: int = 0, lags=None, probes: int = 8, seed: int = 0) -> dict:
    """{lag: RMS gain of dy_{source+lag} / dx_source} for ``fn``: (P, T, D_in) -> (P, T, D_out), applied to
    ``inputs`` (1, T, D_in) repeated ``probes`` times (``fn`` must treat batch rows independently)."""
    if inputs.dim() != 3 or inputs.shape[0] != 1:
        raise ValueError(f"lag sensitivity: inputs must be (1, T, D), got {tuple(inputs.shape)}")
    length = inputs.shape[1]
    if not 0 <= source < length - 1:
        raise ValueError(f"lag sensitivity: source {source} must lie in [0, {length - 2}] for {length} tokens")
    lags = lag_grid(length - 1 - source) if lags is None else list(lags)
    if not lags or min(lags) < 0 or source + max(lags) >= length:
        raise ValueError(f"lag sensitivity: lags must lie in [0, {length - 1 - source}], got {lags}")
    x = inputs.detach().expand(probes, -1, -1).clone().requires_grad_(True)
    y = fn(x)  # (P, T, D_out)
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(probes, y.shape[-1], generator=generator, dtype=torch.float64).to(y.dtype)
    gains = {}
    for position, lag in enumerate(lags):
        (grad,) = torch.autograd.grad((y[:, source + lag] * u).sum(), x, retain_graph=position < len(lags) - 1)
        g = grad[:, source].double()  # (P, D_in): u_p^T J for each probe
        gains[int(lag)] = math.sqrt(g.pow(2).sum().item() / u.double().pow(2).sum().item())
    return gains


def fit_tail(gains: dict, tail_from: int | None = None) -> dict:
    """Power-law (log g = a + p log l) and exponential (log g = a - r l) fits over lags >= ``tail_from`` (default:
    the upper half of the lag range on a log scale), with their R^2 and which fits better."""
    lags = np.array(sorted(lag for lag, g in gains.items() if lag >= 1 and g > 0), dtype=float)
    if tail_from is None and len(lags):
        tail_from = math.sqrt(lags.min() * lags.max())
    lags = lags[lags >= (tail_from or 1)]
    if len(lags) < 3:
        return {"tail_from": tail_from, "points": int(len(lags))}
    values = np.log([gains[int(lag)] for lag in lags])

    def linear(x):
        slope, intercept = np.polyfit(x, values, 1)
        residual = values - (slope * x + intercept)
        total = ((values - values.mean()) ** 2).sum()
        return float(slope), float(intercept), float(1 - (residual ** 2).sum() / total) if total > 0 else 1.0

    power, exponential = linear(np.log(lags)), linear(lags)
    return {"tail_from": float(tail_from), "points": int(len(lags)),
            "power": {"exponent": power[0], "log_scale": power[1], "r2": power[2]},
            "exponential": {"rate": -exponential[0], "log_scale": exponential[1], "r2": exponential[2]},
            "better": "power" if power[2] >= exponential[2] else "exponential"}


def sessa_uniform_kernel(gamma: float, source: int, lags) -> list[float]:
    """K_{s+l, s} of the feedback solve with uniform routing 1/t and constant gain gamma (exact closed form)."""
    lead = math.log(gamma) + math.lgamma(source + 1) - math.lgamma(source + 1 + gamma)
    return [math.exp(lead + math.lgamma(source + lag + gamma) - math.lgamma(source + lag + 1)) if lag >= 1
            else 1.0 for lag in lags]
