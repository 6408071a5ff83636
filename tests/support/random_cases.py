"""Random small replay cases (hypothesis strategies) and the checks every kernel-vs-oracle
property applies: the kernel's records and pass rows against the plain-Python oracle, pool and
lease invariants of the kernel state. AISIM_PROPERTY_EXAMPLES scales the number of examples
(default 1.0 = the CI budget)."""

from __future__ import annotations

import json
import math
import os
import tempfile

import numpy as np
from hypothesis import HealthCheck, Phase, strategies as st

from aisim_fast.config.payload import parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.build import DEFAULT_PASS_LOG_ROWS, build_state
from aisim_fast.engine.frames import request_frame
from aisim_fast.engine.simulation import Simulation, SimulationError, simulation_from_setup
from aisim_fast.kernels import invariants as D
from aisim_fast.kernels.loop.event_loop import replay_batch
from aisim_fast.kernels.schema import layout as L
from support import oracle

SCALE = float(os.environ.get("AISIM_PROPERTY_EXAMPLES", "1"))


def examples(n):
    return max(1, int(n * SCALE))


# status code -> constant name of kernels.invariants, for readable assertion messages
CODE_NAMES = {v: k for k, v in vars(D).items()
              if k.isupper() and isinstance(v, int)
              and k.split("_")[0] in ("OK", "POOL", "DRAIN", "LEASE")}


def describe(code):
    return CODE_NAMES.get(int(code), "UNKNOWN_%d" % int(code))


# Shrinking a failure can take hypothesis' full five-minute budget (each step replays
# the oracle); AISIM_PROPERTY_SHRINK=0 reports the first failing example instead.
_PHASES = tuple(p for p in Phase
                if p != Phase.shrink or os.environ.get("AISIM_PROPERTY_SHRINK", "1") != "0")
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True,
                phases=_PHASES)

# Per-request columns the kernel must reproduce exactly (None/NaN = no value).
RECORD_COLUMNS = ("arrival_ms", "first_admit_ms", "first_token_ms", "second_token_ms",
                  "last_token_ms", "completion_ms", "output_tokens", "cached_tokens",
                  "first_admission_cached_tokens", "admission_count", "worker",
                  "terminal_status")
PASS_COLUMNS = ("worker", "start_ms", "end_ms", "num_prefill_requests", "sum_prefill_tokens",
                "sum_prefill_kv_tokens", "num_decode_requests", "sum_decode_kv_tokens")


# ------------------------------------------------------------------------------------------------
# random cases
# ------------------------------------------------------------------------------------------------
class Case:
    """Trace rows plus a reference execution payload; repr is a ready reproducer."""

    def __init__(self, rows, spec):
        self.rows = rows
        self.spec = spec

    @property
    def rank(self):
        return self.spec["spec"]["engine"]["rank"]

    def __repr__(self):
        lines = ["Case(rows=["]
        lines += ["  %s," % json.dumps(r) for r in self.rows]
        lines.append("], spec=%s)" % json.dumps(self.spec))
        return "\n".join(lines)


def make_spec(rank, workers=1, concurrency=0, trace_block_size=512, speedup=1.0):
    traffic = {"source_type": "trace", "load_type": "trace_timestamps",
               "trace_format": "mooncake", "trace_block_size": trace_block_size,
               "arrival_speedup_ratio": speedup}
    if concurrency:
        traffic["load_type"] = "concurrency"
        traffic["replay_concurrency"] = concurrency
    return {"spec": {"version": 1,
                     "topology": {"kind": "aggregated",
                                  "workers": {"initial_workers": workers,
                                              "startup_delay_ms": 0.0}},
                     "engine": {"dp_size": 1, "rank": rank}},
            "traffic": traffic}


@st.composite
def cases(draw, max_rows=40):
    tbs = draw(st.sampled_from([4, 8, 16, 32, 64]))
    n = draw(st.integers(5, max_rows))
    n_families = draw(st.integers(1, 4))
    sessions = draw(st.booleans()) and draw(st.booleans())
    n_sessions = draw(st.integers(1, max(1, n // 2))) if sessions else 0
    rows = []
    t = 0.0
    fresh = 0
    seen_session = set()
    last_ids = {}
    for i in range(n):
        prompt = draw(st.integers(1, 400))
        n_ids = -(-prompt // tbs)
        # a shared family prefix, then ids private to this row (occasionally from a
        # small common pool, so non-prefix collisions happen too)
        family = draw(st.integers(0, n_families - 1))
        shared = draw(st.integers(0, n_ids))
        ids = [1000 * (family + 1) + j for j in range(shared)]
        sid = draw(st.integers(0, n_sessions - 1)) if sessions else None
        if sid in last_ids and draw(st.booleans()):
            # a conversation: the next turn's prompt extends the previous one's
            ids = last_ids[sid][:n_ids]
        for _ in range(n_ids - len(ids)):
            if draw(st.integers(0, 9)) == 0:
                ids.append(draw(st.integers(1, 5)))
            else:
                fresh += 1
                ids.append(10 ** 6 + fresh)
        row = {"input_length": prompt, "output_length": draw(st.integers(0, 40)),
               "hash_ids": ids}
        if sessions:
            last_ids[sid] = ids
            row["session_id"] = "s%02d" % sid
            if sid in seen_session:
                # a later turn: released this long after the previous turn ends
                row["delay"] = draw(st.sampled_from([0, 0, 1, 7.5, 40]))
            else:
                seen_session.add(sid)
                t += draw(st.sampled_from([0, 0, 0, 1, 3, 10.25, 50]))
                row["timestamp"] = t
        else:
            t += draw(st.sampled_from([0, 0, 0, 1, 3, 10.25, 50]))
            row["timestamp"] = t
        rows.append(row)

    backend = draw(st.sampled_from(["vllm", "trtllm"]))
    bs = draw(st.integers(2, 64))
    chunked = draw(st.booleans())
    need = max(-(-(r["input_length"] + r["output_length"]) // bs) for r in rows)
    max_prompt = max(r["input_length"] for r in rows)
    pool_mode = draw(st.sampled_from(["fits", "fits", "tight", "roomy", "short"]))
    if pool_mode == "fits":
        blocks = need + draw(st.integers(0, 2))
    elif pool_mode == "tight":
        blocks = need + draw(st.integers(0, need))
    elif pool_mode == "roomy":
        blocks = need * draw(st.integers(2, 6))
    else:
        # below the largest request: rejections, dead ends (both sides must agree)
        blocks = draw(st.integers(1, need))
    budget = draw(st.integers(16, 512))
    if not chunked and draw(st.booleans()):
        budget = max(budget, max_prompt)  # mostly live without chunking
    rank = {
        "backend": backend, "block_size": bs, "num_gpu_blocks": blocks,
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": budget,
        "enable_prefix_caching": draw(st.booleans()) or draw(st.booleans()),
        "enable_chunked_prefill": chunked,
        "preemption_mode": draw(st.sampled_from(["lifo", "fifo"])),
    }
    if draw(st.booleans()):
        rank["timing_model"] = {"type": "polynomial"}
    else:
        # zero durations included: passes that end in the instant they start
        rank["timing_model"] = {"type": "fixed",
                                "prefill_ms": draw(st.sampled_from([0.0, 1.0, 2.5, 20.0])),
                                "decode_ms": draw(st.sampled_from([0.0, 0.5, 5.0]))}
    if draw(st.integers(0, 4)) == 0:
        rank["speedup_ratio"] = draw(st.sampled_from([0.5, 1.7, 3.0]))
    if draw(st.integers(0, 4)) == 0:
        rank["decode_speedup_ratio"] = draw(st.sampled_from([0.8, 2.0]))
    if draw(st.integers(0, 5)) == 0:
        rank["max_model_len"] = draw(st.integers(8, 450))
    workers = draw(st.integers(1, 3))
    concurrency = draw(st.integers(1, 4)) if draw(st.integers(0, 2)) == 0 else 0
    speedup = draw(st.sampled_from([1.0, 1.0, 1.0, 2.0, 0.5]))
    return Case(rows, make_spec(rank, workers, concurrency, tbs, speedup))


# ------------------------------------------------------------------------------------------------
# running both sides
# ------------------------------------------------------------------------------------------------
def write_trace(rows, directory):
    path = os.path.join(directory, "trace.jsonl")
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def run_oracle(case, path):
    """("ok", records, passes) or ("dead_end", message, None)."""
    try:
        records, passes = oracle.run(case.spec, path)
    except RuntimeError as exc:
        if "dead end" in str(exc):
            return "dead_end", str(exc), None
        raise
    return "ok", records, passes


def kernel_simulation(case, path) -> Simulation:
    return simulation_from_setup(parse_payload(case.spec, trace_override=path))


def run_kernel(case, path):
    """("ok", requests frame, passes frame) or ("dead_end", message, None)."""
    try:
        res = run_batch([kernel_simulation(case, path)]).check()
    except SimulationError as exc:
        return "dead_end", str(exc), None
    return "ok", res.requests[0], res.passes[0]


def _value(v):
    """Comparable cell: None for missing, plain int / float / str otherwise."""
    if v is None:
        return None
    if isinstance(v, (float, np.floating)):
        return None if math.isnan(v) else float(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    return v


def record_differences(records, frame, extra_columns=()):
    """[(key, column, oracle value, kernel value)] and the keys present on one side only."""
    want = {(r["request_id"], int(r["turn_index"])): r for r in records}
    got = {(r["request_id"], int(r["turn_index"])): r for r in frame.to_dict("records")}
    diffs = []
    for key in sorted(set(want) | set(got)):
        if key not in want or key not in got:
            diffs.append((key, "<presence>", key in want, key in got))
            continue
        for col in RECORD_COLUMNS + tuple(extra_columns):
            a, b = _value(want[key][col]), _value(got[key][col])
            if a != b:
                diffs.append((key, col, a, b))
    return diffs


def pass_rows_oracle(passes):
    return [tuple(_value(p[c]) for c in PASS_COLUMNS) for p in passes]


def pass_rows_kernel(frame):
    rows = frame[list(PASS_COLUMNS)].itertuples(index=False)
    return [tuple(_value(v) for v in row) for row in rows]


def check_case_against_oracle(case, extra_columns=()):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(case.rows, tmp)
        want = run_oracle(case, path)
        got = run_kernel(case, path)
    assert want[0] == got[0], "dead-end disagreement: oracle %s, kernel %s" % (
        want[0] if want[0] == "ok" else want[1], got[0] if got[0] == "ok" else got[1])
    if want[0] == "dead_end":
        return
    _, records, passes = want
    _, frame, kpasses = got
    diffs = record_differences(records, frame, extra_columns)
    assert not diffs, "%d record differences (key, column, oracle, kernel), first: %s" % (
        len(diffs), diffs[:6])
    # the forward passes themselves: same passes, same times, same FPM counters
    a, b = pass_rows_oracle(passes), pass_rows_kernel(kpasses)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert a == b, "pass logs differ at pass %d (of %d oracle / %d kernel): oracle %s kernel %s" % (
        first, len(a), len(b), a[first:first + 2], b[first:first + 2])


# ------------------------------------------------------------------------------------------------
# kernel state, driven directly (the driver's loop without dropping the state)
# ------------------------------------------------------------------------------------------------
def run_state(sims, per_pass_check=None, pass_log_rows=DEFAULT_PASS_LOG_ROWS):
    """Run a batch to completion on a kept state. With ``per_pass_check`` the pass log
    has one row, so the kernel stops before every pass after the first and the check
    sees the state between passes. Returns the final state tuple or "dead_end"."""
    if per_pass_check is not None:
        pass_log_rows = 1
    state = build_state(sims, pass_log_rows)
    cfg, pool, rq, wl, wk, st_, max_lease, max_bs = state
    ids = np.arange(len(sims), dtype=np.int64)
    while True:
        replay_batch(cfg, pool, rq, wl, wk, st_, ids, max_lease, max_bs)
        st_.i64[:, L.SM_PASS_LOG_LEN] = 0
        status = st_.i64[:, L.SM_STATUS]
        if np.any(status == L.SIM_ARENA_FULL):
            # same recovery as run_batch: the arena estimate was too small
            sims = [Simulation(s.workload, s.rank, s.workers, s.concurrency,
                               arena_blocks=s.rank.num_gpu_blocks) for s in sims]
            return run_state(sims, per_pass_check, pass_log_rows)
        if per_pass_check is not None:
            per_pass_check(state)
        if np.any(status == L.SIM_DEAD_END):
            return "dead_end"
        if np.all(status == L.SIM_DONE):
            return sims, state


def pool_codes(state):
    """{worker: nonzero check_pool code} over every worker of the state."""
    cfg, pool = state[0], state[1]
    out = {}
    for w in range(pool.w64.shape[0]):
        code = D.check_pool(pool, w, cfg.i64[w, L.CFG_NUM_GPU_BLOCKS])
        if code:
            out[w] = describe(code)
    return out


def lease_codes(state):
    cfg, pool, rq, _, wk, sims = state[:6]
    out = {}
    for s in range(sims.i64.shape[0]):
        q0, nq = sims.i64[s, L.SM_Q_OFF], sims.i64[s, L.SM_Q_LEN]
        w0, nw = sims.i64[s, L.SM_W_OFF], sims.i64[s, L.SM_W_LEN]
        for w in range(w0, w0 + nw):
            code = D.check_leases(pool, rq, w, q0, q0 + nq, cfg.i64[w, L.CFG_BLOCK_SIZE])
            if code:
                out[w] = describe(code)
    return out


def drained_codes(state):
    pool = state[1]
    out = {}
    for w in range(pool.w64.shape[0]):
        code = D.check_drained(pool, w)
        if code:
            out[w] = describe(code)
    return out


def frames_of(sims, state):
    rq, sm = state[2], state[5]
    return [request_frame(sim, rq, int(sm.i64[s, L.SM_Q_OFF]), int(sm.i64[s, L.SM_W_OFF]))
            for s, sim in enumerate(sims)]
