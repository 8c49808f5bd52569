"""The VORT paper's measurable claims: the sum-of-exponentials accuracy (Theorem 3.1, Fig. 4b)."""

from __future__ import annotations

import math

import torch

from ...kernels.soe import gl_weights, soe_nodes, soe_evaluate, soe_kernel
from . import claim
from .training import scored_accuracy, tiny_model, train

ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
TERMS = (10, 15, 20, 30)


@claim("vort-soe", "VORT (Theorem 3.1, Fig. 4b)",
       "S = O(log(T / eps)) exponentials approximate the Grünwald-Letnikov power law to eps; at alpha = 0.5, T = 1000 "
       "the error is below 4e-3 with S = 15")
def vort_soe(out_dir: str, scale: str) -> dict:
    """Max |w_hat_j - w_j| over j in [0, T] for the corrected construction (kernels/soe.py) and for the paper's
    printed one (its density with the extra e^-lambda, no Jacobian, no lower-tail slot), against lgamma weights."""
    horizons = (1000,) if scale != "paper" else (1000, 10_000, 100_000)
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


ZIPF_KERNELS = {"power-law": {"vort_kernel": "power", "vort_include_current": False},
                "exponential": {"vort_kernel": "exp"},
                "mixture-5": {"vort_kernel": "mixture"}}
# sequence length, keys, classes, queries, filler ids, training steps, batch, test sequences per beta (smoke: the
# same code path in seconds, for the tests)
ZIPF_SCALES = {"smoke": dict(length=256, keys=8, classes=4, queries=4, filler=16, steps=3, batch=2, tests=2),
               "cpu": dict(length=2048, keys=32, classes=4, queries=16, filler=64, steps=300, batch=8, tests=128),
               "paper": dict(length=10_000, keys=512, classes=16, queries=64, filler=256, steps=12_500, batch=8,
                             tests=1000)}


@claim("vort-zipf", "VORT (§6, Table 1: Zipf-lag retrieval)",
       "with the same keyed accumulator, power-law retention keeps retrieval accuracy at long lags where an "
       "exponential kernel loses it (paper: 79.4% vs 52.3% beyond 1000 tokens; about equal below 100)")
def vort_zipf(out_dir: str, scale: str) -> dict:
    """One-layer models (width 64, 2 heads, Hedgehog features, no window) that differ only in the lag kernel, trained
    on Zipf-lag retrieval (beta cycling through 1, 1.5, 2) and scored by lag bucket on fresh sequences."""
    from ...tasks.vort import ZIPF_BETAS, lag_buckets, zipf_lag_retrieval, zipf_vocab_size

    size = ZIPF_SCALES[scale]
    task = dict(length=size["length"], classes=size["classes"], keys=size["keys"], queries=size["queries"],
                filler=size["filler"])
    rows = []
    for name, options in ZIPF_KERNELS.items():
        model = _zipf_model(zipf_vocab_size(size["keys"], size["classes"], size["filler"]), size["length"], options)

        def batch(step):
            tokens, targets, _ = zipf_lag_retrieval(size["batch"], beta=ZIPF_BETAS[step % 3], seed=step, **task)
            return tokens, targets

        train(model, batch, size["steps"], lr=3e-3, cosine=False, weight_decay=0.01, clip=None,
              desc=f"vort-zipf {name}")
        hits, counts = torch.zeros(3), torch.zeros(3)
        for beta in ZIPF_BETAS:
            tokens, targets, lags = zipf_lag_retrieval(size["tests"], beta=beta, seed=10_000 + int(10 * beta), **task)
            accuracy, scored = scored_accuracy(model, tokens, targets, lag_buckets(lags).clamp(min=0), 3)
            hits += torch.tensor(accuracy) * torch.tensor(scored)
            counts += torch.tensor(scored)
        accuracy = (hits / counts.clamp(min=1)).tolist()
        rows.append({"kernel": name, "<= 100": accuracy[0], "100-1000": accuracy[1], "> 1000": accuracy[2],
                     "queries > 1000": int(counts[2])})
    power, exponential = rows[0], rows[1]
    return {"paper_value": "accuracy <= 100 / 100-1000 / > 1000: power-law 91.3 / 87.6 / 79.4, exponential 90.8 / "
                           "81.2 / 52.3, mixture-5 91.0 / 83.7 / 61.8",
            "ours": "; ".join(f"{r['kernel']} {100 * r['<= 100']:.1f} / {100 * r['100-1000']:.1f} / "
                              f"{100 * r['> 1000']:.1f}" for r in rows),
            "holds": None if scale == "smoke" else power["> 1000"] > exponential["> 1000"],
            "table": rows,
            "notes": [f"scale {scale}: {size}; chance is {100 / size['classes']:.0f}%",
                      "the task's token layout, queries per sequence and the collision rule are our reconstruction "
                      "(hf_mixers/tasks/vort.py); power-law: alpha = 0.7 fixed, strict causality, as the paper's "
                      "baseline; exponential: one learned rate per head (started at 1e-2); mixture: 5 learned",
                      "holds compares the long-lag bucket only, the paper's headline"]}


def _zipf_model(vocab: int, length: int, options: dict):
    return tiny_model("vort", vocab, length, width=64, layers=1, heads=2, vort_window=0, vort_feature_map="hedgehog",
                      vort_alpha_mode="fixed", vort_alpha_fixed=0.7, vort_soe_horizon=length, **options)
