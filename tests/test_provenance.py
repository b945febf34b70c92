"""The measurements the shipped calibrations come from are in the repository (data/provenance/ and
the package's calibrations/data/h200/), and nothing cites the team share outside it any more: a
citation resolves in a clone. The shipped XLA tables are checked to be what their provenance files
give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO

PROVENANCE = REPO / "data" / "provenance"
CALIBRATIONS = REPO / "sftctl" / "compiler" / "calibrations"
#: the share's paths as the old citations spelled them (built here so this file does not match itself)
SHARE = ("../" + "shared/", "/work/" + "shared")


def _cited_files() -> list[Path]:
    roots = [REPO / "sftctl", REPO / "tests", REPO / "benchmarks", REPO / "examples", REPO / "docs"]
    files = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "pyproject.toml"]
    for root in roots:
        files += [p for p in root.rglob("*") if p.is_file() and p.suffix in
                  {".py", ".json", ".jsonl", ".yaml", ".csv", ".md", ".j2", ".toml", ".txt"}]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def test_nothing_cites_the_share_outside_the_repository():
    cites = [f"{p.relative_to(REPO)}:{i}" for p in _cited_files()
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if any(s in line for s in SHARE)]
    assert cites == []


def test_the_provenance_files_are_here_small_and_licensed():
    for name in ("README.md", "xla/README.md", "xla/LICENSE", "xla/matmul.jsonl", "xla/collectives.jsonl"):
        p = PROVENANCE / name
        assert p.is_file(), f"{p} is missing"
        assert p.stat().st_size < 4 * 2**20, f"{p} is {p.stat().st_size} bytes: keep each file under a few MB"
    assert "Apache License" in (PROVENANCE / "xla" / "LICENSE").read_text()
    for name in ("README.md", "SOURCE.json", "train.jsonl", "peers.jsonl", "kernels.py", "meta.json"):
        assert (CALIBRATIONS / "data" / "h200" / name).is_file()
    assert (REPO / "docs" / "DESIGN.md").is_file()  # the design ARCHITECTURE.md started from


def test_the_shipped_gemm_tables_are_built_from_the_provenance_file():
    """``python -m sftctl.compiler.gemm_table data/provenance/xla/matmul.jsonl`` gives the shipped
    rows exactly and the fitted coefficients to 1e-6 relative or 1e-12 absolute: a coefficient the
    fit drives to ~0 lands on the CPU's rounding (sm_90 fp32's wave_s: 7.0e-20 shipped, 8.3e-20
    refitted on an AVX2-only AMD EPYC), not on a figure of the tables."""
    from sftctl.compiler.gemm_table import build_tables

    built = build_tables(PROVENANCE / "xla" / "matmul.jsonl")
    shipped = json.loads((CALIBRATIONS / "data" / "xla" / "matmul.json").read_text())
    assert {a: {d: t["rows"] for d, t in by.items()} for a, by in built["tables"].items()} == \
        {a: {d: t["rows"] for d, t in by.items()} for a, by in shipped["tables"].items()}
    for arch, by in shipped["tables"].items():
        for dtype, table in by.items():
            assert built["tables"][arch][dtype]["params"] == pytest.approx(table["params"], rel=1e-6, abs=1e-12), \
                (arch, dtype)
    assert built["source"] == shipped["source"] and "data/provenance/xla/matmul.jsonl" in shipped["source"]


def test_the_shipped_collectives_are_rows_of_the_provenance_file():
    def rows(p: Path) -> list[dict]:
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

    upstream = rows(PROVENANCE / "xla" / "collectives.jsonl")
    shipped = rows(CALIBRATIONS / "data" / "xla" / "collectives.jsonl")
    fields = [k for k in shipped[0] if k != "permute_pattern"]  # permute_pattern: derived here
    known = {tuple(json.dumps(r.get(k)) for k in fields) for r in upstream}
    assert len(shipped) > 1000
    assert [r for r in shipped if tuple(json.dumps(r.get(k)) for k in fields) not in known] == []
