"""Kernels (Triton, with their PyTorch references and autograd wrappers), installed as hf_mixers.kernels."""
