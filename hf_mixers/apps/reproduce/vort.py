"""The VORT paper's measurable claims: the sum-of-exponentials accuracy (Theorem 3.1, Fig. 4b)."""

from __future__ import annotations

import math

import torch

from ...kernels.soe import gl_weights, soe_nodes, soe_evaluate, soe_kernel
from . import claim

ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
TERMS = (10, 15, 20, 30)


@claim("vort-soe", "VORT (Theorem 3.1, Fig. 4b)",
       "S = O(log(T / eps)) exponentials approximate the Grünwald-Letnikov power law to eps; at alpha = 0.5, T = 1000 "
       "the error is below 4e-3 with S = 15")
def vort_soe(out_dir: str, scale: str) -> dict:
    """Max |w_hat_j - w_j| over j in [0, T] for the corrected construction (kernels/soe.py) and for the paper's
    printed one (its density with the extra e^-lambda, no Jacobian, no lower-tail slot), against lgamma weights."""
    horizons = (1000,) if scale == "cpu" else (1000, 10_000, 100_000)
    rows = []
    for horizon in horizons:
        lags = torch.arange(horizon + 1)
        for alpha in ALPHAS:
            a = torch.tensor(alpha, dtype=torch.float64)
            exact = gl_weights(a, lags)
            row = {"T": horizon, "alpha": alpha}
            for terms in TERMS:
                rates, weights, skip = soe_kernel(a, terms, horizon)
                row[f"S={terms}"] = (soe_evaluate(torch.log(rates), weights, skip, lags) - exact).abs().max().item()
            row["printed, S=30"] = _printed_error(alpha, 30, horizon, exact, lags)
            rows.append(row)
    at_15 = next(r["S=15"] for r in rows if r["T"] == 1000 and r["alpha"] == 0.5)
    worst_30 = max(r["S=30"] for r in rows if r["T"] == 1000)
    exact_at_one = all(r["S=10"] == 0 for r in rows if r["alpha"] == 1.0)
    return {"paper_value": "error < 4e-3 at S = 15 (alpha = 0.5, T = 1000); geometric convergence in S",
            "ours": f"{at_15:.2e} at S = 15; worst over alpha at S = 30: {worst_30:.2e}; exact at alpha = 1: "
                    f"{exact_at_one}; the printed construction: errors up to "
                    f"{max(r['printed, S=30'] for r in rows):.3g}",
            "holds": at_15 < 4e-3 and worst_30 < 2e-5 and exact_at_one,
            "table": rows,
            "notes": ["the corrected construction: the density without the spurious e^-lambda, the Jacobian of the log "
                      "substitution in the weights, a DC slot (rate 1) for the mass below lambda_min and a skip term "
                      "for the mass above lambda_max",
                      "the paper's Fig. 4b also states L ~ 6.9 and a rate e^(-pi^2 S / L); with its own constants "
                      "L = 17.9 at T = 1000, eps = 1e-3, so those two figures are not reproducible and not tested"]}


def _printed_error(alpha: float, terms: int, horizon: int, exact, lags) -> float:
    """The paper's printed SOE: c_s = omega_s rho_printed(xi_s) with the Gauss-Legendre weights omega_s in log lambda
    (no Jacobian xi_s), rho_printed = rho e^-lambda (the spurious factor), and no slot for either tail."""
    if alpha >= 1:
        return float(exact.abs().max())  # rho = 0 at alpha = 1: every weight vanishes, w_j = 1 is lost entirely
    xi, omega, _, _ = soe_nodes(terms, horizon, 1e-3)
    xi, omega = torch.tensor(xi, dtype=torch.float64), torch.tensor(omega, dtype=torch.float64) / torch.tensor(
        xi, dtype=torch.float64)  # Omega_s without its xi_s factor: the printed weights
    density = math.sin(math.pi * alpha) / math.pi * torch.exp(-alpha * xi) * (-torch.expm1(-xi)) ** -alpha \
        * torch.exp(-xi)
    approx = (omega * density) @ torch.exp(-xi[:, None] * lags.to(torch.float64)[None])
    return (approx - exact).abs().max().item()
