"""The compiler's one cache key (sftctl.compiler.cache.cache_key) and its cache directory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sftctl.compiler import cache
from sftctl.compiler.cache import cache_key
from sftctl.compiler.costmodel import Coefficients
from sftctl.compiler.hardware import get_accelerator
from sftctl.compiler.problem import GemmProblem

REPO = Path(__file__).resolve().parents[1]
H100 = get_accelerator("H100")
C = Coefficients.uncalibrated(H100)
P = GemmProblem(batch=1, m=1024, n=768, k=3072, dtype="bfloat16", b_transposed=True)


def test_key_is_stable_and_ignores_what_it_should():
    k = cache_key("gemm", P, H100, C, {"BLOCK_M": [64, 128], "split_k": [1]})
    assert len(k) == 32 and int(k, 16) >= 0
    # equal content, other objects / dict order / tuple vs list: the same key
    assert cache_key("gemm", dataclasses.replace(P), dataclasses.replace(H100), dataclasses.replace(C),
                     {"split_k": (1,), "BLOCK_M": (64, 128)}) == k
    # an accelerator's sources are documentation, not facts a result depends on
    assert cache_key("gemm", P, dataclasses.replace(H100, sources={"hbm_bytes_per_s": "elsewhere"}), C,
                     {"BLOCK_M": [64, 128], "split_k": [1]}) == k


@pytest.mark.parametrize("change", [
    lambda p, hw, c, s: ("search", p, hw, c, s),                                     # the kind
    lambda p, hw, c, s: ("gemm", dataclasses.replace(p, k=3073), hw, c, s),           # a size
    lambda p, hw, c, s: ("gemm", dataclasses.replace(p, b_transposed=False), hw, c, s),
    lambda p, hw, c, s: ("gemm", dataclasses.replace(p, epilogue_flops_per_elem=1.0), hw, c, s),
    lambda p, hw, c, s: ("gemm", p, dataclasses.replace(hw, hbm_bytes_per_s=hw.hbm_bytes_per_s * 1.01), c, s),
    lambda p, hw, c, s: ("gemm", p, dataclasses.replace(hw, matrix_flops_per_s={**hw.matrix_flops_per_s,
                                                                                "bfloat16": 1e15}), c, s),
    lambda p, hw, c, s: ("gemm", p, dataclasses.replace(hw, name="H100-like"), c, s),
    lambda p, hw, c, s: ("gemm", p, hw, dataclasses.replace(c, mma_efficiency=c.mma_efficiency / 2), s),
    lambda p, hw, c, s: ("gemm", p, hw, c, {"BLOCK_M": [64], "split_k": [1]}),        # the space
    lambda p, hw, c, s: ("gemm", p, hw, c, None),
    lambda p, hw, c, s: ("gemm", p, get_accelerator("H200"), c, s),
])
def test_key_changes_with_every_part(change):
    space = {"BLOCK_M": [64, 128], "split_k": [1]}
    base = cache_key("gemm", P, H100, C, space)
    assert cache_key(*change(P, H100, C, space)) != base


def test_key_follows_the_compiler_source_unless_told_not_to(monkeypatch):
    with_fp = cache_key("step", "sig", H100, C)
    without = cache_key("step", "sig", H100, C, fingerprint=False)
    assert with_fp != without
    monkeypatch.setattr(cache, "compiler_fingerprint", lambda: "0.1.0+edited")
    assert cache_key("step", "sig", H100, C) != with_fp  # compiler edited: every entry is stale
    assert cache_key("step", "sig", H100, C, fingerprint=False) == without


def test_fingerprint_hashes_the_compiler_source():
    fp = cache.compiler_fingerprint()
    assert fp.startswith(cache.COMPILER_VERSION + "+") and len(fp.split("+")[1]) == 12
    assert cache.compiler_fingerprint() is fp  # read once per process


def test_unhashable_parts_are_refused():
    with pytest.raises(TypeError, match="cannot hash a object"):
        cache_key("x", object())


def test_trace_key_follows_the_entrypoint_directory(tmp_path):
    from sftctl.compiler.driver import trace_key

    (tmp_path / "model.py").write_text("def build(): pass\n")
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "notes.txt").write_text("hello\n")
    k = trace_key("torch", "model.py:build", str(tmp_path), 4, "float32")
    assert trace_key("torch", "model.py:build", str(tmp_path), 4, "float32") == k
    (tmp_path / "notes.txt").write_text("not python\n")
    assert trace_key("torch", "model.py:build", str(tmp_path), 4, "float32") == k
    assert trace_key("torch", "model.py:build", str(tmp_path), 8, "float32") != k
    assert trace_key("torch", "model.py:build", str(tmp_path), 4, "bfloat16") != k
    assert trace_key("jax", "model.py:build", str(tmp_path), 4, "float32") != k
    (tmp_path / "helpers.py").write_text("X = 2\n")  # a sibling module the model imports
    assert trace_key("torch", "model.py:build", str(tmp_path), 4, "float32") != k


def test_cache_lives_in_the_platform_cache_dir_not_sftctl_home(tmp_path):
    """A real ``sftctl compile`` (in a subprocess) writes its trace and step under
    ``$XDG_CACHE_HOME/sftctl/compiler`` and nothing under ``$SFTCTL_HOME/cache``."""
    xdg, home = tmp_path / "xdg-cache", tmp_path / "home"
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: job\nworkdir: {REPO}\n"
                    "model: {entrypoint: examples/gpt/model.py:build, batch_size: 2, dtype: float32}\n"
                    "resources: {accelerators: [H100:1]}\nrun: echo\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(xdg), SFTCTL_HOME=str(home), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "sftctl.cli", "compile", str(spec), "--target", "h100", "--json",
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["accelerator"] == "H100"
    root = xdg / "sftctl" / "compiler"
    assert len(list((root / "traces").glob("*.pkl"))) == 1
    assert len(list((root / "steps").glob("*.json"))) == 1
    assert not (home / "cache").exists()
