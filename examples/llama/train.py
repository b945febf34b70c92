"""Train the Llama-style model of model.py (transformers' LlamaForCausalLM) as the plan says:
``sftctl.train.prepare`` wraps it (DDP, or FSDP2 per decoder layer + root; activation
checkpointing), checkpoints are sharded (``torch.distributed.checkpoint``) and a run resumes from
the newest complete one on any number of ranks.

    torchrun --nproc-per-node=2 examples/llama/train.py         # the CPU-sized shape (build)
    SFTCTL_MODEL_ENTRYPOINT=examples/llama/model.py:build_tinyllama torchrun ... # TinyLlama-1.1B shape

Data: counting sequences (token t+1 = token t + 1 mod vocab, a random start: learnable in a few
steps) drawn from a generator seeded by (virtual rank, step), so a resumed
or elastic run (``SFTCTL_GRAD_ACCUM`` > 1) trains on the same global batch. Settings from
``sftctl.train.config()`` (SFTCTL_TRAIN_STEPS, SFTCTL_BATCH_SIZE, SFTCTL_DTYPE, ...).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    from sftctl import train as sft
except ImportError:  # running from a checkout where sftctl is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from sftctl import train as sft
from sftctl import settings  # every SFTCTL_* variable, typed

import model as llama  # script dir


def main() -> None:
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
    cfg = sft.config(steps=20, batch_size=2, checkpoint_interval=10)
    entry = (settings.get("SFTCTL_MODEL_ENTRYPOINT") or "model.py:build").rsplit(":", 1)[-1]
    shape = llama.TINYLLAMA if entry == "build_tinyllama" else llama.TINY
    model, _, loss_fn = llama._build(shape, 1, "float32")  # fp32 master weights; prepare() casts for compute
    model.to(device)
    model = sft.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    got = sft.load_sharded_checkpoint(model, optimizer)
    start = got[0] if got else 0
    if got and rank == 0:
        print(f"resumed from step {start}", flush=True)
    seq, vocab, accum = shape["max_position_embeddings"], shape["vocab_size"], cfg.grad_accum
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        loss_f = 0.0
        for micro in range(accum):
            g = torch.Generator().manual_seed(7919 * step + rank * accum + micro)
            start_tok = torch.randint(0, vocab, (cfg.batch_size, 1), generator=g)
            ids = ((start_tok + torch.arange(seq)) % vocab).to(device)  # counting: learnable
            loss = loss_fn(model, {"input_ids": ids, "labels": ids}) / accum
            loss.backward()
            loss_f += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        sft.report(step, loss_f, step_time_s=dt, tokens_per_s=cfg.batch_size * seq * accum / dt)
        if rank == 0:
            print(f"step {step}/{cfg.steps} loss {loss_f:.4f}", flush=True)
        if step % cfg.checkpoint_interval == 0 or step == cfg.steps:
            path = sft.save_sharded_checkpoint(model, optimizer, step)
            if rank == 0:
                print(f"saved checkpoint {path}", flush=True)
    # every rank: barrier, destroy the process group, exit 0 without the interpreter's
    # finalization, which gloo's worker threads can race into an abort (sftctl.train.finish)
    sft.finish()


if __name__ == "__main__":
    main()
