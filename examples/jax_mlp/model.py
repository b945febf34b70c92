"""A small JAX MLP that classifies bytes of the Python standard library's source by their
successor's class (letter, digit, space, punctuation, other): the JAX example for sftctl.

``build(batch_size, dtype)`` returns ``(params, example_batch, loss_fn)``, the contract of a JAX
``model.entrypoint``: the compiler traces ``loss_fn(params, batch)`` plus an AdamW update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CONTEXT = 16  # bytes of context
EMBED = 32
HIDDEN = 256
CLASSES = 5


def init_params(seed: int = 0, dtype=jnp.float32) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "embed": jax.random.normal(k[0], (256, EMBED), dtype) * 0.1,
        "w1": jax.random.normal(k[1], (CONTEXT * EMBED, HIDDEN), dtype) / np.sqrt(CONTEXT * EMBED),
        "b1": jnp.zeros((HIDDEN,), dtype),
        "w2": jax.random.normal(k[2], (HIDDEN, CLASSES), dtype) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((CLASSES,), dtype),
    }


def loss_fn(params: dict, batch) -> jnp.ndarray:
    """Mean cross-entropy. ``batch``: (x int32 [B, CONTEXT] bytes, y int32 [B] classes)."""
    x, y = batch
    h = jnp.take(params["embed"], x, axis=0).reshape(x.shape[0], -1)
    h = jax.nn.gelu(h @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def byte_class(b: np.ndarray) -> np.ndarray:
    """0 letter, 1 digit, 2 whitespace, 3 punctuation, 4 other."""
    out = np.full(b.shape, 4, np.int32)
    out[(b >= 65) & (b <= 90) | (b >= 97) & (b <= 122)] = 0
    out[(b >= 48) & (b <= 57)] = 1
    out[np.isin(b, [9, 10, 13, 32])] = 2
    out[np.isin(b, np.frombuffer(b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", np.uint8))] = 3
    return out


def get_batch(data: np.ndarray, batch_size: int, rng: np.random.Generator):
    idx = rng.integers(0, len(data) - CONTEXT - 1, batch_size)
    x = np.stack([data[i:i + CONTEXT] for i in idx]).astype(np.int32)
    y = byte_class(data[idx + CONTEXT]).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


def build(batch_size: int = 64, dtype: str = "float32"):
    """``(params, example_batch, loss_fn)`` with random bytes as the example batch."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    return init_params(dtype=jnp.dtype(dtype)), get_batch(data, batch_size, rng), loss_fn
