"""Power-law retention weights and their sum-of-exponentials (SOE) approximation, as VORT uses them.

Mlaiki, "VORT: Adaptive Power-Law Memory for NLP Transformers" (arXiv 2605.08966), §2-3. A token written with order
alpha in (0, 1] is retained at lag j with the Grünwald-Letnikov weight

    w_j(alpha) = Gamma(j + alpha) / (Gamma(alpha) Gamma(j + 1))  ~  j^(alpha - 1) / Gamma(alpha)    (w_j(1) = 1)

a power law no finite recurrence reproduces. It is the moment sequence of a Beta(alpha, 1 - alpha) law on the decay
mu = e^-lambda, so w_j = integral rho(lambda) e^(-lambda j) d lambda with the density

    rho(lambda) = sin(pi alpha) / pi * e^(-alpha lambda) (1 - e^-lambda)^(-alpha)

and any quadrature of that integral is a sum of exponentials, i.e. S decayed linear-attention slots. The paper's
printed construction has three errors (an extra e^-lambda in rho, no Jacobian in the weights, the lower tail dropped,
which loses alpha = 1 entirely); this is the corrected one:

    nodes    Gauss-Legendre in log lambda on [lambda_min, lambda_max] = [eps / 2T, 2 log(2T / eps)]; the rates
             e^-xi_s do not depend on alpha, so tokens of every order share the slots
    c_s      Omega_s rho(xi_s), Omega_s = (L / 2) varpi_s xi_s (the Jacobian of the log substitution)
    c_0      the mass below lambda_min, in closed form: a "DC" slot of rate exactly 1
    c_inf    the mass above lambda_max (it only matters at j = 0): a stateless skip term

    w_j(alpha) ~= c_0 + sum_s c_s e^(-xi_s j) + c_inf [j = 0]

exact at alpha = 1 (c_0 = 1, the rest 0: sin(pi alpha) is computed as sin(pi (1 - alpha))). Max abs error over
j in [0, 1000]: at most 1.05e-3 at S = 15 and 1.4e-5 at S = 30 (tests/unit/test_soe.py). The pure power law
k_j = j^(alpha - 1) / Gamma(alpha), j >= 1 (the paper's "Power-Law" baseline) uses the same nodes with
rho = sin(pi alpha) / pi lambda^-alpha.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .dispatch import use_triton

KERNELS = ("gl", "power")  # the alpha-dependent kernels (VORT's "exp" and "mixture" baselines have learned rates)


def gl_weights(alpha: torch.Tensor, lags: torch.Tensor) -> torch.Tensor:
    """The exact Grünwald-Letnikov weights w_j(alpha) through lgamma, elementwise (alpha and lags broadcast)."""
    lags = lags.to(alpha.dtype)
    return torch.exp(torch.lgamma(lags + alpha) - torch.lgamma(alpha) - torch.lgamma(lags + 1))


def power_weights(alpha: torch.Tensor, lags: torch.Tensor) -> torch.Tensor:
    """The pure power law j^(alpha - 1) / Gamma(alpha) for lags j >= 1 (0 at j = 0, where it is undefined),
    elementwise (alpha and lags broadcast)."""
    lags = lags.to(alpha.dtype)
    safe = lags.clamp(min=1)
    return torch.where(lags >= 1, torch.exp((alpha - 1) * torch.log(safe) - torch.lgamma(alpha)),
                       torch.zeros((), dtype=alpha.dtype, device=alpha.device))


# Both are memoised by hand and marked constant for torch.compile: a compiled decode step (config.compile_decode)
# takes the nodes as constants, where it could trace neither numpy's leggauss nor through an lru_cache
_nodes, _tensors = {}, {}


@torch.compiler.assume_constant_result
def soe_nodes(num_terms: int, horizon: int, eps: float) -> tuple:
    """(xi, Omega, lambda_min, lambda_max) in float64: the alpha-independent quadrature of the Laplace integral."""
    key = (num_terms, horizon, eps)
    if key not in _nodes:
        lambda_min, lambda_max = eps / (2 * horizon), 2 * math.log(2 * horizon / eps)
        span = math.log(lambda_max / lambda_min)
        x, varpi = np.polynomial.legendre.leggauss(num_terms)
        xi = lambda_min * np.exp(span / 2 * (x + 1))
        _nodes[key] = tuple(xi.tolist()), tuple((span / 2 * varpi * xi).tolist()), lambda_min, lambda_max
    return _nodes[key]


@torch.compiler.assume_constant_result
def _node_tensors(num_terms: int, horizon: int, eps: float, dtype, device) -> tuple:
    """(-xi then 0; log(Omega / pi); the slot weights' exponents xi + log(1 - e^-xi) (gl) and log xi (power)) as
    tensors, computed in float64 once per dtype and device (a decode step reads them per layer)."""
    key = (num_terms, horizon, eps, dtype, device)
    if key not in _tensors:
        xi, omega, _, _ = soe_nodes(num_terms, horizon, eps)
        xi = torch.tensor(xi, dtype=torch.float64)
        tensors = (torch.cat([-xi, xi.new_zeros(1)]), torch.log(torch.tensor(omega, dtype=torch.float64) / math.pi),
                   xi + torch.log(-torch.expm1(-xi)), torch.log(xi))
        _tensors[key] = tuple(t.to(dtype=dtype, device=device) for t in tensors)
    return _tensors[key]


def _check(num_terms: int, horizon: int, eps: float) -> None:
    if not (isinstance(num_terms, int) and not isinstance(num_terms, bool) and num_terms >= 1):
        raise ValueError(f"soe: num_terms must be a positive integer, got {num_terms!r}")
    if not (isinstance(horizon, int) and horizon >= 2):
        raise ValueError(f"soe: horizon must be an integer >= 2 (the longest lag the SOE is built for), got "
                         f"{horizon!r}")
    if not 0 < eps < 1:
        raise ValueError(f"soe: eps must be in (0, 1), got {eps!r}")


def soe_log_rates(num_terms: int, horizon: int, eps: float = 1e-3, dtype=torch.float64, device=None) -> torch.Tensor:
    """log of the S + 1 slot rates, -xi_s then 0 (the DC slot): (S + 1,). Decays are computed as exp(log_rate * j)
    so the slowest rates (1 - 5.6e-7 at T = 1000) never round to 1 in a stored power."""
    _check(num_terms, horizon, eps)
    return _node_tensors(num_terms, horizon, float(eps), dtype, torch.device(device or "cpu"))[0].clone()


def soe_weights(alpha: torch.Tensor, num_terms: int, horizon: int, eps: float = 1e-3, kernel: str = "gl"):
    """The alpha-dependent slot weights, differentiable in alpha: ``weights`` alpha.shape + (S + 1,) (the last is
    the DC slot) and ``skip_weight`` alpha.shape (the lag-0 term; 0 for the power law, undefined at j = 0).

    Slot s: Omega_s rho(xi_s) = sin(pi alpha) exp(log(Omega_s / pi) - alpha c_s), c_s = xi_s + log(1 - e^-xi_s)
    (gl) or log xi_s (power), constants of the nodes. The DC slot, the mass below lambda_min, is the same for both:
    lambda_min^(1 - alpha) / (Gamma(alpha) Gamma(2 - alpha)) = sinc(1 - alpha) lambda_min^(1 - alpha) (reflection:
    Gamma(alpha) Gamma(1 - alpha) = pi / sin(pi alpha)). The skip (gl), the mass above lambda_max at j = 0:
    sin(pi alpha) / (pi alpha) e^(-alpha lambda_max). sin(pi alpha) is computed as sin(pi (1 - alpha)): exactly 0
    at alpha = 1. Written in as few elementwise ops as the math allows: VORT computes it for every token."""
    _check(num_terms, horizon, eps)
    if kernel not in KERNELS:
        raise ValueError(f"soe: kernel must be one of {KERNELS}, got {kernel!r}")
    _, _, lambda_min, lambda_max = soe_nodes(num_terms, horizon, float(eps))
    _, log_scale, gl_exponent, power_exponent = _node_tensors(num_terms, horizon, float(eps), alpha.dtype,
                                                              alpha.device)
    below = 1 - alpha
    sin_pi_alpha = torch.sin(math.pi * below)
    exponent = gl_exponent if kernel == "gl" else power_exponent
    slots = sin_pi_alpha[..., None] * torch.exp(torch.addcmul(log_scale, alpha[..., None], exponent, value=-1))
    dc = torch.sinc(below) * torch.exp(below * math.log(lambda_min))
    skip = sin_pi_alpha * torch.exp(alpha * -lambda_max) / (math.pi * alpha) if kernel == "gl" \
        else torch.zeros_like(alpha)
    return torch.cat([slots, dc[..., None]], dim=-1), skip


def write_weights(alpha: torch.Tensor, keep: torch.Tensor | None, lag: int, num_terms: int, horizon: int,
                  eps: float = 1e-3, kernel: str = "gl", backend: str = "auto"):
    """VORT's per-token write weights: ``soe_weights`` times ``keep`` (B, T) (0: a padding token, which writes
    nothing; None: all 1) and, per slot, the decay over a delay of ``lag`` steps, e^(l_s lag) (a token written late
    was already that old). alpha (B, G, T) -> (weights (B, G, T, S + 1), skip_weight (B, G, T), times keep); a
    token with keep 0 has weights and gradient exactly 0.

    One Triton launch forward and one backward where kernels/dispatch.py takes Triton (kernels/soe_triton.py), for
    fp32 and fp64; else this math, which is the kernel's reference."""
    _check(num_terms, horizon, eps)
    if kernel not in KERNELS:
        raise ValueError(f"soe: kernel must be one of {KERNELS}, got {kernel!r}")
    if alpha.dim() != 3 or (keep is not None and tuple(keep.shape) != (alpha.shape[0], alpha.shape[2])):
        raise ValueError(f"write_weights: alpha must be (B, G, T) and keep (B, T) or None; got {tuple(alpha.shape)} "
                         f"and {None if keep is None else tuple(keep.shape)}")
    if use_triton("VORT write weights", alpha.device, backend,
                  check=lambda: None if alpha.dtype in (torch.float32, torch.float64)
                  else f"{alpha.dtype} orders (the kernel takes fp32 or fp64)"):
        from .soe_triton import write_weights_triton

        _, _, lambda_min, lambda_max = soe_nodes(num_terms, horizon, float(eps))
        log_rates, log_scale, gl_exponent, power_exponent = _node_tensors(num_terms, horizon, float(eps),
                                                                          alpha.dtype, alpha.device)
        return write_weights_triton(alpha, keep, lag, log_rates, log_scale,
                                    gl_exponent if kernel == "gl" else power_exponent, lambda_min, lambda_max,
                                    gl=kernel == "gl")
    if keep is not None:  # a token that writes nothing (padding may carry alpha = 0: 1 / alpha) at alpha = 1
        keep = keep[:, None].to(alpha.dtype)
        alpha = torch.where(keep != 0, alpha, 1)
    weights, skip = soe_weights(alpha, num_terms, horizon, eps, kernel)
    if keep is not None:
        weights, skip = weights * keep[..., None], skip * keep
    if lag:
        weights = weights * torch.exp(soe_log_rates(num_terms, horizon, eps, alpha.dtype, alpha.device) * lag)
    return weights, skip


def soe_kernel(alpha: torch.Tensor, num_terms: int, horizon: int, eps: float = 1e-3, kernel: str = "gl"):
    """(rates (S + 1,), weights alpha.shape + (S + 1,), skip_weight alpha.shape) such that

        w_j(alpha) ~= sum_s weights[..., s] * rates[s] ** j + skip_weight * [j == 0]

    the last rate being the DC slot, exactly 1. ``kernel``: "gl" (Grünwald-Letnikov, default) or "power"
    (j^(alpha - 1) / Gamma(alpha) for j >= 1)."""
    if not isinstance(alpha, torch.Tensor):  # a Python number: float64, as the weights are computed
        alpha = torch.tensor(alpha, dtype=torch.float64)
    if not alpha.is_floating_point():
        alpha = alpha.to(torch.get_default_dtype())
    if not bool(((alpha > 0) & (alpha <= 1)).all()):  # NaN fails too
        raise ValueError(f"soe_kernel: alpha must lie in (0, 1], got values in [{alpha.min().item():.4g}, "
                         f"{alpha.max().item():.4g}]")
    weights, skip = soe_weights(alpha, num_terms, horizon, eps, kernel)
    rates = torch.exp(soe_log_rates(num_terms, horizon, eps, dtype=alpha.dtype, device=alpha.device))
    return rates, weights, skip


def soe_evaluate(log_rates: torch.Tensor, weights: torch.Tensor, skip: torch.Tensor, lags: torch.Tensor):
    """The approximated kernel at ``lags``: (..., S + 1), (...) -> (..., J)."""
    decays = torch.exp(log_rates[:, None] * lags.to(log_rates.dtype)[None, :])  # (S + 1, J)
    return weights @ decays.to(weights.dtype) + skip[..., None] * (lags == 0).to(weights.dtype)
