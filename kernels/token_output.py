"""One output token of a request at its pass end, for every backend: the token
counters and times of the request (first, second, last token), the kv_router's
first-token release, the running fold of equal token gaps into the simulation's
token statistics (``sketch``), and the opt-in output-event log."""

import numpy as np
from numba import njit

from .block_pool import note_event_at
from .kv_router import first_token_seen
from .layout import (EV_OUTPUT, RQF_FIRST_TOKEN_MS, RQF_LAST_TOKEN_MS, RQF_SECOND_TOKEN_MS,
                     RQ_GENERATED, RQ_RT_PENDING)
from .sketch import fold_gap_run


@njit(cache=True, _nrt=False, inline="always")
def emit_token(p, rq, wk, sims, s, w, q, end_ms, run_gap, run_count, log_outputs, is_last):
    """q emits a token at ``end_ms``. (run_gap, run_count) is the current run of equal
    token gaps of this pass, folded into the token statistics when the gap changes;
    returns (it updated, the request's tokens so far). ``is_last``: the request is
    done with this token (only read by the output log)."""
    g = rq.i64[q, RQ_GENERATED] + 1
    rq.i64[q, RQ_GENERATED] = g
    if g == 1:
        rq.f64[q, RQF_FIRST_TOKEN_MS] = end_ms
        if rq.i64[q, RQ_RT_PENDING] != 0:
            first_token_seen(rq, wk, w, q)
    else:
        if g == 2:
            rq.f64[q, RQF_SECOND_TOKEN_MS] = end_ms
        gap_ms = end_ms - rq.f64[q, RQF_LAST_TOKEN_MS]
        if gap_ms != run_gap:
            fold_gap_run(sims.token_stat, sims.token_hist, s, run_gap, run_count)
            run_gap = gap_ms
            run_count = 0
        run_count += 1
    rq.f64[q, RQF_LAST_TOKEN_MS] = end_ms
    if log_outputs:
        note_event_at(p, w, EV_OUTPUT, q, g, np.int64(1 if is_last else 0),
                      np.float64(end_ms).view(np.int64))
    return run_gap, run_count, g
