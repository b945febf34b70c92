"""sftctl.compiler.minimize: the one Nelder-Mead search matmul_model.fit and calibration share."""

from __future__ import annotations

import numpy as np

from sftctl.compiler.calibration import nelder_mead_restarts
from sftctl.compiler.minimize import nelder_mead


def _bowl(x) -> float:
    return float((x[0] - 3.0) ** 2 + 2.0 * (x[1] + 1.0) ** 2 + 5.0)


def test_nelder_mead_finds_a_bowls_bottom_and_returns_its_value():
    x, fx = nelder_mead(_bowl, [0.0, 0.0], step=0.5, iters=200)
    assert np.allclose(x, [3.0, -1.0], atol=1e-5)
    assert fx == _bowl(x)
    assert abs(fx - 5.0) < 1e-9


def test_nelder_mead_with_no_steps_is_the_best_first_vertex():
    # the first simplex: x0, x0 + step e0, x0 + step e1; (0.5, 0) is the nearest the bottom
    x, fx = nelder_mead(_bowl, np.array([0.0, 0.0]), step=0.5, iters=0)
    assert list(x) == [0.5, 0.0]
    assert fx == _bowl([0.5, 0.0])


def test_restarts_keep_the_start_when_nothing_beats_it():
    x, fx = nelder_mead_restarts(lambda x: 1.0, [0.3, 0.4], iters=10, restarts=1)
    assert list(x) == [0.3, 0.4] and fx == 1.0
    x, fx = nelder_mead_restarts(_bowl, [0.0, 0.0], iters=100, restarts=2)
    assert np.allclose(x, [3.0, -1.0], atol=1e-4)
