"""Nanosecond quantization of the timing models (kernels/timing/pass_timing.py)."""

from hypothesis import given, settings, strategies as st

from aisim_fast.kernels.timing.pass_timing import EXACT_ROUND_TRIP_NS, NS_PER_S, modeled_ns, secs_to_ns
from support.oracle import ns_to_secs


def round_trip_ns(ns: int) -> int:
    """A Duration to f64 seconds and back, as the reference's second quantization does it."""
    return int(secs_to_ns(ns_to_secs(ns)))


def two_step_ns(raw_ms: float, ratio: float) -> int:
    """modeled_ns without its ratio-1 shortcut."""
    ns = int(secs_to_ns(raw_ms / 1000.0))
    if ratio > 0.0 and ns > 0:
        ns = int(secs_to_ns(ns_to_secs(ns) / ratio))
    return ns


@settings(max_examples=3000, deadline=None)
@given(st.integers(0, EXACT_ROUND_TRIP_NS - 1))
def test_round_trip_is_the_identity_below_the_bound(ns):
    assert round_trip_ns(ns) == ns


@settings(max_examples=2000, deadline=None)
@given(st.floats(0.0, 5e9, allow_nan=False), st.sampled_from([1.0, 0.5, 2.0, 3.0, 0.7]))
def test_ratio_one_shortcut_changes_nothing(raw_ms, ratio):
    assert modeled_ns(raw_ms, ratio) == two_step_ns(raw_ms, ratio)


def test_bound_edges():
    for ns in (1, NS_PER_S - 1, NS_PER_S, EXACT_ROUND_TRIP_NS - 1):
        assert round_trip_ns(ns) == ns
    # past the bound modeled_ns takes the full two steps again
    raw_ms = EXACT_ROUND_TRIP_NS / 1e6 * 3.0
    assert modeled_ns(raw_ms, 1.0) == two_step_ns(raw_ms, 1.0)
