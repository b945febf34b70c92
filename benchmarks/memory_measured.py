"""Predicted against measured peak memory of real training steps (issue 35.5).

    python benchmarks/memory_measured.py      # prints the table, writes results/memory_measured.json

Each row runs one step of a small zoo-style model (MLP, CNN, GPT-2 and BERT from ``transformers``
with eager, SDPA and SDPA's math-path attention) on the CPU, measured by
:func:`sftctl.compiler.memory_check.measured_peak` (torch profiler, 512-byte blocks, dropout as
CUDA's ``native_dropout``, AdamW foreach), against the eager mode's predicted peak less the stated
CUDA context (the cases and models of ``tests/test_memory_measured.py``). The peer is the
measurement in the same run; the ratio is predicted / measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MIB = 2**20


def main() -> int:
    import torch

    from sftctl.compiler.memory_check import measured_peak
    from test_memory_measured import CASES, MODELS, _predicted

    rows = []
    for name, batch, dtype in CASES:
        make, make_batch, loss_fn = MODELS[name]
        torch.manual_seed(0)
        model, b = make(), make_batch(batch)
        predicted = _predicted(model, b, loss_fn, dtype, "math" if name.endswith("-math") else None)
        got = measured_peak(model, b, loss_fn, getattr(torch, dtype) if dtype else None)
        rows.append({"model": name, "batch": batch, "dtype": dtype or "float32", "predicted_mib": predicted / MIB,
                     "measured_mib": got.total_bytes / MIB, "measured_resident_mib": got.resident_bytes / MIB,
                     "ratio": predicted / got.total_bytes})
        r = rows[-1]
        print(f"{name:11s} batch {batch:3d} {r['dtype']:8s}: predicted {r['predicted_mib']:8.2f} MiB, measured "
              f"{r['measured_mib']:8.2f} MiB (resident {r['measured_resident_mib']:.2f}): {r['ratio']:.3f}", flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"predicted / measured: {min(ratios):.3f} - {max(ratios):.3f} over {len(rows)} steps")
    out = ROOT / "benchmarks" / "results" / "memory_measured.json"
    out.write_text(json.dumps({"rows": rows, "min_ratio": min(ratios), "max_ratio": max(ratios)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
