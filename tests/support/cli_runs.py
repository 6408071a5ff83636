"""The command line run in-process (``run_cli``) and the checks every CLI test applies: a
one-line user error, summary keys against a reference report."""

import json
import math

from aisim_fast.cli import app as cli

PER_REQUEST_ABS_TOL_MS = 1e-6
SUMMARY_REL_TOL = 1e-9
# Keys of the golden report that are host-side (spec replay.md 12.8) or reference
# metadata aisim_fast does not produce.
NOT_COMPARED = {"wall_time_ms", "processed_tokens_per_s", "processed_output_tokens_per_s",
                "kv_eviction_policy", "power_w", "power_coverage", "power_diagnostics",
                "prediction_provenance"}
TOKEN_LEVEL_MARKERS = ("_itl_ms", "_output_token_throughput_per_user")


def run_cli(argv, capsys):
    """(exit code, stdout, stderr) of one in-process CLI call."""
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(code, err, *fragments):
    assert code == 2, err
    assert err.startswith("aisim-fast: error: "), err
    assert err.count("\n") == 1, f"expected one line, got:\n{err}"
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def golden_report(path):
    return json.loads(path.read_text())["report"]


def assert_summary_matches(summary, golden, keys):
    bad = []
    for key in keys:
        got, want = summary[key], golden[key]
        if isinstance(want, (int, float)) and not isinstance(want, bool):
            if not math.isclose(got, want, rel_tol=SUMMARY_REL_TOL, abs_tol=0.0):
                bad.append(f"{key}: {got!r} != {want!r}")
        elif got != want:
            bad.append(f"{key}: {got!r} != {want!r}")
    assert not bad, "\n".join(bad)
