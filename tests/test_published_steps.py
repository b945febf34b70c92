"""benchmarks/published_steps.py's records (issue 20 item 3): each is sourced and quoted, none
comes from the five held-out sources, and each names a model the examples define."""

from __future__ import annotations

import ast
import importlib.util

from conftest import REPO

HELD_OUT = ("llm-foundry", "torchtitan", "tinyllama", "nanogpt", "llm.c")


def _bench():
    spec = importlib.util.spec_from_file_location("published_steps", REPO / "benchmarks" / "published_steps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_records_are_sourced_quoted_and_not_held_out():
    mod = _bench()
    recs = mod.RECORDS
    assert len(recs) >= 12 and len({r["gpu"] for r in recs}) >= 2
    for r in recs:
        assert r["source"] and r["quote"], r["name"]
        text = (r["source"] + r["quote"]).lower()
        assert not any(h in text for h in HELD_OUT), r["name"]
        assert mod.measured_s(r) > 0
        path, fn = r["entrypoint"].split(":")
        tree = ast.parse((REPO / path).read_text())
        assert fn in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, r["entrypoint"]
    # throughput converts to seconds per step: tokens per GPU per step / tokens per second per GPU
    r = next(r for r in recs if "tokens_per_s_per_gpu" in r)
    assert mod.measured_s(r) == r["batch_per_gpu"] * r["seq_len"] / r["tokens_per_s_per_gpu"]
