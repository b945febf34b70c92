"""Search: per-kernel schedule search (search/gemm.py) and the graph's cut into kernels."""
