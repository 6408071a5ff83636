"""Malformed inputs, generated: mutations of a valid trace and of a valid spec
(dropped, renamed and retyped keys, extreme numbers, bad bytes, truncation). Every
replay ends with exit 0 and complete outputs, or exit 2 with one ``aisim-fast: error:``
line (warnings aside) and nothing written in or next to ``--out``; never a
traceback."""

from __future__ import annotations

import json

from hypothesis import event, given, HealthCheck, settings, strategies as st

from aisim_fast.cli import app as cli
from aisim_fast.io import run_folder
from support.paths import DATA_DIR

DATA = DATA_DIR
TRACE_ROWS = [json.loads(line) for line in (DATA / "mooncake_tiny20.jsonl").read_text().splitlines()
              if line.strip()]
SPEC = json.loads((DATA / "cli" / "tiny20_vllm_agg1.spec.json").read_text())

ODD_VALUES = [None, -1, 0, 1, 2**31, 2**63, -(2**63), 1e308, -1e308, 0.5, "7", "", [], {}, [1, "x"],
              True, float("nan"), float("inf")]
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def _json_text(obj) -> str:
    return json.dumps(obj, allow_nan=True)


@st.composite
def mutated_trace(draw) -> bytes:
    rows = [dict(r) for r in TRACE_ROWS[:draw(st.integers(1, len(TRACE_ROWS)))]]
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(rows) - 1))
        if draw(st.integers(0, 3)) == 0 or not rows[at]:  # a field the row did not have
            rows[at][draw(st.sampled_from(["session_id", "delay", "worker", "priority", "x"]))] = \
                draw(st.sampled_from(ODD_VALUES))
        else:
            rows[at] = _mutate(rows[at], draw)
    text = "".join(_json_text(r) + "\n" for r in rows).encode()
    damage = draw(st.sampled_from(["none", "none", "truncate", "bytes", "empty"]))
    if damage == "truncate":
        text = text[:draw(st.integers(0, len(text)))]
    elif damage == "bytes":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from([b"\xff\xfe", b"\x00", b"\xe9", b"{", b"]"])) + text[at:]
    elif damage == "empty":
        text = b""
    return text


def _mutate(obj, draw, depth=0):
    """A copy of obj with one key (at some level) dropped, renamed or retyped."""
    obj = json.loads(json.dumps(obj))
    node = obj
    while isinstance(node, dict) and node and depth < 6:
        key = draw(st.sampled_from(sorted(node)))
        if isinstance(node[key], dict) and node[key] and draw(st.booleans()):
            node, depth = node[key], depth + 1
            continue
        kind = draw(st.sampled_from(["drop", "rename", "retype"]))
        if kind == "drop":
            del node[key]
        elif kind == "rename":
            node[key + "_"] = node.pop(key)
        else:
            node[key] = draw(st.sampled_from(ODD_VALUES))
        break
    return obj


@st.composite
def mutated_spec(draw) -> dict:
    spec = SPEC
    for _ in range(draw(st.integers(1, 2))):
        spec = _mutate(spec, draw)
    return spec


def _check_run(tmp_path, capsys, argv, out):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err and "Traceback" not in captured.out
    assert code in (0, 2), err
    event(f"exit {code}")
    lines = [line for line in err.splitlines()
             if line and not line.startswith(("aisim-fast: warning:", "aisim-fast: compiling"))]
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("aisim-fast: error: "), err
        assert not out.exists()
    else:
        assert lines == [], err
        # a run has rows, unless a time cap ended it before any request did
        capped = json.loads((out / "summary.json").read_text())["aisim_fast.config"]["max_sim_time_ms"]
        assert len(run_folder.read_requests(out)) > 0 or capped is not None
    # nothing half-written next to --out either
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


@SETTINGS
@given(mutated_trace())
def test_a_mutated_trace_runs_or_is_one_error_line(tmp_path_factory, capsys, data):
    tmp = tmp_path_factory.mktemp("trace")
    trace = tmp / "t.jsonl"
    trace.write_bytes(data)
    out = tmp / "run"
    _check_run(tmp, capsys, ["replay", trace, "--backend", "vllm", "--workers", "2", "--out", out,
                             "--quiet"], out)


@SETTINGS
@given(mutated_spec())
def test_a_mutated_spec_runs_or_is_one_error_line(tmp_path_factory, capsys, spec):
    tmp = tmp_path_factory.mktemp("spec")
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec, allow_nan=True))
    out = tmp / "run"
    _check_run(tmp, capsys, ["replay", "--spec", path, "--trace", DATA / "mooncake_tiny20.jsonl",
                             "--out", out, "--quiet"], out)
