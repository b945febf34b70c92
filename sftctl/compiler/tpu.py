"""The TPU cost model: a traced training step priced on a Cloud TPU slice.

A TPU runs a jitted step as one XLA program, so the kernels are XLA's fusions
(:func:`sftctl.compiler.fusion.fuse`, the same cut the GPU ``default`` mode prices) and there is
no per-kernel launch to pay. Each kernel is priced on the unit it runs on:

* **MXU** (GEMMs and attention's matrix work): ``flops / (peak x mxu_efficiency x padding)``;
  ``padding`` is the share of the systolic array a shape fills: each of ``m``, ``n``, ``k`` is
  rounded up to the MXU's width (128 on v5e and v5p, 256 on v6e), and a GEMM whose rows are
  fewer than the width leaves the rest idle. Attention runs at ``attention_efficiency`` of that
  (the flash kernel's softmax between its two matmuls).
* **vector unit** (pointwise, reductions): ``flops / vector peak``.
* **HBM**: every kernel is also ``bytes / (HBM peak x hbm_efficiency)``; a kernel takes the longer
  of its compute and its memory time (the roofline).
* **ICI** (the slice's collectives): the gradient all-reduce of data parallelism over ``chips``,
  or FSDP's all-gathers and reduce-scatter, as ring collectives over the chip's ICI bandwidth
  (``2 (n-1)/n x bytes / (bandwidth x ici_efficiency)`` for an all-reduce), of which
  ``1 - overlap`` is exposed (XLA's async collective fusion overlaps them with backward compute).

The coefficients (``mxu_efficiency``, ``attention_efficiency``, ``hbm_efficiency``,
``ici_efficiency``, ``overlap``) and each accelerator's MXU width live in the calibration file its
catalog entry names (``calibrations/tpu.json``); :func:`fit` fits them to published measured
training throughputs (MaxText's model-FLOP utilization tables for v5e and v5p, its v6e tiering
table), :func:`cross_validate` holds each figure out and writes the accuracy files
(``python -m sftctl.compiler.tpu --write``). :func:`published_kernels` builds those models' steps
(MaxText's llama2-style decoder at the published sizes) as the same kernels a trace gives, so the
fit and the traced step are priced by one function, :func:`kernel_time_s`.
No accelerator is named here: every table is in the catalog and the calibration file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from sftctl.compiler.fusion import Kernel, attention_flops
from sftctl.compiler.problem import GemmProblem
from sftctl.catalog.accelerators import Accelerator

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibrations"
ACCURACY_DIR = CALIBRATION_DIR / "accuracy"


@dataclasses.dataclass(frozen=True)
class TPUCoefficients:
    """The fitted efficiencies (fractions, 0..1]): see the module docstring."""

    mxu_efficiency: float = 0.8
    attention_efficiency: float = 0.6
    hbm_efficiency: float = 0.8
    ici_efficiency: float = 0.7
    overlap: float = 0.8


def is_tpu(hw: Accelerator) -> bool:
    """Whether ``hw`` is priced by this model (its catalog vendor is ``google``)."""
    return hw.vendor == "google"


@functools.lru_cache(maxsize=None)
def _document(calibration: str) -> dict:
    return json.loads((CALIBRATION_DIR / calibration).read_text())


def model_of(hw: Accelerator) -> tuple[TPUCoefficients, dict]:
    """``(coefficients, facts)`` of TPU ``hw`` from the calibration file its entry names:
    ``facts`` has ``mxu_dim`` (the systolic array's width) and its source.

    Raises:
        ValueError: ``hw`` names no calibration file, or the file has no entry for it.
    """
    if not hw.calibration:
        raise ValueError(f"{hw.name}: its catalog entry names no calibration file for the TPU model")
    doc = _document(hw.calibration)["tpu"]
    facts = doc["accelerators"].get(hw.name)
    if facts is None:
        raise ValueError(f"{hw.name}: no entry in calibrations/{hw.calibration}")
    return TPUCoefficients(**doc["coefficients"]), facts


def _pad(x: int, width: int) -> int:
    return -(-x // width) * width


def gemm_fill(g: GemmProblem, width: int) -> float:
    """The share of the MXU's work a GEMM's shape uses: ``m n k / (pad(m) pad(n) pad(k))``."""
    return (g.m * g.n * g.k) / (_pad(g.m, width) * _pad(g.n, width) * _pad(g.k, width))


def kernel_time_s(k: Kernel, hw: Accelerator, c: TPUCoefficients, mxu_dim: int) -> float:
    """Seconds one fused kernel takes on one TPU chip (the roofline of its unit and HBM)."""
    memory = (k.bytes_read + k.bytes_written) / (hw.hbm_bytes_per_s * c.hbm_efficiency)
    if k.gemm is not None:
        dtype = k.gemm.dtype if k.gemm.dtype in ("bfloat16", "float16", "float8", "int8") else "float32"
        peak = hw.matrix_peak("bfloat16" if dtype == "float16" else dtype)
        matrix = 2.0 * k.gemm.batch * k.gemm.m * k.gemm.n * k.gemm.k
        compute = matrix / (peak * c.mxu_efficiency * gemm_fill(k.gemm, mxu_dim))
        compute += max(0.0, k.flops - matrix) / hw.vector_peak("float32")
    elif k.attention is not None:
        a = k.attention
        fill = min(1.0, a["head_dim"] / mxu_dim) * min(1.0, a["q_len"] / mxu_dim)
        compute = attention_flops(a) / (hw.matrix_peak("bfloat16") * c.mxu_efficiency * c.attention_efficiency * fill)
    else:
        compute = k.flops / hw.vector_peak("float32")
    return max(compute, memory)


@dataclasses.dataclass(frozen=True)
class TPUStep:
    """A step predicted on a slice of ``chips`` chips (data parallel or FSDP over all of them).

    Seconds per step: ``compute_s`` (the kernels on one chip), ``comm_s`` (exposed collectives),
    ``step_s``; ``mxu_s`` (GEMM and attention kernels' share of compute); bytes per chip:
    ``memory_bytes`` (parameters, gradients, AdamW state, saved activations) and
    ``capacity_bytes``."""

    parallelism: str
    chips: int
    compute_s: float
    comm_s: float
    step_s: float
    mxu_s: float
    memory_bytes: int
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


def collective_s(kind: str, nbytes: float, chips: int, ici_bytes_per_s: float, c: TPUCoefficients) -> float:
    """Seconds of a ring ``all_reduce``, ``all_gather`` or ``reduce_scatter`` of ``nbytes``
    (the full tensor) over ``chips`` chips at ``ici_bytes_per_s`` per chip (one direction)."""
    if chips <= 1 or nbytes <= 0:
        return 0.0
    share = (chips - 1) / chips * (2.0 if kind == "all_reduce" else 1.0)
    return share * nbytes / (ici_bytes_per_s * c.ici_efficiency)


def predict_kernels(kernels: list[Kernel], hw: Accelerator, *, chips: int, params: int, ici_bytes_per_s: float,
                    parallelism: str = "ddp", recompute_forward: bool = False, activation_bytes: int = 0,
                    coeffs: TPUCoefficients | None = None, repeat: list[int] | None = None) -> TPUStep:
    """The step of ``kernels`` (one chip's share of the batch) on ``chips`` chips.

    Args:
        params: trainable parameters of the model.
        ici_bytes_per_s: the chip's ICI bandwidth, one direction (the offering's
            ``intra_node_bytes_per_s``).
        parallelism: ``ddp`` (a bf16 gradient all-reduce... priced as fp32, as the step keeps
            fp32 gradients) or ``fsdp`` (bf16 all-gathers of the weights for forward and backward,
            an fp32 reduce-scatter of the gradients; parameters and AdamW state sharded).
        recompute_forward: activation checkpointing: the forward kernels (those before the
            first backward one is not known here: the caller passes the forward share) run twice.
        activation_bytes: activations kept for backward, bytes per chip.
        repeat: how many times each kernel runs (the layers of a model built once), default once.
    """
    c0, facts = model_of(hw)
    c = coeffs or c0
    weights = repeat or [1] * len(kernels)
    times = [w * kernel_time_s(k, hw, c, facts["mxu_dim"]) for k, w in zip(kernels, weights)]
    compute = sum(times)
    mxu = sum(t for k, t in zip(kernels, times) if k.gemm is not None or k.attention is not None)
    if parallelism == "fsdp":
        gathers = (3 if recompute_forward else 2) * collective_s("all_gather", params * 2, chips, ici_bytes_per_s, c)
        comm = gathers + collective_s("reduce_scatter", params * 4, chips, ici_bytes_per_s, c)
        state = params * 16 / chips  # fp32 parameters, gradients, Adam m and v, sharded
    else:
        comm = collective_s("all_reduce", params * 4, chips, ici_bytes_per_s, c)
        state = params * 16
    exposed = max(comm * (1 - c.overlap), comm - compute)
    return TPUStep(parallelism, chips, compute, exposed, compute + exposed, mxu,
                   int(state + activation_bytes), hw.memory_bytes)


def predict_offering(graph, hw: Accelerator, *, chips: int, ici_bytes_per_s: float | None,
                     parallelisms: tuple[str, ...] = ("ddp", "fsdp"), mode: str = "default"):
    """A traced step (``graph``: one chip's share of the batch) on a slice of ``chips`` chips,
    as the planner's :class:`sftctl.compiler.api.OfferingPrediction`: each parallelism priced,
    the fastest that fits HBM chosen (else the one needing the least). Activations kept for
    backward are the forward kernels' outputs (an upper bound: XLA frees some early).
    ``ici_bytes_per_s`` None: the slowest published ICI of the catalog's TPUs is not assumed;
    the chips' collectives are priced at 100 GB/s."""
    from sftctl.compiler.api import OfferingPrediction
    from sftctl.compiler.fusion import fuse
    from sftctl.compiler.sharding import StrategyPrediction
    from sftctl.compiler.step import StepPrediction

    kernels = fuse(graph)
    params = sum(n.type.numel for n in graph.inputs_with_role("param"))
    written = [k.bytes_written for k in kernels]
    activations = int(sum(written[: len(written) // 2]))
    ici = ici_bytes_per_s or 1.0e11
    strategies = []
    for par in parallelisms:
        s = predict_kernels(kernels, hw, chips=chips, params=params, ici_bytes_per_s=ici, parallelism=par,
                            activation_bytes=activations)
        strategies.append(StrategyPrediction(par, False, chips, s.compute_s, s.comm_s, s.step_s, s.memory_bytes,
                                             s.capacity_bytes, {"params": params, "activations": activations}))
    fitting = [s for s in strategies if s.fits]
    chosen = min(fitting or strategies, key=(lambda s: s.step_time_s) if fitting else (lambda s: s.memory_bytes))
    ddp = strategies[0]
    needed = 1 if ddp.fits else max(2, math.ceil(ddp.memory_bytes / ddp.memory_capacity_bytes))
    step = StepPrediction(hw.name, chips, ddp.compute_time_s, ddp.comm_time_s, ddp.step_time_s, ddp.memory_bytes,
                          ddp.memory_capacity_bytes, needed, mode)
    why = (f"{chosen.label} on {chips} TPU chip(s): {chosen.step_time_s * 1e3:.3g} ms per step "
           f"(XLA program priced by sftctl.compiler.tpu)" if chosen.fits else
           f"needs {chosen.memory_bytes / 2**30:.1f} GiB per chip, the chip has {hw.memory_bytes / 2**30:.0f} GiB")
    return OfferingPrediction(step, tuple(strategies), chosen, why)


# --------------------------------------------------------------------------------------------
# The published figures' steps (MaxText's decoder), fit and cross-validation


def decoder_config(entry: dict) -> dict:
    """A published run's model shape: MaxText's ``global_parameter_scale`` models (base.yml:
    emb 2048, 16 heads of 128, MLP 7168, 16 layers, vocab 32000; pyconfig.get_individual_scales
    doubles heads+MLP, then the embedding, then layers) or the explicit llama sizes."""
    if "global_parameter_scale" in entry:
        log2 = int(math.log2(entry["global_parameter_scale"]))
        base, rem = divmod(log2, 3)
        heads_s = base + int(rem > 0)
        emb_s = base + int(rem > 1)
        return {"emb": 2048 * 2 ** emb_s, "heads": 16 * 2 ** heads_s, "kv_heads": 16 * 2 ** heads_s,
                "head_dim": 128, "mlp": 7168 * 2 ** heads_s, "layers": 16 * 2 ** base, "vocab": 32000}
    return {k: entry[k] for k in ("emb", "heads", "kv_heads", "head_dim", "mlp", "layers", "vocab")}


def decoder_params(m: dict) -> int:
    """Trainable parameters of the decoder ``m`` (untied embedding and head)."""
    attn = m["emb"] * m["head_dim"] * (2 * m["heads"] + 2 * m["kv_heads"])
    return m["layers"] * (attn + 3 * m["emb"] * m["mlp"] + 2 * m["emb"]) + 2 * m["vocab"] * m["emb"]


def model_flops(m: dict, tokens: int, seq: int) -> float:
    """MaxText's model FLOPs of a training step (its MFU numerator): 6 x weights' FLOPs per token
    plus causal attention (``calculate_tflops_training_per_device``; causal since July 2025)."""
    dense = 6 * tokens * (decoder_params(m) - m["vocab"] * m["emb"])  # the embedding lookup is no matmul
    attention = 6 * 2 * tokens * seq * m["heads"] * m["head_dim"] * m["layers"] / 2
    return dense + attention


@functools.lru_cache(maxsize=None)
def _published_kernels(key: str) -> tuple:
    return published_kernels(json.loads(key))


def published_kernels(entry: dict) -> tuple[list[Kernel], list[int], int, int]:
    """The kernels of one chip's step of a published run, as a trace fuses them: per layer the
    projections, SwiGLU MLP and flash attention forward and backward (dgrad and wgrad GEMMs; the
    forward again under full remat), RMSNorm/rotary/SwiGLU/residual fusions as memory traffic;
    the logits GEMMs and the cross-entropy; the AdamW update. One layer's kernels are built once:
    returns ``(kernels, repeat, params, activation bytes per chip)``, ``repeat`` the times each
    kernel runs (the layers)."""
    m = decoder_config(entry)
    seq, batch = entry["seq"], entry["per_device_batch"]
    tokens = max(1, int(batch * seq))
    E, F, V, D = m["emb"], m["mlp"], m["vocab"], m["head_dim"]
    q_out, kv_out = m["heads"] * D, m["kv_heads"] * D
    bf = 2
    fwd_gemms = [(tokens, q_out + 2 * kv_out, E), (tokens, E, q_out), (tokens, 2 * F, E), (tokens, E, F)]
    out: list[Kernel] = []

    def gemm(m_: int, n: int, k: int) -> Kernel:
        g = GemmProblem(1, m_, n, k, "bfloat16", "bfloat16")
        return Kernel("gemm", [], bytes_read=bf * (m_ * k + k * n), bytes_written=bf * m_ * n,
                      flops=2.0 * m_ * n * k, gemm=g)

    def attention(direction: str) -> Kernel:
        a = {"direction": direction, "batch": max(1, int(batch)), "q_heads": m["heads"], "kv_heads": m["kv_heads"],
             "q_len": seq, "kv_len": seq, "head_dim": D, "v_head_dim": D, "kept_fraction": 0.5}
        moved = bf * tokens * (2 * q_out + 2 * kv_out) * (2 if direction == "backward" else 1)
        return Kernel("attention", [], bytes_read=moved, bytes_written=moved // 2, flops=attention_flops(a),
                      attention=a)

    def pointwise(elems: float) -> Kernel:
        return Kernel("pointwise", [], bytes_read=int(bf * elems), bytes_written=int(bf * elems / 2), flops=elems)

    forward_passes = 2 if entry.get("remat", "full") == "full" else 1
    for _ in range(forward_passes):  # one layer; repeat says how many
        out += [gemm(*s) for s in fwd_gemms] + [attention("forward")]
        out.append(pointwise(tokens * (4 * E + 3 * F + 2 * q_out)))  # norms, residuals, SwiGLU, rotary
    for (mm, n, k) in fwd_gemms:
        out += [gemm(mm, k, n), gemm(k, n, mm)]  # dgrad, wgrad
    out.append(attention("backward"))
    out.append(pointwise(2 * tokens * (4 * E + 3 * F + 2 * q_out)))
    per_layer = len(out)
    out += [gemm(tokens, V, E), gemm(tokens, E, V), gemm(E, V, tokens)]
    out.append(Kernel("pointwise", [], bytes_read=4 * 3 * tokens * V, bytes_written=4 * tokens * V, flops=8.0 * tokens * V))
    params = decoder_params(m)
    chips = entry["chips"]
    shard = params / chips if entry.get("parallelism", "fsdp") == "fsdp" else params
    out.append(Kernel("pointwise", [], bytes_read=int(shard * 16), bytes_written=int(shard * 12), flops=12.0 * shard))
    saved = bf * tokens * E * m["layers"] * (1 if entry.get("remat", "full") == "full" else 12)
    return out, [m["layers"]] * per_layer + [1] * (len(out) - per_layer), params, saved


def predict_published(entry: dict, hw: Accelerator, coeffs: TPUCoefficients | None = None) -> dict:
    """A published run predicted: ``{"step_s", "mfu", "measured_mfu", "ratio"}`` (ratio =
    predicted / measured step time = measured MFU / predicted MFU)."""
    kernels, repeat, params, saved = _published_kernels(json.dumps(entry, sort_keys=True))
    step = predict_kernels(kernels, hw, chips=entry["chips"], params=params, repeat=repeat,
                           ici_bytes_per_s=entry["ici_bytes_per_s"], parallelism=entry.get("parallelism", "fsdp"),
                           recompute_forward=entry.get("remat", "full") == "full", activation_bytes=saved,
                           coeffs=coeffs)
    m = decoder_config(entry)
    tokens = entry["per_device_batch"] * entry["seq"]
    mfu = model_flops(m, tokens, entry["seq"]) / (step.step_s * hw.matrix_peak("bfloat16"))
    return {"step_s": step.step_s, "mfu": mfu, "measured_mfu": entry["mfu"], "ratio": entry["mfu"] / mfu}


def _published(calibration: str) -> list[dict]:
    return list(_document(calibration)["tpu"]["published"])


def fit(entries: list[dict], accelerators: dict[str, Accelerator]) -> TPUCoefficients:
    """The coefficients that minimize the squared log error of predicted step times over
    ``entries`` (a grid over MXU, attention and HBM efficiency; ICI and overlap stay at their
    documented values: no published figure isolates them)."""
    best, best_err = None, math.inf
    for mxu in [x / 100 for x in range(50, 101, 2)]:
        for att in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
            for hbm in (0.6, 0.7, 0.8, 0.9):
                c = TPUCoefficients(mxu, att, hbm)
                err = sum(math.log(predict_published(e, accelerators[e["accelerator"]], c)["ratio"]) ** 2
                          for e in entries)
                if err < best_err:
                    best, best_err = c, err
    return best


def cross_validate(calibration: str, accelerators: dict[str, Accelerator]) -> dict:
    """Leave-one-out over the published figures (each predicted by a fit without it), and
    leave-one-generation-out (each TPU predicted by a fit on the others only). Returns the
    held-out ratios (predicted / measured step time) and the factors: ``exp`` of the 90 %
    quantile of ``|ln ratio|``."""
    entries = _published(calibration)
    loo = []
    for i, e in enumerate(entries):
        c = fit(entries[:i] + entries[i + 1:], accelerators)
        loo.append(1 / predict_published(e, accelerators[e["accelerator"]], c)["ratio"])
    per_gen = {}
    for name in sorted({e["accelerator"] for e in entries}):
        c = fit([e for e in entries if e["accelerator"] != name], accelerators)
        per_gen[name] = [1 / predict_published(e, accelerators[name], c)["ratio"]
                         for e in entries if e["accelerator"] == name]
    return {"loo": loo, "leave_generation_out": per_gen}


def quantile_factor(ratios: list[float], q: float = 0.9) -> float:
    """``exp`` of the ``q`` quantile of ``|ln r|`` (nearest rank)."""
    logs = sorted(abs(math.log(r)) for r in ratios)
    return math.exp(logs[min(len(logs) - 1, max(0, math.ceil(q * len(logs)) - 1))])


def main(argv: list[str] | None = None) -> int:
    """``python -m sftctl.compiler.tpu [--write]``: fit the TPU coefficients to the published
    figures, cross-validate, print every figure; ``--write`` stores the fit in the calibration
    file and each TPU's accuracy file."""
    import argparse

    from sftctl.catalog.accelerators import load_accelerators

    ap = argparse.ArgumentParser(prog="python -m sftctl.compiler.tpu")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    accs = {n: a for n, a in load_accelerators().items() if is_tpu(a)}
    calibration = next(iter(accs.values())).calibration
    entries = _published(calibration)
    c = fit(entries, accs)
    print(f"fit: {c}")
    for e in entries:
        got = predict_published(e, accs[e["accelerator"]], c)
        print(f"  {e['accelerator']:8} {e['label']:28} MFU measured {e['mfu']:.3f} predicted {got['mfu']:.3f} "
              f"step ratio {1 / got['ratio']:.3f}")
    cv = cross_validate(calibration, accs)
    loo_f = quantile_factor(cv["loo"])
    print(f"leave-one-out: factor {loo_f:.3f} over {len(cv['loo'])} figures")
    for name, ratios in cv["leave_generation_out"].items():
        print(f"  {name} held out: ratios {', '.join(f'{r:.3f}' for r in ratios)}")
    if args.write:
        path = CALIBRATION_DIR / calibration
        doc = json.loads(path.read_text())
        doc["tpu"]["coefficients"] = dataclasses.asdict(c)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        for name, ratios in cv["leave_generation_out"].items():
            own = [r for e, r in zip(entries, cv["loo"]) if e["accelerator"] == name]
            gen_f = quantile_factor(ratios)
            factor = max(loo_f, quantile_factor(own))
            n_own = len(own)
            acc = {"kind": "sftctl prediction accuracy", "schema": 1, "accelerator": name, "calibrated": True,
                   "sources": [f"published training throughputs: calibrations/{calibration} 'published' "
                               f"({len(entries)} figures, {n_own} on {name}; MaxText MFU tables and tiering)",
                               "model: sftctl.compiler.tpu (MXU, vector unit, HBM roofline; ICI ring collectives)"],
                   "error": {"factor": round(factor, 4),
                             "basis": (f"cross-validated: leave-one-out over the {len(entries)} published figures, "
                                       f"90 % quantile of |ln(pred/meas)| {loo_f:.3f} (all), "
                                       f"{quantile_factor(own):.3f} ({name}); the larger"),
                             "leave_generation_out_factor": round(gen_f, 4),
                             "held_out_ratios": [round(r, 4) for r in own],
                             "method": "python -m sftctl.compiler.tpu --write",
                             "meaning": "the measured step time is expected within [predicted / factor, "
                                        "predicted x factor]"}}
            (ACCURACY_DIR / f"{name.lower()}.json").write_text(json.dumps(acc, indent=1) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
