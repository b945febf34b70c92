"""One rank of a 2-rank CPU (gloo) training run of a tiny Llama for tests/test_layouts_memory.py:
the layout is ``tp2`` (torch DTensor ``parallelize_module``, Megatron's split with the embedding
and the LM head split over the vocabulary, as the layout model assumes), ``dp2 fsdp`` (FSDP2
``fully_shard`` per block, then the root) or ``dp2`` (DDP with ``gradient_as_bucket_view``),
``pp2`` (sftctl.train.pipeline: two stages, 1F1B over 4 micro-batches), float32, AdamW. After one warm-up step (so AdamW's moments exist) it measures one more step's
peak of live tensor bytes on this rank and writes it (JSON) to ``OUT.<rank>``.

Live bytes are counted by a ``TorchDispatchMode`` over every op of the step: each output's
storage (a DTensor's local shard) is added when first seen and taken away when the tensor dies
(``weakref.finalize``); the storages alive when the step starts (parameters, AdamW state) are
counted once as ``resident``. Collective buffers inside DTensor's own dispatch are not seen.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/layouts_memory_worker.py LAYOUT OUT
"""

from __future__ import annotations

import json
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: the tiny Llama's dimensions (tests/test_layouts_memory.py builds its TransformerShape from these)
DIMS = dict(layers=2, hidden=128, ffn=384, heads=4, kv_heads=4, vocab=2048, seq_len=256)
BATCH = 4
#: ep2: sftctl.train.tiny's MoE (RoPE, its own RMSNorm) of these sizes
MOE_DIMS = dict(dim=128, n_layers=2, n_heads=4, ffn=192, vocab=2048, max_seq=256, n_experts=4, top_k=2)
PP_MICRO_BATCHES = 4  # pp2: 1F1B over 4 micro-batches of one sequence


class Block(torch.nn.Module):
    def __init__(self, h: int, f: int, heads: int) -> None:
        super().__init__()
        self.hd = h // heads
        self.attn_norm = torch.nn.RMSNorm(h)
        self.q_proj = torch.nn.Linear(h, h, bias=False)
        self.k_proj = torch.nn.Linear(h, h, bias=False)
        self.v_proj = torch.nn.Linear(h, h, bias=False)
        self.o_proj = torch.nn.Linear(h, h, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(h)
        self.gate_proj = torch.nn.Linear(h, f, bias=False)
        self.up_proj = torch.nn.Linear(h, f, bias=False)
        self.down_proj = torch.nn.Linear(f, h, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q, k, v = (p(y).view(b, s, -1, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyLlama(torch.nn.Module):
    """torchtitan's names (what sftctl.train.pipeline cuts into stages): a stage without
    ``tok_embeddings`` takes hidden states, one without ``output`` returns them."""

    def __init__(self, layers: int, hidden: int, ffn: int, heads: int, vocab: int, **_) -> None:
        super().__init__()
        self.tok_embeddings: torch.nn.Module | None = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleDict({str(i): Block(hidden, ffn, heads) for i in range(layers)})
        self.norm: torch.nn.Module | None = torch.nn.RMSNorm(hidden)
        self.output: torch.nn.Module | None = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        x = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            x = layer(x)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops under this mode created and that are still alive, and their peak."""

    def __init__(self, resident: list) -> None:
        super().__init__()
        self.seen: dict[int, int] = {}
        sizes = {self._storage(t).data_ptr(): self._storage(t).nbytes() for t in resident}
        self.seen = dict.fromkeys(sizes, -1)  # counted once as resident (DDP's gradients share buckets)
        self.resident = sum(sizes.values())
        self.live = self.peak = 0
        self.peak_op = ""

    @staticmethod
    def _local(t):
        """The plain tensor holding ``t``'s bytes: a DTensor's local shard, an async collective's result."""
        for attr in ("_local_tensor", "elem"):
            while type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, attr):
                t = getattr(t, attr)
        return t

    def _storage(self, t):
        return self._local(t).untyped_storage()

    def _free(self, ptr: int) -> None:
        n = self.seen.get(ptr, 0)
        if n > 0:
            self.seen[ptr] -= 1
            if self.seen[ptr] == 0:
                del self.seen[ptr]
                self.live -= self._sizes.pop(ptr)

    _sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            local = self._local(t)
            if type(local) not in (torch.Tensor, torch.nn.Parameter):
                continue
            st = local.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n == 0 or self.seen.get(ptr) == -1:
                continue
            if ptr not in self.seen:
                self.seen[ptr] = 0
                self._sizes[ptr] = n
                self.live += n
                if self.live > self.peak:
                    self.peak, self.peak_op = self.live, str(func)
            self.seen[ptr] += 1
            weakref.finalize(local, self._free, ptr)
        return out


def _tp(model, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from sftctl.train.tensor_parallel import apply_tensor_parallel, default_plan

    plan = default_plan(model)
    # Megatron's vocabulary-parallel embedding and LM head (the layout model divides both by tp)
    plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    del init_device_mesh
    return apply_tensor_parallel(model, tp, plan=plan, device_type="cpu")


def main(layout: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyLlama(**DIMS)
    loss_ctx = None
    if layout == "tp2":
        from torch.distributed.tensor.parallel import loss_parallel

        model = _tp(model, 2)
        loss_ctx = loss_parallel
    elif layout == "dp2 fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
    elif layout == "dp2":
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    elif layout == "ep2":  # sftctl.train's expert parallelism: sftctl.train.tiny's MoE, 4 experts, top 2
        import os

        from sftctl.train import prepare
        from sftctl.train.tiny import tiny_llama

        os.environ.update({"SFTCTL_EP": "2", "SFTCTL_DP": "2", "SFTCTL_DP_SHARDING": "fsdp"})
        model = prepare(tiny_llama(seed=0, dtype=torch.float32, **MOE_DIMS))
    elif layout == "pp2":  # sftctl.train's pipeline: two stages, 1F1B over PP_MICRO_BATCHES micro-batches
        import os

        from sftctl.train import mesh as M
        from sftctl.train.parallel import layout_mesh, parallelize
        from sftctl.train.pipeline import build_pipeline

        os.environ.update({"SFTCTL_PP": "2", "SFTCTL_MICRO_BATCHES": str(PP_MICRO_BATCHES)})
        lay = M.layout()
        pipe = build_pipeline(model, lay, layout_mesh(lay),
                              lambda out, tgt: F.cross_entropy(out.flatten(0, 1), tgt.flatten()), apply=parallelize)
        model = pipe.module
    else:
        raise SystemExit(f"unknown layout {layout!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(1 + (dist.get_rank() if layout != "tp2" else 0))
    ids = torch.randint(0, DIMS["vocab"], (BATCH, DIMS["seq_len"] + 1), generator=gen)

    def step():
        opt.zero_grad(set_to_none=layout != "dp2")
        if layout == "pp2":
            # Pipeline.step's schedule call, but without return_outputs: torch's schedule otherwise
            # keeps every micro-batch's logits on the last stage until the step ends (m x logits)
            losses: list = []
            if pipe.first:
                pipe.schedule.step(ids[:, :-1])
            else:
                pipe.schedule.step(target=ids[:, 1:], losses=losses, return_outputs=False)
            opt.step()
            return float(torch.stack([x.detach() for x in losses]).mean()) if losses else 0.0
        logits = model(ids[:, :-1])
        if loss_ctx is not None:
            with loss_ctx():
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        opt.step()
        return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())

    step()  # AdamW's moments exist from here on
    resident = [p for p in model.parameters()]
    resident += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    if layout == "dp2":
        resident += [p.grad for p in model.parameters() if p.grad is not None]  # DDP's bucket views
    mode = LiveBytes(resident)
    with mode:
        loss = step()
    kinds = {"params": sum(LiveBytes._local(p).untyped_storage().nbytes() for p in model.parameters()),
             "optimizer": sum(LiveBytes._local(v).untyped_storage().nbytes() for s in opt.state.values()
                              for v in s.values() if isinstance(v, torch.Tensor) and v.dim())}
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump({"layout": layout, "resident": mode.resident, "transient_peak": mode.peak,
                   "peak": mode.resident + mode.peak, "peak_op": mode.peak_op, "loss": loss, **kinds}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
