"""Functional selective scans with mamba_ssm's argument layout, runnable on CPU (kernels/mamba_ops.py):

    from hf_mixers.ops import selective_scan, ssd_scan, delta_t_scan

``selective_scan`` is ``selective_scan_fn``'s twin, ``ssd_scan`` ``mamba_chunk_scan_combined``'s, ``delta_t_scan``
Mamba-Δᵀ's. On CUDA with mamba_ssm (or flash-linear-attention) installed they call its kernel; otherwise the PyTorch
chunked scan.
"""

from .kernels.mamba_ops import delta_t_scan, selective_scan, ssd_scan

__all__ = ["selective_scan", "ssd_scan", "delta_t_scan"]
