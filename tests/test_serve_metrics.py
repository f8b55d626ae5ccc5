"""`metrics.OneWriterHistogram` (time to first token and inter-token gaps, observed on the engine thread without a
lock) exports exactly what `prometheus_client.Histogram` exports for the same observations: every bucket (values
on a bound included), count, sum, and the created sample."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client", reason="the serve extra is not installed (pip install 'ds4jax[serve]')")

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ds4jax.serving.metrics import _LATENCY, OneWriterHistogram


def _text(registry) -> list[str]:
    """The exposition's lines, the created timestamp's value left out (it is the creation time)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if line.startswith("h_seconds_created ") else line for line in lines]


def test_one_writer_histogram_exports_what_prometheus_histogram_does():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = OneWriterHistogram("h_seconds", "what it measures", _LATENCY, ours)
    reference = Histogram("h_seconds", "what it measures", buckets=_LATENCY, registry=theirs)
    assert _text(ours) == _text(theirs)  # empty
    for v in (0.0, 0.0005, 0.001, 0.0011, 0.005, 0.0333, 1.0, 59.9, 60.0, 61.0, 1e9):  # on bounds, between, above
        fast.observe(v)
        reference.observe(v)
    assert _text(ours) == _text(theirs)
    assert ours.get_sample_value("h_seconds_count") == 11
    assert ours.get_sample_value("h_seconds_bucket", {"le": "0.001"}) == 3
    assert abs(ours.get_sample_value("h_seconds_created") - theirs.get_sample_value("h_seconds_created")) < 60
