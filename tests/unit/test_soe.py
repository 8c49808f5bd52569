"""The power-law retention kernel of VORT (Mlaiki, "VORT: Adaptive Power-Law Memory for NLP Transformers", arXiv
2605.08966) and its sum-of-exponentials approximation (hf_mixers.kernels.soe), in fp64.

The paper's printed construction has errata (an extra e^-lambda in the Laplace density, no Jacobian in the weights, the
lower tail dropped, a misprinted Prop. 4.4 identity); the expected numbers below come from an independent float64
re-derivation of the corrected construction: its accuracy tables, golden nodes and weights, and numerical checks of the
paper's Theorem 4.1, Propositions 4.2 and 4.4 and Lemma 4.5.
"""

import math

import numpy as np
import pytest
import torch

from hf_mixers.kernels.soe import gl_weights, power_weights, soe_evaluate, soe_kernel, soe_log_rates, soe_weights

F64 = torch.float64
EPS = 1e-3  # the SOE tolerance every table below is built with


def f64(values):
    return torch.as_tensor(values, dtype=F64)


def limits(horizon, eps=EPS):
    """(lambda_min, lambda_max) of the corrected construction."""
    return eps / (2 * horizon), 2 * math.log(2 * horizon / eps)


def density(alpha, lam):
    """The corrected Laplace density of the GL weights: sin(pi a) / pi * e^(-a lam) (1 - e^-lam)^(-a)."""
    return math.sin(math.pi * alpha) / math.pi * torch.exp(-alpha * lam - alpha * torch.log(-torch.expm1(-lam)))


def printed_density(alpha, lam):
    """The paper's eq. 5 density: the corrected one times a spurious e^-lam."""
    return density(alpha, lam) * torch.exp(-lam)


def integrate_log(integrand, u_lo, u_hi, panel=0.5, order=24):
    """int integrand(lam) d lam over lam in [e^u_lo, e^u_hi]: composite Gauss-Legendre in u = log lam. The integrands
    here are analytic in a strip around the real u axis, so this converges to rounding."""
    panels = max(1, math.ceil((u_hi - u_lo) / panel))
    x, w = np.polynomial.legendre.leggauss(order)
    edges = np.linspace(u_lo, u_hi, panels + 1)
    half = (edges[1:] - edges[:-1])[:, None] / 2
    u = f64((edges[:-1, None] + half * (x + 1)).ravel())
    weights = f64((half * w).ravel())
    lam = torch.exp(u)
    return float((integrand(lam) * lam * weights).sum())


def laplace_transform(dens, alpha, lag):
    """int_0^inf dens(alpha, lam) e^(-lam lag) d lam; the lam^-alpha edge at 0 is cut where its mass is below 1e-17."""
    u_lo, u_hi = -40 / (1 - alpha), math.log(80 / alpha)
    return integrate_log(lambda lam: dens(alpha, lam) * torch.exp(-lam * lag), u_lo, u_hi)


def approximate(alpha, num_terms, horizon, lags, kernel="gl"):
    """The SOE kernel at ``lags`` for every alpha (alpha.shape + (J,))."""
    _, weights, skip = soe_kernel(alpha, num_terms, horizon, EPS, kernel)
    return soe_evaluate(soe_log_rates(num_terms, horizon, EPS), weights, skip, lags)


def soe_errors(alphas, num_terms, horizon, kernel="gl"):
    """(max abs error over j in [0, T], max relative error over j in [1, T]) per alpha; the power law is undefined at
    j = 0, so only its relative error is meaningful."""
    alpha, lags = f64(alphas), torch.arange(horizon + 1)
    exact = (gl_weights if kernel == "gl" else power_weights)(alpha[:, None], lags)
    diff = (approximate(alpha, num_terms, horizon, lags, kernel) - exact).abs()
    return diff.max(-1).values, (diff[:, 1:] / exact[:, 1:]).max(-1).values


# --- the Laplace density (corrected vs printed) ------------------------------------------------------------------

# (alpha, j, w_j, w_{j+1}): what the corrected and the printed density integrate to against e^(-lam j)
DENSITY_TABLE = [(0.3, 0, 1.000000, 0.300000), (0.3, 5, 0.106070, 0.093695),
                 (0.7, 0, 1.000000, 0.700000), (0.7, 5, 0.465617, 0.442336)]


@pytest.mark.parametrize("alpha, lag, w_j, w_next", DENSITY_TABLE)
def test_corrected_density_integrates_to_the_gl_weights(alpha, lag, w_j, w_next):
    exact = gl_weights(f64(alpha), f64([lag, lag + 1])).tolist()
    corrected = laplace_transform(density, alpha, lag)
    printed = laplace_transform(printed_density, alpha, lag)
    assert corrected == pytest.approx(exact[0], rel=1e-12)
    assert corrected == pytest.approx(w_j, abs=5e-7)
    # regression guard for erratum 1: the printed density is off by one lag
    assert printed == pytest.approx(exact[1], rel=1e-12)
    assert printed == pytest.approx(w_next, abs=5e-7)
    assert abs(printed - exact[0]) > 1e-2


# --- the tails: the DC slot (mass below lambda_min) and the skip term (mass above lambda_max) ---------------------

C0_TABLE = {0.1: 2.3e-7, 0.3: 1.4e-5, 0.5: 4.5e-4, 0.7: 1.1e-2, 0.9: 0.23, 0.99: 0.86}  # T = 1000
C_INF_TABLE = {0.05: 0.23, 0.1: 0.054}  # T = 1000


def test_dc_and_skip_weights_match_the_tabulated_tails():
    alpha = f64(list(C0_TABLE))
    _, weights, _ = soe_kernel(alpha, 15, 1000)
    torch.testing.assert_close(weights[:, -1], f64(list(C0_TABLE.values())), rtol=0.05, atol=0)
    _, _, skip = soe_kernel(f64(list(C_INF_TABLE)), 15, 1000)
    torch.testing.assert_close(skip, f64(list(C_INF_TABLE.values())), rtol=0.02, atol=0)


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("horizon", [1000, 100000])
def test_dc_and_skip_weights_are_the_density_tails(alpha, horizon):
    """c_0 = the density's mass below lambda_min (closed form good to 4e-8), c_inf = its mass above lambda_max."""
    lambda_min, lambda_max = limits(horizon)
    _, weights, skip = soe_kernel(f64(alpha), 15, horizon)
    below = integrate_log(lambda lam: density(alpha, lam), math.log(lambda_min) - 40 / (1 - alpha),
                          math.log(lambda_min))
    above = integrate_log(lambda lam: density(alpha, lam), math.log(lambda_max), math.log(lambda_max + 80 / alpha))
    assert weights[-1].item() == pytest.approx(below, rel=1e-7)
    assert skip.item() == pytest.approx(above, rel=1e-12)


# --- accuracy of the SOE -------------------------------------------------------------------------------------------

# (T, alpha): ((max abs error over j in [0, T], max rel error over j in [1, T]) for S = 10, 15, 20, 30), eps = 1e-3
SOE_TABLE = {
    (1000, 0.1): ((3.4e-3, 1.7e-1), (2.5e-4, 3.4e-2), (2.5e-5, 6.6e-3), (3.3e-7, 2.2e-4)),
    (1000, 0.3): ((9.4e-3, 1.2e-1), (7.2e-4, 2.2e-2), (7.6e-5, 4.0e-3), (1.1e-6, 1.2e-4)),
    (1000, 0.5): ((9.2e-3, 7.2e-2), (9.8e-4, 1.2e-2), (1.1e-4, 2.2e-3), (2.1e-6, 6.7e-5)),
    (1000, 0.7): ((8.7e-3, 3.6e-2), (1.0e-3, 5.8e-3), (1.4e-4, 9.6e-4), (3.8e-6, 3.9e-5)),
    (1000, 0.9): ((5.2e-3, 9.4e-3), (7.3e-4, 1.4e-3), (1.1e-4, 2.4e-4), (1.3e-5, 2.8e-5)),
    (1000, 0.99): ((7.9e-4, 8.4e-4), (1.1e-4, 1.2e-4), (2.0e-5, 2.2e-5), (4.6e-6, 5.0e-6)),
    (10000, 0.5): ((1.6e-2, 1.1e-1), (1.8e-3, 2.4e-2), (2.5e-4, 5.1e-3), (6.5e-6, 2.3e-4)),
    (10000, 0.9): ((8.0e-3, 1.6e-2), (1.4e-3, 2.9e-3), (2.5e-4, 5.5e-4), (1.4e-5, 3.8e-5)),
    (100000, 0.1): ((9.9e-3, 3.4e-1), (1.0e-3, 9.9e-2), (1.2e-4, 2.8e-2), (2.7e-6, 2.1e-3)),
    (100000, 0.5): ((2.2e-2, 1.6e-1), (2.9e-3, 4.0e-2), (4.6e-4, 1.0e-2), (1.6e-5, 6.4e-4)),
    (100000, 0.9): ((1.1e-2, 2.3e-2), (2.2e-3, 5.0e-3), (4.8e-4, 1.1e-3), (2.4e-5, 7.1e-5)),
}
TERMS = (10, 15, 20, 30)


@pytest.mark.parametrize("horizon", [1000, 10000, 100000])
@pytest.mark.parametrize("num_terms", TERMS)
def test_soe_error_within_the_table(horizon, num_terms):
    alphas = [alpha for (T, alpha) in SOE_TABLE if T == horizon]
    expected = f64([SOE_TABLE[horizon, alpha][TERMS.index(num_terms)] for alpha in alphas])
    abs_error, rel_error = soe_errors(alphas, num_terms, horizon)
    assert (abs_error <= 1.1 * expected[:, 0]).all(), (alphas, abs_error, expected[:, 0])
    assert (rel_error <= 1.1 * expected[:, 1]).all(), (alphas, rel_error, expected[:, 1])


@pytest.mark.parametrize("num_terms, bound", [(15, 1.1e-3), (30, 2e-5)])
def test_soe_error_bound_over_a_fine_alpha_grid(num_terms, bound):
    alphas = torch.linspace(0.1, 1, 46, dtype=F64)
    abs_error, _ = soe_errors(alphas, num_terms, 1000)
    assert (abs_error <= bound).all(), alphas[abs_error > bound]


@pytest.mark.parametrize("num_terms, horizon", [(1, 2), (10, 1000), (15, 1000), (30, 10000)])
def test_alpha_one_is_exact(num_terms, horizon):
    """At alpha = 1 the density vanishes (sin(pi alpha) taken as sin(pi (1 - alpha))), all the mass is in the DC
    slot, and the running sum w_j = 1 is reproduced bit for bit, also inside a batch of other orders."""
    alpha = f64([0.5, 1.0, 0.25])
    rates, weights, skip = soe_kernel(alpha, num_terms, horizon)
    assert rates[-1].item() == 1.0
    assert torch.equal(weights[1], f64([0.0] * num_terms + [1.0]))
    assert skip[1].item() == 0.0
    lags = torch.arange(horizon + 1)
    assert torch.equal(approximate(alpha, num_terms, horizon, lags)[1], torch.ones(horizon + 1, dtype=F64))
    assert torch.equal(gl_weights(f64(1.0), lags), torch.ones(horizon + 1, dtype=F64))


# --- golden values: S = 15, T = 1000, eps = 1e-3, alpha = 0.5 ---------------------------------------------------

GOLDEN_L = 17.8765505
GOLDEN_XI = [5.566487e-07, 8.759209e-07, 1.941817e-06, 5.871341e-06, 2.314136e-05, 1.124035e-04, 6.306808e-04,
             3.809023e-03, 2.300476e-02, 1.290766e-01, 6.269578e-01, 2.471098e+00, 7.471691e+00, 1.656389e+01,
             2.606430e+01]
GOLDEN_RATES = [0.999999443, 0.999999124, 0.999998058, 0.999994129, 0.999976859, 0.999887603, 0.999369518,
                0.996198222, 0.977257836, 0.878906641, 0.534214527, 0.084492039, 0.000568965, 6.4e-08, 4.8e-12]
GOLDEN_OMEGA = [1.530121e-07, 5.509114e-07, 1.859908e-06, 7.324621e-06, 3.439177e-05, 1.870347e-04, 1.118598e-03,
                6.896999e-03, 4.080205e-02, 2.147781e-01, 9.317595e-01, 3.082747e+00, 7.156525e+00, 1.041788e+01,
                7.164579e+00]
GOLDEN_C = [6.528077e-05, 1.873697e-04, 4.248517e-04, 9.622015e-04, 2.275661e-03, 5.615264e-03, 1.417590e-02,
            3.553774e-02, 8.513747e-02, 1.841837e-01, 3.176281e-01, 2.981020e-01, 5.435240e-02, 8.391242e-04,
            4.991718e-06]
GOLDEN_C0, GOLDEN_C_INF, GOLDEN_TOTAL = 4.501582e-4, 3.183099e-7, 0.99994248
GOLDEN_LAGS = [0, 1, 10, 100, 1000]
GOLDEN_APPROX = [0.9999425, 0.4995309, 0.1771744, 0.05603471, 0.01765778]
GOLDEN_EXACT = [1.0, 0.5, 0.1761971, 0.05634848, 0.01783901]
SIX_DIGITS = dict(rtol=1e-6, atol=0)  # the printed tables carry 7 significant digits


def test_golden_nodes():
    lambda_min, lambda_max = limits(1000)
    assert math.log(lambda_max / lambda_min) == pytest.approx(GOLDEN_L, abs=1e-7)
    log_rates = soe_log_rates(15, 1000)
    xi = -log_rates[:-1]
    assert log_rates[-1].item() == 0.0  # the DC slot
    torch.testing.assert_close(xi, f64(GOLDEN_XI), **SIX_DIGITS)
    assert lambda_min < xi.min().item() and xi.max().item() < lambda_max
    rates, _, _ = soe_kernel(f64(0.5), 15, 1000)
    torch.testing.assert_close(rates, torch.exp(log_rates), rtol=0, atol=0)
    torch.testing.assert_close(rates[:13], f64(GOLDEN_RATES[:13]), rtol=0, atol=6e-10)
    torch.testing.assert_close(rates[13:15], f64(GOLDEN_RATES[13:]), rtol=1e-2, atol=0)


def test_golden_weights():
    alpha = 0.5
    _, weights, skip = soe_kernel(f64(alpha), 15, 1000)
    torch.testing.assert_close(weights[:-1], f64(GOLDEN_C), **SIX_DIGITS)
    assert weights[-1].item() == pytest.approx(GOLDEN_C0, rel=1e-6)
    assert skip.item() == pytest.approx(GOLDEN_C_INF, rel=1e-6)
    assert (weights.sum() + skip).item() == pytest.approx(GOLDEN_TOTAL, rel=1e-8)
    # Omega_s = (L / 2) varpi_s xi_s, the Gauss-Legendre weight with the Jacobian of lam = lam_min e^u
    xi = -soe_log_rates(15, 1000)[:-1]
    omega = weights[:-1] / density(alpha, xi)
    torch.testing.assert_close(omega, f64(GOLDEN_OMEGA), **SIX_DIGITS)
    _, varpi = np.polynomial.legendre.leggauss(15)
    torch.testing.assert_close(omega, GOLDEN_L / 2 * f64(varpi) * xi, rtol=1e-7, atol=0)


def test_golden_kernel_values():
    lags = torch.tensor(GOLDEN_LAGS)
    torch.testing.assert_close(approximate(f64(0.5), 15, 1000, lags), f64(GOLDEN_APPROX), **SIX_DIGITS)
    torch.testing.assert_close(gl_weights(f64(0.5), lags), f64(GOLDEN_EXACT), **SIX_DIGITS)


def test_soe_kernel_contract():
    """Shapes, positivity, alpha-independent rates, and w_hat_j = sum_s weights_s rates_s^j + skip [j == 0]."""
    alpha = f64([[0.1, 0.45, 0.8], [0.95, 0.999, 0.3]])
    rates, weights, skip = soe_kernel(alpha, 12, 500)
    assert rates.shape == (13,) and weights.shape == (2, 3, 13) and skip.shape == (2, 3)
    assert rates.dtype == weights.dtype == skip.dtype == F64
    assert ((rates > 0) & (rates <= 1)).all() and (weights > 0).all() and (skip > 0).all()
    torch.testing.assert_close(weights.sum(-1) + skip, torch.ones_like(alpha), rtol=0, atol=1e-2)  # w_hat_0 ~ w_0
    for other_alpha, kernel in [(f64(0.2), "gl"), (f64(0.7), "power")]:
        assert torch.equal(soe_kernel(other_alpha, 12, 500, kernel=kernel)[0], rates)
    lags = torch.arange(501)
    direct = (weights[..., None] * rates[:, None] ** lags.to(F64)).sum(-2) + skip[..., None] * (lags == 0)
    evaluated = soe_evaluate(torch.log(rates), weights, skip, lags)
    assert evaluated.shape == (2, 3, 501)
    torch.testing.assert_close(evaluated, direct, rtol=1e-12, atol=1e-15)
    _, weights_pw, skip_pw = soe_kernel(alpha, 12, 500, kernel="power")
    torch.testing.assert_close(soe_weights(alpha, 12, 500, kernel="power")[0], weights_pw, rtol=0, atol=0)
    assert torch.equal(skip_pw, torch.zeros_like(alpha))


# --- gradients wrt alpha -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["gl", "power"])
def test_weights_gradcheck(kernel):
    """Autograd against central differences, alpha = 1 included (soe_weights is analytic across it)."""
    alpha = f64([0.12, 0.5, 0.83, 0.999, 1.0]).requires_grad_()
    assert torch.autograd.gradcheck(lambda a: soe_weights(a, 15, 1000, kernel=kernel), (alpha,), eps=1e-6,
                                    atol=1e-9, rtol=1e-6)


def test_weight_gradients_closed_form():
    """d c_s / d alpha = c_s [pi cot(pi a) - xi_s - log(1 - e^-xi_s)]; likewise the DC and skip weights' log
    derivatives -log lam_min - psi(a) + psi(2 - a) and pi cot(pi a) - 1 / a - lam_max."""
    lambda_min, lambda_max = limits(1000)
    alpha = f64([0.12, 0.5, 0.83, 0.97]).requires_grad_()
    weights, skip = soe_weights(alpha, 15, 1000)
    grads = torch.stack([torch.autograd.grad(weights[:, s].sum(), alpha, retain_graph=True)[0]
                         for s in range(16)], -1)
    skip_grad, = torch.autograd.grad(skip.sum(), alpha)
    a, c, xi = alpha.detach()[:, None], weights.detach(), -soe_log_rates(15, 1000)[:-1]
    cot = math.pi / torch.tan(math.pi * a)
    torch.testing.assert_close(grads[:, :-1], c[:, :-1] * (cot - xi - torch.log(-torch.expm1(-xi))),
                               rtol=1e-10, atol=1e-14)
    dc = -math.log(lambda_min) - torch.special.digamma(a) + torch.special.digamma(2 - a)
    torch.testing.assert_close(grads[:, -1:], c[:, -1:] * dc, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(skip_grad, skip.detach() * (cot - 1 / a - lambda_max)[:, 0], rtol=1e-10, atol=1e-16)
    # pi cot(pi a) = psi(1 - a) - psi(a)
    torch.testing.assert_close(cot, torch.special.digamma(1 - a) - torch.special.digamma(a), rtol=1e-12, atol=1e-12)


# --- the pure power law j^(alpha - 1) / Gamma(alpha) ---------------------------------------------------------------

POWER_TABLE = {0.3: (1.2e-1, 2.2e-2, 4.0e-3, 1.2e-4), 0.5: (7.2e-2, 1.2e-2, 2.2e-3, 6.7e-5),
               0.7: (3.6e-2, 5.8e-3, 9.6e-4, 3.9e-5), 0.9: (9.4e-3, 1.4e-3, 2.4e-4, 2.8e-5)}  # T = 1000


@pytest.mark.parametrize("num_terms", TERMS)
def test_power_law_soe_within_the_table(num_terms):
    alphas = list(POWER_TABLE)
    _, rel_error = soe_errors(alphas, num_terms, 1000, kernel="power")
    expected = f64([POWER_TABLE[alpha][TERMS.index(num_terms)] for alpha in alphas])
    assert (rel_error <= 1.1 * expected).all(), (rel_error, expected)
    _, _, skip = soe_kernel(f64(alphas), num_terms, 1000, kernel="power")
    assert torch.equal(skip, torch.zeros(len(alphas), dtype=F64))


def test_power_law_alpha_one_is_exact():
    lags = torch.arange(1, 1001)
    approx = approximate(f64(1.0), 15, 1000, lags, kernel="power")
    assert torch.equal(approx, torch.ones(1000, dtype=F64))
    assert torch.equal(power_weights(f64(1.0), lags), torch.ones(1000, dtype=F64))
    assert power_weights(f64(0.5), torch.tensor(0)).item() == 0.0  # undefined at j = 0, reported as 0


# --- Theorem 4.1: quantisation error of the order ------------------------------------------------------------------

def test_theorem_4_1_quantisation_bound():
    """|k_b(t) - k_a(t)| <= (b - a) t^(b-1) / Gamma(b) (|log t| + sup_[delta,1] |psi|), k_g(t) = t^(g-1) / Gamma(g)."""
    generator = torch.Generator().manual_seed(41)
    n = 2000
    delta = f64([0.05, 0.1, 0.2])[torch.randint(3, (n,), generator=generator)]
    a, b = (delta[:, None] + (1 - delta[:, None]) * torch.rand(n, 2, generator=generator, dtype=F64)).sort(-1)[0].T
    t = 10 ** (6 * torch.rand(n, generator=generator, dtype=F64))
    for d in (0.05, 0.1, 0.2):  # psi increases from psi(delta) < psi(1) < 0, so sup |psi| = |psi(delta)|
        grid = torch.linspace(d, 1, 1001, dtype=F64)
        assert torch.special.digamma(grid).abs().max() == torch.special.digamma(f64(d)).abs()
    lhs = (power_weights(b, t) - power_weights(a, t)).abs()
    rhs = (b - a) * power_weights(b, t) * (t.log().abs() + torch.special.digamma(delta).abs())
    ratio = lhs / rhs
    assert (ratio <= 1).all(), ratio.max()
    assert ratio.max() > 0.5  # the bound is not vacuous


# --- Proposition 4.2: no finite exponential mixture fits a power law ---------------------------------------------

def n_alpha(alpha, horizon):
    """N_alpha(T) = int_1^T t^(2 alpha - 2) dt."""
    if alpha == 0.5:
        return math.log(horizon)
    return (horizon ** (2 * alpha - 1) - 1) / (2 * alpha - 1)


def random_mixtures(count=6, size=5, seed=42):
    """(pi, lam) pairs: pi ~ U[0, 1], lam log-uniform in [0.01, 2]."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        pi = torch.rand(size, generator=generator, dtype=F64)
        lam = 0.01 * 200 ** torch.rand(size, generator=generator, dtype=F64)
        yield pi, lam


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7, 0.9])
def test_proposition_4_2_sharp_lower_bound(alpha):
    """int_1^T (f - t^(a-1))^2 dt >= N_a(T) - 2 C_f Gamma(a) Lam^-a for f = sum_m pi_m e^(-lam_m t), without the
    paper's extra -C_f^2 R term."""
    for horizon in (10, 1e3, 1e5):
        u_hi = math.log(horizon)
        power = integrate_log(lambda t: t ** (2 * alpha - 2), 0.0, u_hi)
        assert power == pytest.approx(n_alpha(alpha, horizon), rel=1e-12)  # the quadrature is accurate
        for pi, lam in random_mixtures():
            def squared_error(t):
                mixture = (pi * torch.exp(-lam * t[:, None])).sum(-1)
                return (mixture - t ** (alpha - 1)) ** 2
            lhs = integrate_log(squared_error, 0.0, u_hi)
            rhs = n_alpha(alpha, horizon) - 2 * pi.sum().item() * math.gamma(alpha) * lam.min().item() ** -alpha
            assert lhs >= rhs, (alpha, horizon, lhs, rhs)
            if alpha == 0.9 and horizon == 1e5:
                assert rhs > 0  # here the bound says something


# --- Proposition 4.4: growth of the accumulated weights -------------------------------------------------------------

def test_proposition_4_4_partial_sums():
    """sum_{j<t} w_j(a) = Gamma(t + a) / (Gamma(a + 1) Gamma(t)) = w_{t-1}(a + 1), ~ t^a / Gamma(a + 1)."""
    alpha = f64([0.1, 0.3, 0.5, 0.7, 0.9])[:, None]
    t = torch.arange(1, 301, dtype=F64)
    partial = gl_weights(alpha, t - 1).cumsum(-1)
    closed = torch.exp(torch.lgamma(t + alpha) - torch.lgamma(alpha + 1) - torch.lgamma(t))
    torch.testing.assert_close(partial, closed, rtol=1e-12, atol=0)
    torch.testing.assert_close(partial, gl_weights(alpha + 1, t - 1), rtol=1e-12, atol=0)
    big = f64(1e6)
    ratio = torch.exp(torch.lgamma(big + alpha) - torch.lgamma(big) - alpha * big.log())
    torch.testing.assert_close(ratio, torch.ones_like(alpha), rtol=1e-6, atol=0)
    # at alpha = 1 the growth is linear: the partial sums are exactly t
    assert torch.equal(gl_weights(f64(1.0), t - 1).cumsum(-1), t)


@pytest.mark.parametrize("alpha, correct, printed", [(0.3, 3.595485, 0.021573), (0.7, 16.981536, 0.237742)])
def test_proposition_4_4_table_and_misprint(alpha, correct, printed):
    t = 50
    partial = gl_weights(f64(alpha), torch.arange(t)).sum().item()
    assert partial == pytest.approx(correct, abs=5e-7)
    # the printed identity Gamma(t + a) / (Gamma(a) Gamma(t + 1)) is w_t, not the partial sum
    printed_form = math.exp(math.lgamma(t + alpha) - math.lgamma(alpha) - math.lgamma(t + 1))
    assert printed_form == pytest.approx(printed, abs=5e-7)
    assert printed_form == pytest.approx(gl_weights(f64(alpha), f64(t)).item(), rel=1e-12)
    assert printed_form < 0.1 * partial


# --- Lemma 4.5: the frequency response |W_a(e^(i w))| = |2 sin(w / 2)|^-a -------------------------------------------

OMEGAS = [0.01, 0.3, 1.0, 3.0]


def z_transform(alpha, z):
    """The closed form sum_j w_j(a) z^j = (1 - z)^-a (principal branch)."""
    return (1 - z) ** (-alpha)


def test_lemma_4_5_frequency_response():
    alpha, omega = 0.6, f64(OMEGAS)
    response = z_transform(alpha, torch.exp(1j * omega)).abs()
    torch.testing.assert_close(response, (2 * torch.sin(omega / 2)).abs() ** -alpha, rtol=1e-13, atol=0)
    # ~ |w|^-a at low frequency
    assert response[0].item() == pytest.approx(0.01 ** -alpha, rel=1e-5)


@pytest.mark.parametrize("radius", [0.99, 0.999])
def test_lemma_4_5_closed_form_is_the_power_series(radius):
    """sum_j w_j z^j inside the unit disc, truncated where radius^j w_j < 1e-19, equals (1 - z)^-a."""
    alpha, omega = 0.6, f64(OMEGAS)
    lags = torch.arange(math.ceil(45 / (1 - radius)))
    z = radius * torch.exp(1j * omega)
    series = (gl_weights(f64(alpha), lags) * z[:, None] ** lags).sum(-1)
    torch.testing.assert_close(series, z_transform(alpha, z), rtol=1e-10, atol=0)


# --- input validation ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    (dict(alpha=0.0), "alpha"),
    (dict(alpha=-0.5), "alpha"),
    (dict(alpha=1.5), "alpha"),
    (dict(alpha=[0.5, 1.0 + 1e-9]), "alpha"),
    (dict(num_terms=0), "num_terms"),
    (dict(num_terms=2.0), "num_terms"),
    (dict(horizon=1), "horizon"),
    (dict(eps=0.0), "eps"),
    (dict(eps=1.0), "eps"),
    (dict(kernel="exp"), "kernel"),
])
def test_soe_kernel_rejects_bad_arguments(overrides, match):
    arguments = dict(alpha=0.5, num_terms=15, horizon=1000, eps=1e-3, kernel="gl")
    arguments.update(overrides)
    arguments["alpha"] = f64(arguments["alpha"])
    with pytest.raises(ValueError, match=match):
        soe_kernel(**arguments)


def test_building_blocks_validate_too():
    with pytest.raises(ValueError, match="num_terms"):
        soe_log_rates(0, 1000)
    with pytest.raises(ValueError, match="kernel"):
        soe_weights(f64(0.5), 15, 1000, kernel="mixture")


def test_public_op_and_nan_orders():
    from hf_mixers import ops

    assert ops.soe_kernel is soe_kernel
    with pytest.raises(ValueError, match="alpha"):
        soe_kernel(torch.tensor([0.5, float("nan")], dtype=torch.float64), 15, 1000)
    assert soe_kernel(0.5, 15, 1000)[1].dtype == torch.float64
