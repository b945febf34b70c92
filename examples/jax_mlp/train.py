"""Train examples/jax_mlp on the standard library's source with AdamW (one process, CPU).

Reports each step to sftctl (``sftctl.train.report``); settings from ``sftctl.train.config()``.
"""

from __future__ import annotations

import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import CONTEXT, get_batch, init_params, loss_fn

try:
    from sftctl import train as sft
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from sftctl import train as sft


def corpus(max_bytes: int = 2 << 20) -> np.ndarray:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for p in sorted(root.glob("*.py")):
        b = p.read_bytes()
        chunks.append(b)
        size += len(b)
        if size >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def main() -> None:
    cfg = sft.config(steps=200, batch_size=64, checkpoint_interval=100)
    data = corpus()
    params = init_params()
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    lr, b1, b2, eps, wd = 3e-3, 0.9, 0.999, 1e-8, 0.01

    @jax.jit
    def step(params, m, v, t, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        upd = lambda p, m, v: p - lr * (m / (1 - b1**t) / (jnp.sqrt(v / (1 - b2**t)) + eps) + wd * p)  # noqa: E731
        return jax.tree_util.tree_map(upd, params, m, v), m, v, loss

    rng = np.random.default_rng(0)
    first = last = None
    for t in range(1, cfg.steps + 1):
        batch = get_batch(data, cfg.batch_size, rng)
        t0 = time.perf_counter()
        params, m, v, loss = step(params, m, v, float(t), batch)
        loss = float(loss)
        dt = time.perf_counter() - t0
        first = loss if first is None else first
        last = loss
        sft.report(t, loss, step_time_s=dt, tokens_per_s=cfg.batch_size * CONTEXT / dt)
        if t % 50 == 0 or t == cfg.steps:
            print(f"step {t}/{cfg.steps} loss {loss:.4f}", flush=True)
    print(f"rank {jax.process_index()}: first loss {first:.4f} last loss {last:.4f} (this process's batches)", flush=True)


if __name__ == "__main__":
    main()
