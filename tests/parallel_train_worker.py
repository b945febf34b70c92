"""One rank of a multi-process CPU (gloo) training run for tests/test_parallel_train.py: the tiny
Llama (or tiny MoE) of sftctl.train.tiny trained in float64 with AdamW under the layout the
SFTCTL_TP / PP / CP / EP / DP / MICRO_BATCHES environment gives, as a job's script does:
sftctl.train.prepare (which applies sftctl.train.parallel; DDP for data alone; for pipeline
stages, given the loss, sftctl.train.pipeline.build_pipeline), and context_parallel around the forward. Every rank builds the same initial model
(seed 0) and draws the same global batches (seed 1); each trains on its data rank's rows (and,
under context parallelism, its slice of the sequence). Rank 0 writes OUT (JSON): the step losses
(the mean over the global batch), and, from a single-process unsplit run of the same model on the
whole batches, the reference losses.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p SFTCTL_TP=2 SFTCTL_DP=2 \
        python tests/parallel_train_worker.py OUT [--moe] [--steps N] [--first S] [--save DIR] [--load DIR]

``--first S``: this run trains steps S .. S+N-1 (draws the batches of those steps). ``--save DIR``:
a DCP checkpoint (sftctl.train.save_sharded_checkpoint) after the last step; ``--load DIR``: resume
from the newest one before the first step (any layout wrote it).
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import forked as fork_ranks  # tests/_ranks.py: this script's folder is on sys.path

from sftctl.train import mesh as M
from sftctl.train import prepare
from sftctl.train.parallel import layout_mesh
from sftctl.train.tiny import tiny_llama


BATCH, SEQ, VOCAB, LR = 8, 16, 64, 1e-2


def batches(first: int, steps: int):
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(first + steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        targets = (tokens + 1) % VOCAB  # learnable in a few steps: the loss falls
        if step >= first:
            out.append((tokens, targets))
    return out


def make_model(moe: bool):
    sizes = dict(vocab=VOCAB, max_seq=SEQ)
    if moe:
        sizes.update(n_experts=4, top_k=2, n_layers=2)
    return tiny_llama(seed=0, **sizes)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference(moe: bool, steps: int) -> list:
    model = make_model(moe)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens, targets in batches(0, steps):
        opt.zero_grad()
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def state_bytes(model, opt) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state (its local shards of
    DTensors; FSDP2's padding excluded)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = [local(p) for p in model.parameters()]
    out = {"params": sum(t.numel() * t.element_size() for t in params),
           "grads": sum(local(p.grad).numel() * local(p.grad).element_size()
                        for p in model.parameters() if p.grad is not None),
           "optim": 0}
    for st in opt.state.values():
        for name, v in st.items():
            if torch.is_tensor(v) and name != "step":
                out["optim"] += local(v).numel() * local(v).element_size()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--save")
    ap.add_argument("--load")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))  # a lost rank fails, not hangs 30 min
    lay = M.layout()
    mesh = layout_mesh(lay)
    model = make_model(args.moe)
    pipe = None
    if lay.pp > 1:  # what a script with train.pipeline: true does: prepare() builds the stages
        pipe = prepare(model, loss_fn=loss_fn)
        model = pipe.module
    else:  # what a job's script does: the plan's layout from SFTCTL_*, or DDP/FSDP for data alone
        model = prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if args.load:
        from sftctl.train import load_sharded_checkpoint

        os.environ["SFTCTL_CHECKPOINT_DIR"] = args.load
        assert load_sharded_checkpoint(model, opt) is not None
    times["setup_s"] = time.perf_counter() - t0  # process group, mesh, model, split
    data_rank = M.data_mesh(mesh).get_local_rank()
    n_data = lay.dp * lay.cp
    dp_rank, rows = mesh["dp"].get_local_rank(), BATCH // lay.dp
    losses = []
    for tokens, targets in batches(args.first, args.steps):
        tokens, targets = tokens[dp_rank * rows:(dp_rank + 1) * rows], targets[dp_rank * rows:(dp_rank + 1) * rows]
        opt.zero_grad()
        if pipe is not None:
            local = torch.tensor(pipe.step(tokens, targets), dtype=torch.float64)
        else:
            from sftctl.train.context_parallel import context_parallel, shard_sequence

            with context_parallel(model, mesh["cp"], seq_len=SEQ):
                logits = model(shard_sequence(tokens, mesh["cp"]))
            loss = loss_fn(logits, shard_sequence(targets, mesh["cp"]))
            loss.backward()
            local = loss.detach()
        opt.step()
        # the step's loss over the global batch: the mean of the data ranks' equal-sized parts
        total = local.reshape(1).clone()
        dist.all_reduce(total, group=M.data_mesh(mesh).get_group())
        losses.append(float(total) / n_data)
    times["train_s"] = time.perf_counter() - t0 - times["setup_s"]
    if args.save:
        from sftctl.train import save_sharded_checkpoint

        os.environ["SFTCTL_CHECKPOINT_DIR"] = args.save
        save_sharded_checkpoint(model, opt, args.first + args.steps)
    held = state_bytes(model, opt)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    if dist.get_rank() == 0:
        t = time.perf_counter()
        doc = {"losses": losses, "layout": lay.label, "data_rank": data_rank,
               "schedule": type(pipe.schedule).__name__ if pipe else None,
               "ref_losses": reference(args.moe, args.first + args.steps)[args.first:]}
        doc["times"] = {**times, "reference_s": time.perf_counter() - t}
        doc["rank_bytes"] = every
        doc["model_bytes"] = sum(p.numel() * p.element_size() for p in make_model(args.moe).parameters())
        with open(args.out, "w") as f:
            json.dump(doc, f)
    dist.destroy_process_group()


def forked(world: int) -> int:
    """Fork ``world`` ranks running :func:`main` (tests/_ranks.py), torch's distributed modules
    imported once, before the fork. Returns the first non-zero child status, else 0."""
    import torch.distributed.checkpoint  # imported once, before the fork
    import torch.distributed.fsdp
    import torch.distributed.pipelining
    import torch.distributed.tensor.parallel  # noqa: F401

    return fork_ranks(world, main)


if __name__ == "__main__":
    if os.environ.get("WORKER_FORK") == "1":
        sys.exit(forked(int(os.environ["WORLD_SIZE"])))
    main()
