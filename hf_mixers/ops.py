"""Functional ops users already know, runnable on CPU:

    from hf_mixers.ops import selective_scan, ssd_scan, delta_t_scan      (kernels/mamba_ops.py)
    from hf_mixers.ops import pattern_support                             (kernels/token_patterns.py)
    from hf_mixers.ops import soe_kernel                                  (kernels/soe.py)

``selective_scan`` is mamba_ssm's ``selective_scan_fn``'s twin, ``ssd_scan`` ``mamba_chunk_scan_combined``'s,
``delta_t_scan`` Mamba-Δᵀ's. On CUDA with mamba_ssm (or flash-linear-attention) installed they call its kernel;
otherwise the PyTorch chunked scan. ``pattern_support(pattern, length, window=8, offsets=None)`` lists, for each
1-based position, the past positions a GLTM pattern lets that token read. ``soe_kernel(alpha, num_terms, horizon,
eps=1e-3)`` returns VORT's corrected sum-of-exponentials of the power law w_j(alpha): (rates, weights, skip_weight).
"""

from .kernels.mamba_ops import delta_t_scan, selective_scan, ssd_scan
from .kernels.soe import soe_kernel
from .kernels.token_patterns import pattern_support

__all__ = ["selective_scan", "ssd_scan", "delta_t_scan", "pattern_support", "soe_kernel"]
