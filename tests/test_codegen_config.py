"""The codegen schedules' overrides: one rule (``_runtime.with_overrides``) for the GEMM, row and
column-sum configs: a key the schedule lacks is refused by a line naming it and the known keys."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from sftctl.compiler.codegen import _runtime as rt
from sftctl.compiler.codegen import gemm as gemm_mod
from sftctl.compiler.codegen import reduction as R


def test_with_overrides_copies_and_updates():
    defaults = {"BLOCK_N": 16, "num_warps": 4}
    cfg = rt.with_overrides(defaults, {"num_warps": 8}, "row config")
    assert cfg == {"BLOCK_N": 16, "num_warps": 8}
    assert defaults == {"BLOCK_N": 16, "num_warps": 4}
    assert rt.with_overrides(defaults, None, "x") == defaults and rt.with_overrides(defaults, None, "x") is not defaults


@pytest.mark.parametrize("call, line", [
    (lambda: gemm_mod.normalize_config({"BLOCK_Q": 16}),
     "gemm config: unknown keys ['BLOCK_Q']; known: ['BLOCK_K', 'BLOCK_M', 'BLOCK_N', 'GROUP_M', "),
    (lambda: R.row_config(100, {"BLOCK": 16}),
     "row config: unknown keys ['BLOCK']; known: ['BLOCK_N', 'num_warps']"),
    (lambda: R.colsum_config(100, 100, {"rows": 2}),
     "column-sum config: unknown keys ['rows']; known: ['BLOCK_M', 'BLOCK_N', 'num_warps', 'split']"),
])
def test_an_unknown_key_is_named_with_the_known_ones(call, line):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value).startswith(line)
