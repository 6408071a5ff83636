"""One output token of a request at its pass end, for every backend: the token
counters and times of the request (first, second, last token), the kv_router's
first-token release, the running fold of equal token gaps into the simulation's
token statistics (``stats.sketch``), and the opt-in output-event log.

Inside an attention-DP group pass (``SM_GROUP_PASS``) the token is counted at once
(the rest of the rank's pass reads the count) but its time is the group's end, known
only once every rank of the group ran: the request is queued and ``token_times``
gives the times then (kernels.dp.attention_dp)."""

import numpy as np

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import note_event_at, outputs_logged
from aisim_fast.kernels.routing.kv_router import first_token_seen_gated
from aisim_fast.kernels.schema.layout import (EV_OUTPUT, RQ_GENERATED, RQ_NO_TOKEN_STATS, RQ_RT_PENDING,
                                              RQ_STATUS, RQ_TOKEN_NEXT, RQ_WORKER, RQF_FIRST_TOKEN_MS,
                                              RQF_LAST_TOKEN_MS, RQF_SECOND_TOKEN_MS, RS_DONE, SM_GROUP_PASS,
                                              SM_TOKEN_HEAD, SM_TOKEN_TAIL, WK_STAT_ROW)
from aisim_fast.kernels.stats.sketch import fold_gap_run


@kernel(cache=True, _nrt=False, inline="always")
def emit_token(cfg, p, rq, wk, sims, s, w, q, end_ms, run_gap, run_count, log_outputs, is_last):
    """q emits a token at ``end_ms``. (run_gap, run_count) is the current run of equal
    token gaps of this pass, folded into the token statistics when the gap changes;
    returns (it updated, the request's tokens so far). ``is_last``: the request is
    done with this token (only read by the output log)."""
    g = rq.i64[q, RQ_GENERATED] + 1
    rq.i64[q, RQ_GENERATED] = g
    if sims.i64[s, SM_GROUP_PASS] != 0:
        tail = sims.i64[s, SM_TOKEN_TAIL]
        if tail < 0:
            sims.i64[s, SM_TOKEN_HEAD] = q
        else:
            rq.i64[tail, RQ_TOKEN_NEXT] = q
        sims.i64[s, SM_TOKEN_TAIL] = q
        rq.i64[q, RQ_TOKEN_NEXT] = -1
        return run_gap, run_count, g
    return time_token(cfg, p, rq, wk, sims, s, w, q, g, end_ms, run_gap, run_count, log_outputs, is_last)


@kernel(cache=True, _nrt=False, inline="always")
def time_token(cfg, p, rq, wk, sims, s, w, q, g, end_ms, run_gap, run_count, log_outputs, is_last):
    """The time part of q's g-th token, emitted at ``end_ms``."""
    if g == 1:
        rq.f64[q, RQF_FIRST_TOKEN_MS] = end_ms
        if rq.i64[q, RQ_RT_PENDING] != 0:
            first_token_seen_gated(cfg.features, rq, wk, w, q)
    else:
        if g == 2:
            rq.f64[q, RQF_SECOND_TOKEN_MS] = end_ms
        if rq.i64[q, RQ_NO_TOKEN_STATS] == 0:
            gap_ms = end_ms - rq.f64[q, RQF_LAST_TOKEN_MS]
            if gap_ms != run_gap:
                fold_gap_run(sims.token_stat, sims.token_hist, wk.i64[w, WK_STAT_ROW], run_gap, run_count)
                run_gap = gap_ms
                run_count = 0
            run_count += 1
    rq.f64[q, RQF_LAST_TOKEN_MS] = end_ms
    if log_outputs:
        note_event_at(p, w, EV_OUTPUT, q, g, np.int64(1 if is_last else 0),
                      np.float64(end_ms).view(np.int64))
    return run_gap, run_count, g


@kernel(cache=True, _nrt=False)
def token_times(cfg, p, rq, wk, sims, s, end_ms):
    """Give the tokens a group pass queued their time, the group's end, in the order
    they were emitted (rank by rank); returns how many."""
    log_outputs = outputs_logged(p, s)
    run_gap = 0.0
    run_count = 0
    n = 0
    q = sims.i64[s, SM_TOKEN_HEAD]
    while q >= 0:
        # one token per request and pass: its count is the token's index; the request
        # is done after the pass exactly when this token was its last
        run_gap, run_count, _ = time_token(cfg, p, rq, wk, sims, s, rq.i64[q, RQ_WORKER], q,
                                            rq.i64[q, RQ_GENERATED], end_ms, run_gap, run_count,
                                            log_outputs, rq.i64[q, RQ_STATUS] == RS_DONE)
        n += 1
        q = rq.i64[q, RQ_TOKEN_NEXT]
    # a group's ranks share their simulation's row (attention DP is never independent)
    fold_gap_run(sims.token_stat, sims.token_hist, s, run_gap, run_count)
    sims.i64[s, SM_TOKEN_HEAD] = -1
    sims.i64[s, SM_TOKEN_TAIL] = -1
    return n
