"""/metrics values are written so that Prometheus reads back exactly what the server counted."""

from __future__ import annotations

from specrun.server.metrics import sample_value


def test_counters_past_a_million_keep_every_digit():
    assert sample_value(1_234_567) == "1234567"  # "%.6g" wrote 1.23457e+06
    assert sample_value(3_000_000_001.0) == "3000000001"
    assert sample_value(0) == "0"


def test_fractions_keep_every_digit_and_infinities_are_prometheus_spelled():
    assert float(sample_value(1234.56789012)) == 1234.56789012
    assert sample_value(0.25) == "0.25"
    assert (sample_value(float("inf")), sample_value(float("-inf")), sample_value(float("nan"))) == ("+Inf", "-Inf", "NaN")
