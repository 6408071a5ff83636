"""The tokenization pool ahead of a worker's scheduler (the payload's ``tokenization``).

Measured on the reference (1k trace, three workers, two servers each, 30 ms + 0.01 ms
per prompt token: every one of 1,000 requests): each logical worker has a pool of
``workers`` servers of its own. A request is placed at its arrival, waits for the
pool's earliest free server (the lowest one of equal free times), holds it for
``base_ms + per_input_token_ms * prompt tokens``, and reaches the worker's scheduler
when it is done (``tokenized_ms``); its latencies still count from its arrival.
The request waits in the simulation's release heap meanwhile, as a later turn
waits for its release (``kernels.loop.arrivals``).
"""

from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import (CFG_TOK_SERVERS, CFGF_TOK_BASE_MS, CFGF_TOK_PER_TOKEN_MS,
                                              RQ_PROMPT_LEN, RQF_TOKENIZED_MS, WK_TOK_OFF)


@kernel(cache=True, _nrt=False)
def tokenize(cfg, wk, rq, w, q, arrival_ms):
    """Request q, placed on worker w at ``arrival_ms``, takes a server of w's pool:
    returns (and records) when its prompt is tokenized."""
    off = wk.i64[w, WK_TOK_OFF]
    best = off
    for k in range(off + 1, off + cfg.i64[w, CFG_TOK_SERVERS]):
        if wk.tok_free_ms[k] < wk.tok_free_ms[best]:
            best = k
    start_ms = max(arrival_ms, wk.tok_free_ms[best])
    done_ms = start_ms + (cfg.f64[w, CFGF_TOK_BASE_MS]
                          + cfg.f64[w, CFGF_TOK_PER_TOKEN_MS] * rq.i64[q, RQ_PROMPT_LEN])
    wk.tok_free_ms[best] = done_ms
    rq.f64[q, RQF_TOKENIZED_MS] = done_ms
    return done_ms


# behind the tokenization feature gate (kernels.features): a run without a pool never
# compiles it
tokenize_gated = gate("tokenization", tokenize, 0.0)
