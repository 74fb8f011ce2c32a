"""Kernels for the engine that PyTorch does not provide in the form a CPU decode step needs."""
