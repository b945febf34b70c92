"""PyTorch frontend: trace one whole training step (forward, loss, backward, AdamW) into the IR.

``trace_step(model, batch, loss_fn)`` captures the step's joint graph, as AOTAutograd does:

    loss = functional_call(model, params + buffers, batch)     # params require grad
    grads = torch.autograd.grad(loss, params)                  # autograd runs the backward
    params', m', v' = AdamW(params, grads, m, v, step)         # written in torch ops, no_grad

all inside one ``make_fx`` (``tracing_mode="fake"`` by default, so a 1B-parameter model costs no
memory: parameters and the batch may live on the ``meta`` device or be fake tensors), which
records the ATen ops of forward, backward and update below autograd, through
``core_aten_decompositions()`` plus :func:`decomposition_table`'s extras (layer norm, softmax,
GELU, ...). Why this capture: the model runs on plain FakeTensors, exactly as under
``torch.compile``/``torch.export`` (so library code that checks "am I being traced?", such as
transformers' ``is_tracing``, takes its tracing path instead of asking a tensor for its value),
autograd itself derives the backward (every op with a derivative formula works, custom
``autograd.Function`` included), and in-place buffer updates (BatchNorm's running statistics)
are ordinary ATen ops on the buffer inputs, returned as step outputs. ``torch.func.grad``
(the previous capture) hands the model functorch wrapper tensors instead, which libraries cannot
recognize as traced and which forbid in-place updates of closed-over buffers.

``F.scaled_dot_product_attention`` is routed while tracing (:class:`_DecomposeSDPA`) to the custom
op ``sftctl::attention`` (forward: O and the row log-sum-exp) whose autograd formula is
``sftctl::attention_backward`` (dQ, dK, dV from Q, K, V, O, dO, LSE), so attention arrives as the
IR's ``attention`` / ``attention_lse`` / ``attention_grad`` ops: one flash-attention kernel each way,
with no S x S score matrix. All SDPA forms lower: masks (bool or additive, broadcast), ``is_causal``,
``scale``, GQA (``enable_gqa``, K/V kept at their own head count) and ``dropout_p`` (the op draws its
keep-mask from a random stream numbered by call). A mask that requires grad falls back to the
materialized math (:func:`_sdpa_math`). Attention written out by hand (matmul, softmax, matmul;
transformers' ``attn_implementation="eager"``) stays that, as it runs on a GPU.

Dropout (``aten.native_dropout``) lowers to an ``rng_bernoulli`` keep-mask (a bool tensor: what
torch saves for backward, 1 byte per element) and a ``where``; its backward reads the mask.
Sampling inside the step (``rand``, ``randn``, ``randint``, ``normal_``, ``uniform_`` and their
``_like`` forms, e.g. a diffusion model's noise and timesteps) lowers to ``rng_uniform`` draws:
normals by the Box-Muller transform, integers by scaling and truncation.

make_fx records each node's ``nn_module_stack`` and ``stack_trace``: an ATen op without a lowering
raises ``NotImplementedError`` naming the op, the module path and the model's file:line, and a
data-dependent branch (Python control flow on a tensor's value) names the model's line that took it.

The graph (see :mod:`sftctl.compiler.ir`):

* inputs, in this order: role ``param`` (trainable parameters, ``named_parameters()`` order with
  tied parameters once), ``opt_state`` (``<name>.exp_avg`` for each parameter, then
  ``<name>.exp_avg_sq``), ``buffer`` (buffers and frozen parameters), ``step`` (float32 scalar:
  the 1-based number of this step, i.e. torch's ``state["step"]`` after its increment), ``batch``
  (the tensor leaves of ``batch`` in ``torch.utils._pytree`` order). Non-uniform tensor constants
  captured from the program become inputs of role ``constant`` carrying ``attrs["value"]``.
* outputs: ``loss``, then ``param:<name>`` for each parameter, then
  ``opt_state:<name>.exp_avg`` for each, then ``opt_state:<name>.exp_avg_sq`` for each, then
  ``buffer:<name>`` for each buffer the step updated in place (e.g. BatchNorm's ``running_mean``,
  ``running_var``, ``num_batches_tracked`` in train mode), its value after the step.

AdamW is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, ``eps`` added after the
square root), optionally preceded by ``clip_grad_norm_`` (``grad_clip``); ``lr``, betas, eps and the
weight decay are baked into the graph as constants, the step count is an input. ``weight_decay``
may be a callable ``(name, param) -> float`` for per-parameter groups (e.g. no decay for 1-D).

Mixed precision (``autocast_dtype`` / ``trace_entrypoint(dtype=...)``): parameters, gradients and
AdamW state stay in the model's dtype (float32 master weights) and the loss is computed under
``torch.autocast("cpu", dtype)`` as examples/gpt/train.py does on GPU, so the trace holds the
casts autocast inserts: matmuls (``dot_general``, with the linear layers' bias adds) and the
attention op (q, k, v cast to the autocast dtype, as CUDA autocast does for SDPA; its softmax
statistics in float32 as flash attention keeps them) run in bfloat16/float16, while layer norm,
GELU (computed in float32 by its decomposition) and the loss stay float32. The CPU autocast op lists are
used; for the ops a transformer uses (linear, matmul, bmm, baddbmm) they agree with CUDA's.
This is the one scheme a spec's ``model.dtype`` names in both frontends: the JAX frontend gives
the same float32 master weights and AdamW state with bfloat16/float16 compute
(``frontends/jax/``, ``compute_dtype``).

Reentrant activation checkpointing (``checkpoint(..., use_reentrant=True)``) is traced as the
non-reentrant form (:func:`.capture._reentrant_checkpoint_as_non_reentrant`). ``.item()`` of a
tensor is a 0-d IR value (arithmetic on it lowers as scalar ops); a size made from one is refused
naming the line. Integer shifts (arithmetic ``>>`` on signed integers) and bitwise ops are the
IR's two's-complement bitwise ops; ``slice_scatter`` with a step is a gather and a select.

Complex tensors (FNO's weights, ``torch.fft``'s results) are pairs of real IR tensors (a complex
parameter or AdamW moment is one IR input ``[..., 2]``, ``view_as_real``'s layout; AdamW steps it
as torch does, on that view); the FFTs (``_fft_r2c`` / ``_fft_c2r`` / ``_fft_c2c``, so every
``torch.fft`` function, ``stft`` and their gradients) are DFT products priced as cuFFT
(:mod:`.lowerings.complex`, :mod:`sftctl.compiler.fft`). ``randperm`` ranks uniform draws.
A NaN / inf check in the forward (``if torch.isnan(h).any(): raise``, ``assert
torch.isfinite(loss)``) is taken as it is on finite data, the assumption and the model's line in
``meta["assumptions"]`` (:func:`.capture._finite_checks_assumed`). Any other value the model reads
(a data-dependent ``if`` / ``assert`` / ``while``, ``.numpy()``, ``.tolist()``) is taken on the
representative batch, also recorded (:mod:`.branches`; refused naming the line where no real
input exists). Dense linear algebra (``eigh``, ``svd``, ``qr``, LU, ``solve``, ``inv``, ``det``)
decomposes below autograd, each call tagged for cuSOLVER's price (:mod:`.solvers`,
:mod:`sftctl.compiler.linalg`); RNN layers are tagged so eager mode runs them as cuDNN's fused
kernels (:mod:`.rnn`).
Special functions (``lgamma``, ``digamma``, ``polygamma`` n <= 2), ``adaptive_max_pool2d`` (any
sizes), ``linalg.cholesky`` / ``solve_triangular`` / ``cholesky_solve`` (unrolled over the matrix
size, with their backward) and ``grid_sample``'s backward go through :mod:`.decomps`.

Lowering notes: ``cumsum`` is the IR's ``cumsum`` scan and ``flip`` its ``reverse``; ``torch.gather`` / ``scatter`` (take-along-axis forms) become an IR ``gather`` /
``scatter_add`` on the flattened tensor with a computed linear index; ``index`` / ``index_put``
with adjacent index tensors merge the indexed dims the same way; a scatter with one index per row
(``nll_loss`` backward) is a compare against an ``iota`` (elementwise, so it fuses into its
consumer as Inductor's lowering does); other non-accumulating scatters use a
``scatter_add`` of ones as the written mask (exact for unique indices, as torch itself only
defines them).
``convolution`` (N-d, stride, padding, dilation, groups, transposed) and ``convolution_backward``
become IR ``conv`` nodes (input gradient: a ``conv`` of the output gradient dilated by the
stride with the flipped, channel-swapped kernel; weight gradient: a batch-grouped ``conv`` of the
input with the output gradient as kernel). ``max_pool2d_with_indices`` is a ``maximum`` over
strided slices of the -inf-padded input with torch's first-maximum indices, its backward a
``scatter_add``; ``avg_pool2d`` (and ``_adaptive_avg_pool2d`` when the sizes divide) sums strided
slices and divides by torch's window counts, its backward places the gradient back with pads and
reshapes. Batch norm (every ``native_batch_norm`` variant) uses torch's decompositions.
"""

from sftctl.compiler.frontends.torch import lowerings  # noqa: F401  (fills the op table)
from sftctl.compiler.frontends.torch.capture import decomposition_table, trace_entrypoint, trace_step
from sftctl.compiler.frontends.torch.lowering import OPS, _Lowering, ir_dtype, lowers

__all__ = ["OPS", "decomposition_table", "ir_dtype", "lowers", "trace_entrypoint", "trace_step", "_Lowering"]
