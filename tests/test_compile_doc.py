"""Issue 21's behaviour guard: ``sftctl compile --json`` is one document whoever builds it.

The compiler's front door (``sftctl.compiler.api``) is reached by the CLI, by ``sftctl.api`` in
process, and through the disk cache (traces, compiled steps, searches). The document must not
depend on which path produced it: a cold compile, a warm one (every stage from the cache) and an
in-process ``api.compile`` give the same document, except ``search_s`` (the search's own wall time).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import sftctl

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt2-small.yaml"


def _differences(a, b, path=""):
    """Every path where two JSON values differ (a list of strings; empty when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one" for k in set(a) ^ set(b)]
        return out + [d for k in set(a) & set(b) for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


@pytest.mark.cold_cache
def test_compile_json_is_the_same_cold_warm_and_in_process(home, tmp_path):
    from sftctl import api

    cold = json.loads(sftctl("compile", str(EXAMPLE), "--target", "h200", "--json", "--out", str(tmp_path / "a"),
                             check=True).stdout)
    warm = json.loads(sftctl("compile", str(EXAMPLE), "--target", "h200", "--json", "--out", str(tmp_path / "b"),
                             check=True).stdout)
    inproc = api.compile(EXAMPLE, "h200", out=tmp_path / "c").to_dict()
    assert cold["accelerator"] == "H200" and cold["job"] == "gpt2-small" and len(cold["kernels"]) > 100
    assert 0.005 < cold["step_time_s"] < 0.2 and cold["search_s"] > 0
    for other in (warm, inproc):
        assert _differences(cold, other) in ([], ["/search_s: " + f"{cold['search_s']!r} vs {other['search_s']!r}"])
    # and the document on disk is the one printed
    assert _differences(cold, json.loads((tmp_path / "a" / "plan.json").read_text())) == []
