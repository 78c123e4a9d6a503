"""The rotary angles' cos and sin every head kind shares (specrun/heads/layers.turns): kept for a
drafting step's few positions, bit for bit what working them out again gives."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.heads import layers
from specrun.heads.layers import rope, turns


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("magnitude", [1.0, 1.3])
def test_kept_turns_are_the_ones_worked_out_again(dtype, magnitude):
    frequencies = 10000.0 ** (-np.arange(4, dtype=np.float64) / 4)
    positions = np.array([7, 7, 8])
    cos, sin = turns(frequencies, positions, dtype, magnitude)
    again = layers._turns(frequencies, positions, dtype, magnitude)
    angles = positions[:, None] * frequencies
    assert cos.dtype == dtype and cos.shape == (3, 1, 4)
    np.testing.assert_array_equal(cos, again[0])
    np.testing.assert_array_equal(sin, again[1])
    np.testing.assert_allclose(cos[:, 0], np.cos(angles) * magnitude, rtol=1e-6)
    assert turns(frequencies, [7, 7, 8], dtype, magnitude)[0] is cos  # kept: the same arrays
    with pytest.raises(ValueError):
        cos[0, 0, 0] = 0.0  # shared, so read-only


def test_a_long_run_of_positions_is_worked_out_each_time_and_rope_still_inverts():
    frequencies = 10000.0 ** (-np.arange(2, dtype=np.float64) / 2)
    positions = np.arange(layers._TURNS_POSITIONS + 1)
    first, second = turns(frequencies, positions, np.float64), turns(frequencies, positions, np.float64)
    assert first[0] is not second[0]
    np.testing.assert_array_equal(first[0], second[0])
    x = np.random.default_rng(0).normal(size=(len(positions), 2, 4))
    np.testing.assert_allclose(rope(rope(x, positions, 10000.0), positions, 10000.0, inverse=True), x, atol=1e-12)
