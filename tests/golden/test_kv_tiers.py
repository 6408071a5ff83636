"""KV tiers beyond the GPU pool: reference runs in tests/data/golden_kv_tiers (its README
maps the reference's G2 host offload and Belady eviction).

What runs here today: the plain runs those tiers are measured against match request
for request, with ``kv_cache_bytes_per_token`` given (it prices tier transfers only)
and with ``kv_eviction_policy: lru`` spelled out; every tier run is refused by the field
that asks for it.
"""

from __future__ import annotations

import json

import pytest

from aisim_fast.config.payload import ConfigError, parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from support.parity_rules import assert_rows_match_reference_csv
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_kv_tiers"
PLAIN = ["A_plain", "B_plain", "F_lru", "S_plain800"]
TIERS = {"F_belady": "spec.engine.kv_eviction_policy: 'belady'"}
TIERS.update({case: "spec.engine.rank.native_host_offload: is not simulated" for case in (
    "A_restore", "B_d2h_fence", "B_fast_d2h", "C_pending", "D_h2d_fifo", "D_h2d_zero_bw", "E_local2", "E_shared",
    "E_shared_cap1", "G_host_evict", "H_chunked", "S_g2_1gb_2ms", "S_g2_local", "S_g2_shared2")})


def _payload(case: str) -> dict:
    return json.loads((GOLDEN / f"{case}.spec.json").read_text())


def test_cases_present():
    assert sorted(p.name[:-len(".spec.json")] for p in GOLDEN.glob("*.spec.json")) == sorted(PLAIN + list(TIERS))


@pytest.mark.parametrize("case", PLAIN)
def test_plain_run_matches_the_reference(case):
    sim = simulation_from_setup(parse_payload(_payload(case), GOLDEN))
    res = run_batch([sim])
    assert res.status[0] == "ok", res.error[0]
    assert_rows_match_reference_csv(GOLDEN / f"{case}.csv", res.requests[0])


def test_bytes_per_token_is_checked():
    for value, words in ((0, "kv_cache_bytes_per_token must be positive"), (-1, "must be a positive integer"),
                         ("auto", "must be a positive integer")):
        payload = _payload("B_plain")
        payload["spec"]["engine"]["rank"]["kv_cache_bytes_per_token"] = value
        with pytest.raises(ConfigError, match=words):
            parse_payload(payload, GOLDEN)
    payload = _payload("B_plain")
    payload["spec"]["engine"]["num_gpu_blocks_is_explicit"] = False
    with pytest.raises(ConfigError, match="sized from memory"):
        parse_payload(payload, GOLDEN)


@pytest.mark.parametrize("case", sorted(TIERS))
def test_tier_run_is_refused_by_its_field(case):
    with pytest.raises(ConfigError) as err:
        parse_payload(_payload(case), GOLDEN)
    assert str(err.value).startswith(TIERS[case]), str(err.value)
