"""The per-request comparison rules of the reference's parity tool
(``reference/parity.py``), shared by the parity tests of the kernels and of the
oracle: how a cell reads as a number, how a row is keyed, what "within" means."""

import math

# the per-request columns a replay must reproduce exactly (times bit for bit)
EXACT_TIME_COLUMNS = ("arrival_ms", "first_token_ms", "last_token_ms", "first_admit_ms",
                      "completion_ms",
                      # disaggregated handoff timeline (empty in aggregated goldens)
                      "prefill_admit_ms", "source_held_ms", "destination_reserved_ms",
                      "destination_activated_ms", "decode_admit_ms", "source_released_ms")
EXACT_INT_COLUMNS = ("input_tokens", "output_tokens", "cached_tokens",
                     "first_admission_cached_tokens", "worker", "admission_count",
                     "readmission_count", "prefill_worker", "decode_worker",
                     "decode_cached_tokens")

RTOL = ATOL = 1e-6


def as_number(value):
    """Float of a cell; None for empty / null / NaN."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.strip()
        if value == "" or value.lower() in ("nan", "none", "null"):
            return None
        return float(value)
    out = float(value)
    return None if math.isnan(out) else out


def as_key_part(value):
    """A turn index as a join key: "3", "3.0" and 3 name the same turn."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else (str(int(value)) if value.is_integer() else repr(value))
    text = str(value).strip()
    try:
        num = float(text)
        if num.is_integer():
            return str(int(num))
    except ValueError:
        pass
    return text


def within(gold, cand, rtol=RTOL, atol=ATOL):
    """(within tolerance, abs error, rel error), parity.py's definition; two missing
    values agree, a missing and a present one do not."""
    if gold is None and cand is None:
        return True, 0.0, 0.0
    if gold is None or cand is None:
        return False, math.inf, math.inf
    err = abs(cand - gold)
    rel = err / abs(gold) if gold != 0 else (0.0 if err == 0 else math.inf)
    return (err <= atol or err <= rtol * abs(gold)), err, rel


# Columns of the reference's per-request CSV (``ref_replay.py``) that aisim_fast does
# not write: ttst/queue are differences of written columns, routing_queue_wait is
# always 0 without a queueing router, uuid is the reference's own id.
NOT_WRITTEN = frozenset({"ttst_ms", "queue_ms", "routing_queue_wait_ms", "uuid"})
# Written by the reference's driver only when it can derive it (a request_<line> id):
# compared where the reference has it.
WHERE_PRESENT = frozenset({"trace_line"})
TEXT_COLUMNS = frozenset({"request_id", "terminal_status"})


def row_differences(gold, cand, rtol=RTOL, atol=ATOL):
    """[(column, golden cell, candidate cell)] over every column of the reference's
    row: text columns equal, numbers within tolerance, empty only against empty/NaN."""
    bad = []
    for col, g in gold.items():
        if col in NOT_WRITTEN or (col in WHERE_PRESENT and as_number(g) is None):
            continue
        c = cand.get(col)
        if col in TEXT_COLUMNS:
            if str(g).strip() != str(c).strip():
                bad.append((col, g, c))
            continue
        try:
            ok = within(as_number(g), as_number(c), rtol, atol)[0]
        except (TypeError, ValueError):
            ok = False
        if not ok:
            bad.append((col, g, c))
    return bad


def workers_as_scheduler_ids(frame, dp_size: int = 1, prefill_dp_size: int = 1):
    """A per-request frame with its workers named as the reference and Dynamo name them
    under attention DP: the rank's scheduler id in its pool, ``worker * dp_size +
    dp_rank`` (``prefill_worker`` with the prefill pool's)."""
    if dp_size > 1:
        scheduler = frame["worker"] * dp_size + frame["dp_rank"]
        frame = frame.assign(worker=scheduler, decode_worker=scheduler)
    if prefill_dp_size > 1:
        frame = frame.assign(prefill_worker=frame["prefill_worker"] * prefill_dp_size
                             + frame["prefill_dp_rank"])
    return frame


def same_stop(reference_message: str, message: str) -> bool:
    """Whether aisim_fast stopped as the reference did: the same number of requests in
    flight when the reference reports one (its dead ends and effect-free passes), else
    the reference's words inside aisim_fast's message (a refused config)."""
    import re
    found = re.search(r"with (\d+) in-flight", reference_message)
    if found:
        return f"with {found.group(1)} in-flight" in message
    return reference_message.strip() in message


def values_outside_run(frame) -> list:
    """[(column, value)] of float cells outside the run: a time or latency below 0 or
    past the last completion, a token count below 0, or a non-finite value. An
    uninitialised cell reads as 4.6e-310 or 3.5e+281 and shows up here."""
    ends = frame["completion_ms"].dropna()
    horizon = float(ends.max()) if len(ends) else 0.0
    bad = []
    for col in frame.columns:
        if frame[col].dtype.kind != "f":
            continue
        for v in frame[col].dropna():
            count = col.endswith("_tokens") or col.endswith("_blocks")
            if not math.isfinite(v) or v < -1e-9 or (not count and v > horizon + 1e-9) \
                    or (0 < abs(v) < 1e-300):
                bad.append((col, v))
                break
    return bad


def assert_rows_match_reference_csv(csv_path, frame) -> None:
    """The run's request rows (``frame``) are the reference CSV's rows, joined on
    (request id, turn), and agree with them cell by cell (``row_differences``)."""
    import csv

    def key(row):
        return str(row["request_id"]).strip(), as_key_part(row["turn_index"])

    with open(csv_path, newline="", encoding="utf-8") as fh:
        gold = {key(r): r for r in csv.DictReader(fh)}
    cand = {key(r): r for r in frame.to_dict("records")}
    assert sorted(cand) == sorted(gold), "request rows differ"
    report = [f"{'/'.join(k)} {col}: reference {g!r}, aisim_fast {c!r}"
              for k, row in gold.items() for col, g, c in row_differences(row, cand[k])]
    assert not report, f"{len(report)} cells differ, first:\n" + "\n".join(report[:8])


def timeline_differences(gold: dict, cand: dict) -> list:
    """[(key, column, golden, candidate)] of the timeline columns (bit for bit; two missing
    values agree; a column the golden lacks is skipped) and the terminal status, over the
    golden's requests (``gold``, ``cand``: rows by (request id, turn))."""
    gold_cols = next(iter(gold.values())).keys() if gold else ()
    bad = []
    for col in EXACT_TIME_COLUMNS + EXACT_INT_COLUMNS:
        if col not in gold_cols:
            continue
        for key, row in gold.items():
            g = as_number(row[col])
            c = as_number(cand[key].get(col))  # aggregated runs have no handoff columns
            if not (g is None and c is None) and g != c:
                bad.append((key, col, g, c))
    if "terminal_status" in gold_cols:
        for key, row in gold.items():
            if row["terminal_status"] != cand[key]["terminal_status"]:
                bad.append((key, "terminal_status", row["terminal_status"], cand[key]["terminal_status"]))
    return bad
