"""What ``sftctl compile`` writes: the JSON document (plan.json, ``--json``) and a report a person
reads (report.md, with roofline.svg beside it).

The report aggregates the step by execution mode (``eager``, ``default``, ``sftensor``: see
:mod:`sftctl.compiler.modes`), by kernel kind, by phase (forward, backward, optimizer) and by
model module; gives model FLOPs, MFU and tokens/s per mode; lists the tensors live at the memory
peak and the largest batch that fits; and says what the prediction does not cover. The roofline
picture is a plain SVG written from a template (no plotting dependency).
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from sftctl.compiler.hardware import Accelerator
from sftctl.compiler.ir import CONTRACTIONS, Graph
from sftctl.compiler.modes import MODES
from sftctl.compiler.step import CompiledStep


def model_flops(graph: Graph) -> float:
    """Matrix FLOPs of one step: ``2*b*m*n*k`` of every contraction plus the attention kernels'
    (flash-attention FLOPs, as :mod:`sftctl.compiler.fusion` counts them). The MFU numerator."""
    from sftctl.compiler.fusion import _gemm_dims

    total = 0.0
    for n in graph.nodes:
        if n.op in CONTRACTIONS:
            total += 2.0 * math.prod(_gemm_dims(graph, n))
    try:
        from sftctl.compiler.fusion import attention_flops, attention_shape
    except ImportError:
        return total
    seen = set()
    for n in graph.nodes:
        if n.op in ("attention", "attention_grad"):
            key = (n.op, n.inputs)
            if key not in seen:
                seen.add(key)
                total += attention_flops(attention_shape(graph, n))
    return total


def tokens_per_step(graph: Graph) -> tuple[int, str]:
    """(count, unit) of what one step consumes: the tokens of the first 2-D integer batch input
    (a language model's ids), else the samples (leading dim of the first batch input)."""
    batch = graph.inputs_with_role("batch")
    for n in batch:
        if n.type.dtype in ("int64", "int32") and len(n.type.shape) == 2:
            return n.type.numel, "tokens"
    if batch and batch[0].type.shape:
        return batch[0].type.shape[0], "samples"
    return 0, "samples"


def _peak_rate(hw: Accelerator, dtype: str, precision: str) -> float:
    if dtype == "float32" and precision == "highest":
        return hw.vector_peak("float32")
    return hw.matrix_peak(dtype)


def largest_batch(pm: dict, batch: int, capacity: int) -> int:
    """The largest batch whose peak fits ``capacity`` bytes, with activations and the batch
    scaling linearly with it and parameters, optimizer state and the reserve fixed."""
    fixed = pm["params_bytes"] + pm["opt_state_bytes"] + pm["reserve_bytes"]
    per_sample = (pm["transient_peak_bytes"] + pm["batch_bytes"]) / max(1, batch)
    if per_sample <= 0:
        return batch
    return max(0, int((capacity - fixed) // per_sample))


def not_covered(graph: Graph, compiled: CompiledStep) -> list[str]:
    """What the prediction leaves out, in words."""
    from sftctl.compiler.modes import has_grad_clip, node_phases_modules

    phase, _ = node_phases_modules(graph)
    out = [
        "Data-parallel gradient all-reduce: not in this single-device step time; `sftctl plan` adds it per offering.",
        "Data loading, host-to-device copies of the batch, logging and checkpointing.",
        "Host (Python, autograd engine) overhead beyond one dispatch per kernel: eager mode is priced as "
        "GPU-bound, each kernel taking at least the accelerator's launch overhead.",
        "Copies eager PyTorch makes for `.contiguous()` after a transpose (the trace folds them into layout).",
        "Eager and default modes price AdamW as PyTorch's default foreach implementation; `fused=True` "
        "would be fewer launches over the same bytes.",
        "Caching-allocator fragmentation beyond the fixed runtime reserve "
        f"({compiled.peak_memory['reserve_bytes'] / 2**30:.0f} GiB) in the peak memory.",
    ]
    if not has_grad_clip(graph, phase):
        out.append("Gradient clipping: the traced step has none; a script that calls clip_grad_norm_ "
                   "adds two passes over the gradients.")
    if not any(n.op in ("attention", "attention_grad") for n in graph.nodes):
        big = [n for n in graph.nodes if n.op in CONTRACTIONS and len(n.type.shape) == 4
               and n.type.shape[-1] == n.type.shape[-2] and n.type.shape[-1] >= 256]
        if big:
            out.append("Attention is traced as matmul + softmax, so its score matrices are materialized "
                       "(right for hand-written attention; SDPA's flash kernels never write them).")
    return out


def compile_doc(compiled: CompiledStep, graph: Graph, spec, hw: Accelerator, mode: str, ranks: int = 1) -> dict:
    """The JSON document of ``sftctl compile`` (plan.json and ``--json``). ``compiled`` and
    ``graph`` are one data-parallel rank's step, of ``ranks`` (the spec's nodes x accelerators
    per node): ``spec.model.batch_size // ranks`` sequences or samples.

    Keys besides the compiled step's (``kernels`` are sftensor's): ``batch_size`` (the spec's
    global batch), ``per_rank_batch`` and ``ranks``, ``mode`` (the one the spec's
    ``train.compile`` runs), ``modes`` (mode -> predicted seconds per step), ``step_time_s``
    (``modes[mode]``), ``peak_memory`` (the mode's PeakMemory fields plus ``peak_bytes``),
    ``mode_details`` (per mode: kernels, by_kind/by_phase/by_module seconds, peak memory, live
    tensors at the peak, MFU, tokens/s of the rank, largest per-rank batch that fits),
    ``model_flops``, ``fits``, ``fit_note``, ``not_covered``.
    """
    doc = compiled.to_dict()
    details = doc.pop("modes") or {}
    if "sftensor" not in details:  # a step cached before modes existed
        details["sftensor"] = {"compute_time_s": compiled.compute_time_s, "peak_memory": compiled.peak_memory,
                               "peak_bytes": compiled.peak_memory_bytes}
    flops = model_flops(graph)
    tokens, unit = tokens_per_step(graph)
    batch = spec.model.batch_size // ranks  # the rank's share, as traced
    peak_rate = _peak_rate(hw, spec.model.dtype, compiled.matmul_precision)
    for d in details.values():
        t = d["compute_time_s"]
        d["mfu"] = flops / (t * peak_rate) if t > 0 and peak_rate else 0.0
        d["model_tflops_per_s"] = flops / t / 1e12 if t > 0 else 0.0
        d[f"{unit}_per_s"] = tokens / t if t > 0 else 0.0
        d["throughput"] = {"per_s": tokens / t if t > 0 else 0.0, "unit": unit}
        d["largest_batch"] = largest_batch(d["peak_memory"], batch, hw.memory_bytes)
    chosen = details[mode] if mode in details else details["sftensor"]
    peak = chosen["peak_bytes"]
    fits = peak <= hw.memory_bytes
    lb = chosen["largest_batch"]
    fit_note = (
        f"needs {peak / 2**30:.1f} GiB in {mode} mode, {hw.name} has {hw.memory_bytes / 2**30:.0f} GiB; "
        + (f"the largest batch that fits is {lb} per rank (model.batch_size {spec.model.batch_size} is {batch} "
           f"on each of {ranks} rank(s))" if lb >= 1 else
           "not even a batch of 1 fits: parameters and optimizer state alone need sharding")
    ) if not fits else f"fits: {peak / 2**30:.1f} GiB of {hw.memory_bytes / 2**30:.0f} GiB; largest batch per rank that fits: {lb}"
    doc.update({
        "job": spec.name,
        "graph_nodes": len(graph.nodes),
        "batch_size": spec.model.batch_size,
        "per_rank_batch": batch,
        "ranks": ranks,
        "dtype": spec.model.dtype,
        "mode": mode,
        "train_compile": spec.train.compile,
        "modes": {m: details[m]["compute_time_s"] for m in MODES if m in details},
        "step_time_s": chosen["compute_time_s"],
        "peak_memory": {**chosen["peak_memory"], "peak_bytes": peak},
        "sftensor_peak_memory": compiled.peak_memory,
        "mode_details": details,
        "model_flops": flops,
        "per_step": {"count": tokens, "unit": unit},
        "fits": fits,
        "fit_note": fit_note,
        "not_covered": not_covered(graph, compiled),
        "memory_capacity_bytes": hw.memory_bytes,
    })
    return doc


def _s(x: float) -> str:
    if x < 1e-3:
        return f"{x * 1e6:.1f} us"
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.2f} s"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def render_markdown(doc: dict, hw: Accelerator) -> str:
    """report.md from :func:`compile_doc`'s document."""
    det = doc["mode_details"]
    modes = [m for m in MODES if m in det]
    mode = doc["mode"]
    unit = doc["per_step"]["unit"]
    L = [f"# {doc['job']} on {hw.name}", ""]
    L.append(f"Predicted **{_s(doc['step_time_s'])} per step in `{mode}` mode** (the spec's `train.compile: "
             f"{doc['train_compile']}`), one device, batch {doc.get('per_rank_batch', doc['batch_size'])} "
             f"({doc['per_step']['count']:,} {unit}; one of {doc.get('ranks', 1)} data-parallel rank(s)), "
             f"{doc['dtype']}, float32 matmul precision `{doc['matmul_precision']}`. "
             f"Model FLOPs per step: {doc['model_flops'] / 1e12:.2f} TFLOP (matrix work: GEMMs and attention).")
    L.append("")
    L.append(f"**Memory:** {doc['fit_note']}.")
    for note in doc.get("notes") or []:
        L += ["", f"**Note:** {note}."]
    L += ["", "## Per execution mode", "",
          f"| mode | step | kernels | peak memory | MFU | model TFLOP/s | {unit}/s | largest batch that fits |",
          "|---|---|---|---|---|---|---|---|"]
    for m in modes:
        d = det[m]
        L.append(f"| {m}{' (spec)' if m == mode else ''} | {_s(d['compute_time_s'])} | {d.get('kernels', '-')} | "
                 f"{_gib(d['peak_bytes'])} | {100 * d.get('mfu', 0):.1f}% | {d.get('model_tflops_per_s', 0):.0f} | "
                 f"{d['throughput']['per_s']:,.0f} | {d['largest_batch']} |")
    L += ["", "`eager`: one kernel per ATen op, cuBLAS GEMMs, torch's eager kernels, foreach AdamW. "
          "`default`: torch.compile (Inductor) fusion, GEMMs still cuBLAS. `sftensor`: this compiler's searched "
          "GEMMs with fused epilogues and fused memory-bound kernels. See `sftctl.compiler.modes` for sources."]
    for title, key in (("By kernel kind", "by_kind"), ("By phase", "by_phase")):
        keys = list(dict.fromkeys(k for m in modes for k in det[m].get(key, {})))
        L += ["", f"## {title}", "", "| | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        for k in keys:
            L.append(f"| {k} | " + " | ".join(_s(det[m].get(key, {}).get(k, 0.0)) for m in modes) + " |")
    mods = det[mode].get("by_module", {})
    if mods:
        total = sum(mods.values()) or 1.0
        L += ["", f"## By model module ({mode} mode; layer indices folded: `blocks.*` is every block)", "",
              "| module | time | share |", "|---|---|---|"]
        for k, v in list(mods.items())[:20]:
            L.append(f"| `{k}` | {_s(v)} | {100 * v / total:.1f}% |")
    pm = doc["peak_memory"]
    L += ["", f"## Memory at the peak ({mode} mode)", "",
          f"Peak {_gib(pm['peak_bytes'])} = parameters {_gib(pm['params_bytes'])} + optimizer state "
          f"{_gib(pm['opt_state_bytes'])} + batch {_gib(pm['batch_bytes'])} + activations, gradients and "
          f"temporaries live at the peak {_gib(pm['transient_peak_bytes'])} + runtime reserve "
          f"{_gib(pm['reserve_bytes'])}. Per mode: " + ", ".join(f"{m} {_gib(det[m]['peak_bytes'])}" for m in modes) + "."]
    live = det[mode].get("live_at_peak") or []
    if live:
        L += ["", "Largest tensors live at the peak:", "", "| size | shape | dtype | made by | module | phase |",
              "|---|---|---|---|---|---|"]
        for t in live:
            L.append(f"| {t['bytes'] / 2**20:,.0f} MiB | {t['shape']} | {t['dtype']} | {t['aten'] or t['op']} | "
                     f"`{t['module'] or '-'}` | {t.get('phase') or '-'} |")
    L += ["", "## Roofline (sftensor kernels)", "", "![roofline](roofline.svg)", "",
          f"HBM {hw.hbm_bytes_per_s / 1e12:.2f} TB/s; ridge point {hw.matrix_peak('bfloat16') / hw.hbm_bytes_per_s:.0f} "
          "FLOP/byte (bf16 matrix peak / HBM bandwidth). Each dot is a kernel; its area is its share of the step."]
    kernels = sorted(doc["kernels"], key=lambda k: -k["time_s"])
    total = doc["compute_time_s"] or 1.0
    L += ["", f"## Slowest sftensor kernels (of {len(kernels)})", "",
          "| # | kernel | time | share | bound | FLOP/byte | of roofline | schedule |", "|---|---|---|---|---|---|---|---|"]
    for k in kernels[:30]:
        cfg = " ".join(f"{a}={b}" for a, b in (k["config"] or {}).items()) or "-"
        L.append(f"| {k['index']} | {k['label']} | {_s(k['time_s'])} | {100 * k['time_s'] / total:.1f}% | "
                 f"{k['bound']} | {k['arithmetic_intensity']:.1f} | {100 * k['roofline_fraction']:.0f}% | {cfg} |")
    L += ["", "## What this prediction does not cover", ""] + [f"- {x}" for x in doc["not_covered"]]
    L += ["", f"Schedule search: {doc['candidates']:,} candidates, {doc['scored']:,} scored after pruning, "
          f"{doc['search_s']:.2f} s; compiler {doc['compiler_version']}."]
    return "\n".join(L) + "\n"


_COLORS = {"gemm": "#1f77b4", "pointwise": "#ff7f0e", "reduction": "#2ca02c", "data": "#9467bd",
           "attention": "#d62728"}


def roofline_svg(doc: dict, hw: Accelerator, width: int = 720, height: int = 460) -> str:
    """The sftensor kernels on ``hw``'s roofline (log-log: FLOP/byte vs achieved FLOP/s)."""
    left, right, top, bottom = 70, 150, 30, 50
    pw, ph = width - left - right, height - top - bottom
    x0, x1 = -2.0, 4.0  # log10 FLOP/byte
    peak = max(hw.matrix_flops_per_s.values())
    y1 = math.log10(peak) + 0.3
    y0 = y1 - 6.0

    def X(v: float) -> float:
        return left + (min(max(math.log10(max(v, 1e-30)), x0), x1) - x0) / (x1 - x0) * pw

    def Y(v: float) -> float:
        return top + ph - (min(max(math.log10(max(v, 1e-30)), y0), y1) - y0) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13" font-weight="bold">{html.escape(doc["job"])} on {html.escape(hw.name)}: '
           f'sftensor kernels on the roofline</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for e in range(int(x0), int(x1) + 1):
        out.append(f'<line x1="{X(10**e):.1f}" y1="{top}" x2="{X(10**e):.1f}" y2="{top + ph}" stroke="#eee"/>')
        out.append(f'<text x="{X(10**e):.1f}" y="{top + ph + 15}" text-anchor="middle">1e{e}</text>')
    for e in range(math.ceil(y0), math.floor(y1) + 1):
        out.append(f'<line x1="{left}" y1="{Y(10**e):.1f}" x2="{left + pw}" y2="{Y(10**e):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 5}" y="{Y(10**e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 12}" text-anchor="middle">arithmetic intensity (FLOP/byte)</text>')
    out.append(f'<text x="16" y="{top + ph / 2}" transform="rotate(-90 16 {top + ph / 2})" text-anchor="middle">'
               f'achieved FLOP/s</text>')
    bw = hw.hbm_bytes_per_s
    roofs = sorted({(k, v) for k, v in list(hw.matrix_flops_per_s.items()) + [("vector fp32", hw.vector_peak("float32"))]
                    if k in ("bfloat16", "float32", "vector fp32")}, key=lambda kv: -kv[1])
    for name, rate in roofs:
        ridge = rate / bw
        out.append(f'<polyline fill="none" stroke="#444" stroke-width="1.5" points="{X(10**x0):.1f},{Y(bw * 10**x0):.1f} '
                   f'{X(ridge):.1f},{Y(rate):.1f} {X(10**x1):.1f},{Y(rate):.1f}"/>')
        label = {"bfloat16": "bf16 matrix", "float32": "tf32 matrix", "vector fp32": "fp32 vector"}.get(name, name)
        out.append(f'<text x="{left + pw + 4}" y="{Y(rate) + 4:.1f}">{html.escape(label)} {rate / 1e12:.0f} TF/s</text>')
    total = doc["compute_time_s"] or 1.0
    for k in sorted(doc["kernels"], key=lambda k: -k["time_s"]):
        if k["time_s"] <= 0 or k["bytes"] <= 0:
            continue
        achieved = k["flops"] / k["time_s"]
        r = max(1.5, 40 * math.sqrt(k["time_s"] / total))
        kind = k["kind"]
        out.append(f'<circle cx="{X(k["arithmetic_intensity"]):.1f}" cy="{Y(achieved):.1f}" r="{r:.1f}" '
                   f'fill="{_COLORS.get(kind, "#7f7f7f")}" fill-opacity="0.45" stroke="{_COLORS.get(kind, "#7f7f7f")}">'
                   f'<title>{html.escape(k["label"])}: {k["time_s"] * 1e6:.1f} us</title></circle>')
    for i, (kind, color) in enumerate(_COLORS.items()):
        y = top + ph - 80 + i * 15
        out.append(f'<circle cx="{left + pw + 10}" cy="{y}" r="5" fill="{color}" fill-opacity="0.6"/>')
        out.append(f'<text x="{left + pw + 20}" y="{y + 4}">{kind}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_report(doc: dict, hw: Accelerator, out: Path) -> None:
    """Write report.md and roofline.svg into ``out``."""
    out = Path(out)
    (out / "report.md").write_text(render_markdown(doc, hw))
    (out / "roofline.svg").write_text(roofline_svg(doc, hw))
