"""Checkpoint write time: rank 0's single file (``sftctl.train.save_checkpoint``) next to sharded
DCP (``sftctl.train.save_sharded_checkpoint``), for the quickstart's model, side by side in one
run under ``torch.distributed.run`` with 2 CPU processes (gloo), as the quickstart runs.

Three ways, interleaved round by round (so a busy machine slows all of them alike), each round
timed on rank 0 from a barrier to the checkpoint being complete on every rank (a barrier after):

* ``single-file (ddp)``: DDP model; rank 0 ``torch.save``s the model and AdamW state, fsync, rename.
* ``dcp (ddp)``: the same DDP model through DCP (replicated tensors are written once, split
  between the ranks by DCP's deduplication).
* ``dcp (fsdp)``: the model sharded by FSDP2; each rank writes its own half.

    python benchmarks/checkpoint_dcp.py                 # the quickstart's GPT (0.8 M parameters)
    python benchmarks/checkpoint_dcp.py --n-embd 512    # a bigger one (about 13 M)
Writes benchmarks/results/checkpoint_dcp.json (checkpoint_dcp-n_embdN.json for another width):
the median of ``--rounds`` rounds per way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples" / "gpt"))
    from model import GPT, GPTConfig

    from sftctl import settings
    from sftctl import train as sft

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(n_embd=args.n_embd)

    def build(par: str):
        torch.manual_seed(0)
        model = GPT(cfg)
        sft.prepare(model, parallelism=par, dtype="float32")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():  # AdamW state exists after a step
            p.grad = torch.zeros_like(p)
        opt.step()
        return model, opt

    ddp_model, ddp_opt = build("ddp")
    fsdp_model, fsdp_opt = build("fsdp")
    n_params = sum(p.numel() for p in ddp_model.parameters())
    times: dict[str, list[float]] = {"single-file (ddp)": [], "dcp (ddp)": [], "dcp (fsdp)": []}
    sizes: dict[str, int] = {}
    root = Path(settings.get("SFTCTL_CHECKPOINT_DIR"))
    for r in range(args.rounds):
        for way in times:
            dist.barrier()
            t0 = time.perf_counter()
            step = r * 10 + list(times).index(way) + 1
            if way == "single-file (ddp)":
                if rank == 0:
                    sft.save_checkpoint({"model": ddp_model.state_dict(), "optimizer": ddp_opt.state_dict(),
                                         "step": step}, step, keep=1)
            elif way == "dcp (ddp)":
                sft.save_sharded_checkpoint(ddp_model, ddp_opt, step, keep=1)
            else:
                sft.save_sharded_checkpoint(fsdp_model, fsdp_opt, step, keep=1)
            dist.barrier()
            times[way].append(time.perf_counter() - t0)
            if rank == 0:
                sizes[way] = sum(f.stat().st_size for f in (root / f"step-{step:08d}").iterdir())
    if rank == 0:
        print(json.dumps({"params": n_params, "times": times, "bytes": sizes}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SFTCTL_")}
        env.update(SFTCTL_CHECKPOINT_DIR=tmp, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               __file__, "--worker", "--rounds", str(args.rounds), "--n-embd", str(args.n_embd)],
                              env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    med = {way: statistics.median(ts) for way, ts in got["times"].items()}
    base = med["single-file (ddp)"]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "model": f"examples/gpt GPTConfig(n_embd={args.n_embd})", "params": got["params"], "ranks": 2,
        "rounds": args.rounds, "median_s": med, "checkpoint_bytes": got["bytes"],
        "ratio_to_single_file": {way: t / base for way, t in med.items()},
        "all_s": got["times"],
    }
    print(json.dumps({k: result[k] for k in ("params", "median_s", "checkpoint_bytes", "ratio_to_single_file")}, indent=1))
    name = "checkpoint_dcp.json" if args.n_embd == 128 else f"checkpoint_dcp-n_embd{args.n_embd}.json"
    (REPO / "benchmarks" / "results" / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
