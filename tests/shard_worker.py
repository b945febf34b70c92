"""A training run under torch.distributed.run for tests/test_fsdp.py: the example GPT (2 blocks)
wrapped by sftctl.train.prepare as SFTCTL_PARALLELISM says, AdamW, sharded (DCP) checkpoints.

The global batch is GLOBAL_BATCH sequences a step, drawn from a generator seeded by the step
alone; each rank takes its rows in micro-batches of MICRO sequences and accumulates gradients,
so any world size dividing GLOBAL_BATCH / MICRO trains on the same global batch.

Environment: WORKER_OUT (directory for results), WORKER_STEPS (last step), WORKER_STOP_AT (stop
after this step, as if the node were lost), SFTCTL_PARALLELISM, SFTCTL_CHECKPOINT_DIR,
SFTCTL_CHECKPOINT_INTERVAL, SFTCTL_KEEP_CHECKPOINTS.
Writes (rank 0): losses.json {step: mean loss over the global batch}, params-<step>.pt (full
parameters after that step's checkpoint, and after loading: params-loaded.pt), resumed.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "gpt"))
from model import GPT, GPTConfig, next_byte_loss  # noqa: E402

from sftctl import settings  # noqa: E402
from sftctl import train as sft  # noqa: E402

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH, MICRO, LR = 4, 1, 1e-2


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(CFG)


def full_params(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in sd.items()}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(os.environ["WORKER_OUT"])
    steps = int(os.environ["WORKER_STEPS"])
    stop_at = int(os.environ.get("WORKER_STOP_AT", steps))
    interval = settings.get("SFTCTL_CHECKPOINT_INTERVAL")
    accum = GLOBAL_BATCH // (MICRO * world)
    model = sft.prepare(build())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    start = 0
    got = sft.load_sharded_checkpoint(model, opt)
    if got is not None:
        start = got[0]
        p = full_params(model)
        if rank == 0:
            torch.save(p, out / "params-loaded.pt")
            (out / "resumed.json").write_text(json.dumps({"step": start, "world": world, "accum": accum,
                                                          "extra": got[1]}))
    losses = {}
    for step in range(start + 1, stop_at + 1):
        x, y = global_batch(step)
        total = torch.zeros(())
        for i in range(accum):
            lo = (rank * accum + i) * MICRO
            loss = next_byte_loss(model, (x[lo:lo + MICRO], y[lo:lo + MICRO])) / accum
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses[step] = total.item() / world
        if step % interval == 0:
            sft.save_sharded_checkpoint(model, opt, step, extra={"data_step": step})
            p = full_params(model)
            if rank == 0:
                torch.save(p, out / f"params-{step}.pt")
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
        (out / "strategy.json").write_text(json.dumps({"type": type(model).__name__,
                                                       "fsdp": "FSDP" in type(model).__name__}))
    sft.finish()  # barrier, destroy, then os._exit: gloo's threads can abort a normal exit (torch #190489)


if __name__ == "__main__":
    main()
