"""Agentic warm-up and profiles (``traffic.agentic_warmup``, ``agentic_warmup_policy``,
``agentic_profile``): reference runs in tests/data/golden_agentic_profile (its README
maps what the reference does with them).

What runs here today: the two cold snapshots those runs are measured against match
the reference request for request, and every warm-up and profile payload is checked
in the reference's order and words before it is refused as not simulated yet.
"""

from __future__ import annotations

import copy
import gzip
import json

import pytest

from aisim_fast.config.payload import ConfigError, parse_payload
from support import goldens
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_agentic_profile"
COLD = ["snapshot_cold", "snapshot_shape_cold"]
ASKS = sorted(p.name[:-len(".spec.json")] for p in GOLDEN.glob("*.spec.json") if p.name[:-len(".spec.json")]
              not in COLD)
REPORT_KEYS = ("num_requests", "completed_requests", "agentic_play_outcomes", "agentic_lifecycle_event_count",
               "agentic_lifecycle_digest", "total_trajectories", "completed_trajectories", "agentic_snapshots")


def _report(case: str) -> dict:
    return json.loads(gzip.decompress((GOLDEN / f"{case}.report.json.gz").read_bytes()))


@pytest.mark.parametrize("case", COLD)
def test_cold_snapshot_matches_the_reference(case, tmp_path):
    requests, summary = goldens.replay_spec_case(case, GOLDEN, tmp_path / "run")
    goldens.assert_matches_golden(case, GOLDEN, requests)
    report = _report(case)
    for key in REPORT_KEYS:
        assert summary[key] == report[key], key


def test_every_warmup_and_profile_run_is_refused_as_not_simulated():
    assert ASKS == ["profile_basic", "profile_cancel", "profile_idle_global", "profile_idle_tree", "profile_lanes3",
                    "profile_shape", "warmup_live", "warmup_live_globalcap", "warmup_noprimer", "warmup_repeated",
                    "warmup_repeated_profile"]
    for case in ASKS:
        payload = json.loads((GOLDEN / f"{case}.spec.json").read_text())
        with pytest.raises(ConfigError, match="agentic warm-up and profiles are not simulated yet"):
            parse_payload(payload, GOLDEN)


BASE = json.loads((GOLDEN / "profile_basic.spec.json").read_text())
P = "traffic.agentic_profile."
DELETE = object()


def _edited(edit: dict) -> dict:
    """``profile_basic``'s payload with each ``dotted.path: value`` set (DELETE: removed)."""
    payload = copy.deepcopy(BASE)
    for key, value in edit.items():
        node = payload
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return payload


# each edit of the reference's CLI payload with the words the reference stops with
# (validation_errors.txt), behind the field aisim_fast names
@pytest.mark.parametrize("edit, words", [
    ({P + "duration_seconds": 0.0}, "traffic.agentic_profile.duration_seconds: agentic_profile.duration_seconds "
                                    "must be finite and positive"),
    ({P + "duration_seconds": 1e308}, "traffic.agentic_profile.duration_seconds: agentic_profile.duration_seconds "
                                      "must be finite and positive"),
    ({P + "response_grace_seconds": -1.0}, "traffic.agentic_profile.response_grace_seconds: "
                                           "agentic_profile.response_grace_seconds must be finite and non-negative"),
    ({P + "cancel_drain_seconds": -0.5}, "traffic.agentic_profile.cancel_drain_seconds: "
                                         "agentic_profile.cancel_drain_seconds must be finite and non-negative"),
    ({P + "tree_idle_cap_seconds": 0.0}, "traffic.agentic_profile.tree_idle_cap_seconds: "
                                         "agentic_profile.tree_idle_cap_seconds must be finite and positive"),
    ({P + "global_idle_cap_seconds": 0.0}, "traffic.agentic_profile.global_idle_cap_seconds: "
                                           "agentic_profile.global_idle_cap_seconds must be finite and positive"),
    ({P + "duration_seconds": 1.5e305, P + "response_grace_seconds": 1.5e305},
     "traffic.agentic_profile: agentic_profile deadlines overflow"),
    ({P + "foo": 1}, "traffic.agentic_profile.foo: unknown field; allowed: duration_seconds"),
    ({P + "duration_seconds": True}, "traffic.agentic_profile.duration_seconds: must be a number of seconds"),
    ({"traffic.agentic_snapshot": DELETE}, "traffic.agentic_profile: agentic_profile requires agentic_snapshot"),
    ({"traffic.agentic_lanes": DELETE}, "traffic.agentic_snapshot: agentic_snapshot requires trace_timestamps "
                                        "agentic input with positive agentic_lanes"),
    ({"spec.max_sim_time_ms": 1000.0, "traffic.agentic_snapshot": DELETE},
     "spec.max_sim_time_ms: agentic_profile cannot be combined with ReplaySpec.max_sim_time_ms"),
    ({P + "duration_seconds": 0.0, "traffic.agentic_snapshot": DELETE},
     "traffic.agentic_profile.duration_seconds: agentic_profile.duration_seconds must be finite and positive"),
    ({"traffic.agentic_warmup": True, "traffic.agentic_snapshot": DELETE, "traffic.agentic_profile": DELETE},
     "traffic.agentic_warmup: agentic_warmup requires agentic_snapshot"),
    ({"traffic.agentic_warmup": "true"}, "traffic.agentic_warmup: must be true or false"),
    ({"traffic.agentic_warmup_policy": "bogus"}, "traffic.agentic_warmup_policy: must be one of"),
    ({"traffic.agentic_warmup_policy": "live_trajectory_v1"},
     "traffic.agentic_warmup_policy: live_trajectory_v1 requires agentic_warmup and agentic_profile"),
    ({"traffic.agentic_warmup_policy": "live_trajectory_v1", "traffic.agentic_warmup": True,
      "traffic.agentic_profile": DELETE, "traffic.agentic_snapshot": DELETE},
     "traffic.agentic_warmup_policy: live_trajectory_v1 requires agentic_warmup and agentic_profile"),
])
def test_payload_checks_in_the_references_order(edit, words):
    with pytest.raises(ConfigError) as err:
        parse_payload(_edited(edit), GOLDEN)
    assert str(err.value).startswith(words), str(err.value)


@pytest.mark.parametrize("edit", [{"traffic.agentic_profile": {}}, {"traffic.agentic_profile": [1]},
                                  {P + "duration_seconds": 5}, {P + "response_grace_seconds": 0.0},
                                  {"traffic.agentic_warmup": False},
                                  {"traffic.agentic_warmup_policy": "repeated_prefixes"}])
def test_what_the_reference_accepts_reaches_the_not_simulated_refusal(edit):
    with pytest.raises(ConfigError, match="traffic.agentic_profile: agentic warm-up and profiles are not simulated"):
        parse_payload(_edited(edit), GOLDEN)


def test_a_null_profile_is_a_plain_snapshot():
    payload = copy.deepcopy(BASE)
    payload["traffic"]["agentic_profile"] = None
    assert parse_payload(payload, GOLDEN).agentic_snapshot_seed == 7
