"""Train the byte-level GPT of model.py on the Python standard library's sources.

Run on every node under torchrun, from the repository root, e.g.::

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=JOB examples/gpt/train.py

or single-process without torchrun (``python examples/gpt/train.py``).

Settings come from ``sftctl.train.config()`` (``SFTCTL_TRAIN_STEPS``, ``SFTCTL_BATCH_SIZE``,
``SFTCTL_CHECKPOINT_INTERVAL``, ``SFTCTL_DTYPE``, ...); metrics go to ``$SFTCTL_METRICS_DIR`` and
checkpoints to ``$SFTCTL_CHECKPOINT_DIR`` (see sftctl/train.py). The run resumes from the newest
complete checkpoint if there is one.

``SFTCTL_PARALLELISM`` (``ddp``/``fsdp``, from the plan) picks the strategy through
``sftctl.train.prepare``; under FSDP checkpoints are sharded (``save_sharded_checkpoint``).

``SFTCTL_COMPILE`` picks how the step runs: ``none`` (default, eager), ``default``
(``torch.compile``) or ``sftensor`` (``torch.compile(backend="sftensor")``, sftctl's search
compiler; eager with a warning on a CPU).

Test knobs: ``SFTCTL_FAIL_AT_STEP=N`` makes rank 0 raise RuntimeError at step N (after that step's
checkpoint, if any, is saved) unless the run resumed from a checkpoint; ``SFTCTL_SLOW_NODE``,
``SFTCTL_SLOW_FACTOR`` and ``SFTCTL_SLOW_FROM_STEP`` make one node's forward pass slower (a
straggler).

``LR`` sets the peak learning rate (default 3e-3; the README's Python API sweep varies it).
"""

from __future__ import annotations

import contextlib
import gc
import math
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

from model import GPT, GPT2_SMALL, GPTConfig, get_batch, load_corpus, next_byte_loss  # script dir

SEED = 1337
MAX_LR = float(os.environ.get("LR") or 3e-3)  # peak learning rate; the README's Python sweep sets LR
MIN_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
VAL_FRACTION = 0.05
VAL_BATCHES = 8
LOG_EVERY = 10


def lr_at(step: int, total_steps: int) -> float:
    """Learning rate for 1-based ``step``: linear warmup, then cosine decay to MIN_LR_FRACTION."""
    warmup = max(1, min(30, total_steps // 10))
    if step <= warmup:
        return MAX_LR * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return MAX_LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_generator(rank: int, step: int, salt: int = 0) -> torch.Generator:
    """A generator seeded only by (rank, step), so a resumed run draws the same batches."""
    return torch.Generator().manual_seed(SEED + 1_000_003 * step + 7919 * rank + 104_729 * salt)


COMPILE_MODES = ("none", "default", "sftensor")


def compile_model(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` as ``SFTCTL_COMPILE`` asks: ``none`` (default: eager), ``default``
    (``torch.compile`` with Inductor) or ``sftensor`` (``torch.compile(backend="sftensor")``: the
    search compiler's Triton GEMMs; on a CPU it warns once and runs eager).

    Raises:
        ValueError: any other value.
    """
    mode = settings.get("SFTCTL_COMPILE").lower()
    if mode not in COMPILE_MODES:
        raise ValueError(f"SFTCTL_COMPILE must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "none":
        return module
    if mode == "default":
        return torch.compile(module)
    import sftctl.compiler  # noqa: F401  (registers the backend when the entry point is not installed)

    return torch.compile(module, backend="sftensor")


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``sftctl.train.prepare`` sharded ``module`` with FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def main() -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    distributed = world_size > 1

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if distributed:
        dist.init_process_group(backend=backend)
    try:
        train(rank, world_size, device, distributed)
        if distributed:
            # DDP's reducer sits in reference cycles: collect it (and the gloo work it holds)
            # while the process group is alive, not during teardown or interpreter exit, where
            # gloo's worker threads abort the process (pytorch/pytorch#179291 describes the exit case)
            gc.collect()
        # every rank: barrier (destroying the group while a peer still talks to it aborts the
        # process), destroy the process group, exit 0 without the interpreter's finalization,
        # which gloo's worker threads can race into "terminate called without an active
        # exception" (SIGABRT) and a finished run into a failed attempt (sftctl.train.finish)
        sft.finish()
    finally:  # an exception: the group goes, the exception reaches torchelastic's error file
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def train(rank: int, world_size: int, device: torch.device, distributed: bool) -> None:
    cfg = sft.config()
    is_main = rank == 0
    fail_at = settings.get("SFTCTL_FAIL_AT_STEP")
    # test knob: on node SFTCTL_SLOW_NODE (its first node only), the forward pass takes
    # SFTCTL_SLOW_FACTOR times longer from step SFTCTL_SLOW_FROM_STEP on (a throttled GPU)
    slow = (settings.get("SFTCTL_SLOW_NODE") == settings.get("SFTCTL_NODE_RANK")
            and settings.get("SFTCTL_NODE_GENERATION") == 0)
    slow_factor = settings.get("SFTCTL_SLOW_FACTOR") if slow else 1.0
    slow_from = settings.get("SFTCTL_SLOW_FROM_STEP")

    data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8)
    n_val = int(len(data) * VAL_FRACTION)
    train_data, val_data = data[:-n_val], data[-n_val:]

    # the job spec's model.entrypoint names the model the compiler planned for: train that one
    entry_fn = (settings.get("SFTCTL_MODEL_ENTRYPOINT") or "model.py:build").rsplit(":", 1)[-1]
    mcfg = {"build": GPTConfig(), "build_gpt2_small": GPT2_SMALL}.get(entry_fn, GPTConfig())
    torch.manual_seed(SEED)  # same init on every rank (DDP also broadcasts rank 0's weights)
    model = GPT(mcfg).to(device)
    # the strategy the plan chose (SFTCTL_PARALLELISM): DDP, or FSDP2 sharding `model` in place
    wrapped = sft.prepare(model)
    sharded = is_sharded(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=MAX_LR,
        betas=(0.9, 0.95),
    )

    start_step = 0
    # Rank 0 reads the checkpoint and hands it to the others, so all ranks resume from the same
    # step even when each node has its own checkpoint directory.
    # Sharded, or the newest checkpoint is a sharded one (an FSDP run resumed elastically on fewer
    # ranks, unsharded now): every rank loads through DCP, which reshards onto this world size.
    dcp_found = is_main and (sft.latest_checkpoint() or Path("/nonexistent")).joinpath(sft.DCP_METADATA).is_file()
    if distributed and not sharded:
        box = [dcp_found]
        dist.broadcast_object_list(box, src=0)
        dcp_found = box[0]
    if sharded or dcp_found:
        resumed = sft.load_sharded_checkpoint(model, optimizer)
    else:
        resumed = sft.load_latest_checkpoint(map_location="cpu") if is_main else None
        if distributed:
            box = [resumed]
            dist.broadcast_object_list(box, src=0)
            resumed = box[0]
    if resumed is not None:
        start_step, state = resumed
        if not (sharded or dcp_found):
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        if is_main:
            print(f"resumed from step {start_step}", flush=True)

    ddp_model = compile_model(wrapped)
    amp_dtype = getattr(torch, cfg.dtype)
    autocast = (
        torch.autocast(device_type=device.type, dtype=amp_dtype)
        if amp_dtype != torch.float32
        else contextlib.nullcontext()
    )
    if is_main:
        print(
            f"world_size {world_size} params {model.num_params()} steps {cfg.steps} "
            f"batch {cfg.batch_size}/rank x {cfg.grad_accum} accumulated block {mcfg.block_size} dtype {cfg.dtype} "
            f"train bytes {len(train_data)} val bytes {len(val_data)}",
            flush=True,
        )

    # after an elastic resume on fewer nodes (recovery.min_nodes) each rank runs the micro-batches
    # of cfg.grad_accum planned ranks ("virtual ranks"), so the global batch stays the same
    accum = cfg.grad_accum
    tokens_per_step = cfg.batch_size * mcfg.block_size * accum
    first_loss = last_loss = None
    model.train()
    for step in range(start_step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.steps)
        optimizer.zero_grad(set_to_none=True)
        compute_time_s = 0.0
        loss_f = 0.0
        for micro in range(accum):
            x, y = get_batch(train_data, cfg.batch_size, mcfg.block_size, batch_generator(rank * accum + micro, step))
            x, y = x.to(device), y.to(device)
            t_fwd = time.perf_counter()
            with autocast:
                loss = next_byte_loss(ddp_model, (x, y)) / accum
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if slow_factor > 1 and step >= slow_from:  # test knob: this node's "GPU" is slow
                time.sleep((time.perf_counter() - t_fwd) * (slow_factor - 1))
            # the forward pass runs no collective, so its time shows this rank's own speed; the whole
            # step's time does not (under DDP every rank waits for the slowest in the all-reduce)
            compute_time_s += time.perf_counter() - t_fwd
            loss.backward()
            loss_f += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        step_time_s = time.perf_counter() - t0
        sft.report(step, loss_f, step_time_s=step_time_s, tokens_per_s=tokens_per_step / step_time_s,
                   compute_time_s=compute_time_s, lr=optimizer.param_groups[0]["lr"])
        if first_loss is None:
            first_loss = loss_f
        last_loss = loss_f
        if not math.isfinite(loss_f):
            raise RuntimeError(f"rank {rank}: loss is {loss_f} at step {step}")

        if is_main and (step % LOG_EVERY == 0 or step == start_step + 1 or step == cfg.steps):
            print(f"step {step}/{cfg.steps} loss {loss_f:.4f} ({step_time_s * 1000:.0f} ms)", flush=True)

        if step % cfg.checkpoint_interval == 0 or step == cfg.steps:
            if sharded:  # every rank writes its shards (torch.distributed.checkpoint)
                path = sft.save_sharded_checkpoint(model, optimizer, step)
                if is_main:
                    print(f"saved checkpoint {path}", flush=True)
            elif is_main:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                path = sft.save_checkpoint(state, step)
                print(f"saved checkpoint {path}", flush=True)
            if distributed:
                dist.barrier()

        if fail_at and step == fail_at and resumed is None and is_main:
            raise RuntimeError(f"SFTCTL_FAIL_AT_STEP={fail_at}: failing on purpose at step {step}")

    val_loss = evaluate(model, val_data, mcfg, cfg.batch_size, rank, world_size, device, autocast)
    if is_main:
        if first_loss is None:
            print(f"nothing to do: already at step {start_step}/{cfg.steps}", flush=True)
        else:
            # rank 0's own batches; `sftctl status` shows the mean over the ranks' latest losses
            print(f"rank 0: first loss {first_loss:.4f} last loss {last_loss:.4f} (this rank's batches; "
                  "sftctl status: mean over ranks)", flush=True)
        print(f"val loss {val_loss:.4f}", flush=True)


@torch.no_grad()
def evaluate(model, val_data, mcfg, batch_size, rank, world_size, device, autocast) -> float:
    """Mean next-byte loss on VAL_BATCHES fixed held-out batches per rank, averaged over ranks."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(VAL_BATCHES):
        x, y = get_batch(val_data, batch_size, mcfg.block_size, batch_generator(rank, i, salt=1))
        with autocast:
            total += next_byte_loss(model, (x.to(device), y.to(device))).double()
    model.train()
    if world_size > 1:
        dist.all_reduce(total)
    return total.item() / (VAL_BATCHES * world_size)


if __name__ == "__main__":
    main()
