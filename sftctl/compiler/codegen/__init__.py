"""Code generation: Triton kernels for the schedules the search chooses.

Importing this package is light (no torch, no triton); the submodules import them.

Stable launcher API (what ``compiler/backend.py`` codes against)
-----------------------------------------------------------------
All launchers take and return ``torch.Tensor``; they run compiled Triton kernels on CUDA/ROCm
tensors and Triton's interpreter on CPU tensors or under ``TRITON_INTERPRET=1``. Schedules are
plain dicts whose block sizes become ``tl.constexpr`` (``num_warps``/``num_stages`` are launch
options). Errors: ``ValueError`` for shapes/configs, ``TypeError`` for dtypes.

``from sftctl.compiler.codegen.gemm import gemm``
    ``gemm(a, b, *, bias=None, activation="none", residual=None, alpha=1.0, out_dtype=None,
    config=None, out=None, compute_dtype=None, allow_tf32=True) -> Tensor``:
    ``act(alpha * (a @ b) + bias) + residual``; ``a`` ``(M, K)``/``(B, M, K)``, ``b``
    ``(K, N)``/``(B, K, N)`` with any strides; ``bias`` ``(N,)``; activations ``none relu gelu
    gelu_erf gelu_tanh silu``; ``config`` is ``GemmChoice.config`` (BLOCK_M/N/K, GROUP_M,
    split_k, num_warps, num_stages, layout). Also ``launch_for(fusion_kernel, gemm_choice) ->
    GemmLaunch`` (callable as ``launch(a, b, **epilogue)``) and ``problem_for_kernel``.

``from sftctl.compiler.codegen.reduction import ...`` (all over the last dim)
    ``softmax(x)``, ``log_softmax(x)``, ``row_sum(x)``, ``row_max(x)``,
    ``cross_entropy_fwd_bwd(logits, target, *, ignore_index=-100, grad_scale=1.0) -> (loss_fp32,
    dlogits)``, ``layer_norm_fwd(x, weight, bias, eps) -> (y, mean, rstd)``,
    ``layer_norm_bwd(dy, x, weight, mean, rstd, *, has_bias=True) -> (dx, dweight, dbias)``,
    ``rms_norm_fwd(x, weight, eps) -> (y, rstd)``, ``rms_norm_bwd(dy, x, weight, rstd) -> (dx,
    dweight)``, ``column_sum(x) -> (n,)`` (bias gradients). Each takes ``config=``.

``from sftctl.compiler.codegen.elementwise import Chain, elementwise``
    ``elementwise(Chain(inputs, ops, outputs), inputs, *, out_dtypes=None, out=None,
    config=None)``: one generated kernel for a broadcast elementwise chain (ops listed in
    ``elementwise.OPS``).

``from sftctl.compiler.codegen.targets import ...``
    ``gemm_resources / elementwise_resources / layer_norm_resources / compile_resources`` ->
    ``KernelResources`` for ``sm_90 sm_80 sm_89 sm_75 gfx942`` compiled offline;
    ``occupancy(res, hw)``, ``fits(res, hw)``, ``gemm_measurer(problem, hw)`` for
    ``search_gemm(..., measure=...)``.
"""

__all__ = ["elementwise", "gemm", "reduction", "targets"]
