"""Predict measured kernel records: ``python -m sftctl.compiler.predict --target ACCEL``.

Reads JSON lines on stdin in the record format of the H200 calibration set
(``calibrations/data/h200/README.md``, the team's measurements, copied verbatim), writes the same records
with ``predicted_s`` (seconds; null where the model says the config cannot run) on stdout, one
line per input line, in order. Kernels, as written in ``calibrations/data/h200/kernels.py``:

* ``gemm``: ``mm_kernel``, bf16/fp16/fp32 A (M x K row-major) @ B (K x N row-major), config
  ``BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages`` and ``GROUP_M`` (default 1);
* ``layernorm`` / ``softmax``: ``layernorm_fwd`` / ``softmax_fwd`` over ``M x N``, config
  ``ROWS`` (default 1), ``BLOCK_N`` (default ``next_power_of_2(N)``), ``num_warps``;
* ``bias_gelu``: over ``M x N`` elements, config ``BLOCK``, ``num_warps``.

Three more record kinds, predicted as the compiler prices them in a step:

* a collective of XLA's measured table (``calibrations/data/xla/collectives.jsonl``, as written:
  a record with ``opcode``, ``group_size``, ``input_bytes_per_device``,
  ``output_bytes_per_device``), on the 8-GPU host of the target (:mod:`sftctl.compiler.collectives`);
* a library GEMM of XLA's measured table (``data/provenance/xla/matmul.jsonl``, as written: a record
  with ``b, m, n, k`` and ``dtype`` such as ``bf16xbf16->bf16``, no ``kernel``; ``time_s`` and
  ``flops_per_s`` are not read): cuBLAS / hipBLASLt GPU time on the target, no host launch
  (:func:`sftctl.compiler.gemm_table.predict_record`);
* ``{"kernel": "attention", "batch", "heads", "kv_heads", "q_len", "kv_len", "head_dim",
  "causal", "dtype", "direction": "forward" | "backward"}``: torch SDPA's kernel on the target
  (:mod:`sftctl.compiler.attention`).

Registers and spills come from ptxas: the shipped table of the calibration configs
(``calibrations/data/h200/resources_sm90.json``), else an offline Triton compile of the reference
kernel for the accelerator's target (disk-cached; needs ``triton``; ``--no-compile`` skips it),
else the model's estimate (:mod:`sftctl.compiler.records` does the work). Coefficients: the
target's (:func:`sftctl.compiler.target.load_target`: the shipped calibration for that
accelerator), or ``--coefficients FILE`` (a calibration JSON).

Bad input (not JSON, unknown kernel, missing or non-positive sizes, a config missing a key):
one line ``predict: line N: ...`` on stderr and exit code 2; nothing partial is trusted, so
nothing is written for any line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from sftctl.compiler.calibrated import load_coefficients
from sftctl.compiler.records import RecordError, normalize, predict_records, resources_for
from sftctl.compiler.target import load_target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sftctl.compiler.predict", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="catalog accelerator, e.g. h200, h100")
    ap.add_argument("--coefficients", help="a calibration JSON (default: the shipped one for the target)")
    ap.add_argument("--no-compile", action="store_true",
                    help="do not compile unknown configs with Triton for their ptxas registers/spills")
    args = ap.parse_args(argv)

    try:
        target = load_target(args.target)
    except KeyError as e:
        print(f"predict: --target: {e.args[0]}", file=sys.stderr)
        return 2
    hw = target.hw
    if args.coefficients:
        try:
            target = target.with_coeffs(load_coefficients(Path(args.coefficients), hw))
        except (OSError, ValueError) as e:
            print(f"predict: --coefficients: {e}", file=sys.stderr)
            return 2

    from sftctl.compiler import attention, collectives, gemm_table

    raw, recs, direct = [], [], {}  # direct: line index -> seconds of a collective / attention record
    for n, line in enumerate(sys.stdin, start=1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            what = "empty line" if not line.strip() else f"not JSON ({e.msg} at column {e.colno})"
            print(f"predict: line {n}: {what}; give one JSON record per line", file=sys.stderr)
            return 2
        try:
            if isinstance(rec, dict) and "opcode" in rec:
                direct[len(raw)] = collectives.predict_record(rec, target.name)
            elif isinstance(rec, dict) and "kernel" not in rec and {"m", "n", "k"} <= rec.keys():
                direct[len(raw)] = gemm_table.predict_record(rec, hw)
            elif isinstance(rec, dict) and rec.get("kernel") == "attention":
                direct[len(raw)] = attention.predict_record(rec, target)
            else:
                recs.append(normalize(rec))
        except (RecordError, ValueError) as e:
            print(f"predict: line {n}: {e}", file=sys.stderr)
            return 2
        raw.append(rec)
    res = [resources_for(r["kernel"], r["config"], hw, r["dtype"], compile=not args.no_compile) for r in recs]
    kernel_times = iter(predict_records(recs, target, res))
    times = [direct[i] if i in direct else next(kernel_times) for i in range(len(raw))]
    w = sys.stdout
    try:
        for rec, t in zip(raw, times):
            w.write(json.dumps(dict(rec, predicted_s=t if math.isfinite(t) else None)) + "\n")
        w.flush()
    except BrokenPipeError:  # the reader stopped early (| head): not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
