"""What a request still needs, from its counters: shared by every backend.
"""


from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import CFG_MAX_MODEL_LEN, RQ_GENERATED, RQ_MAX_OUTPUT, RQ_PROMPT_LEN


@kernel(cache=True, _nrt=False)
def ceil_div(a, b):
    return (a + b - 1) // b


@kernel(cache=True, _nrt=False, inline="always")
def seq_len(rq, q):
    return rq.i64[q, RQ_PROMPT_LEN] + rq.i64[q, RQ_GENERATED]


@kernel(cache=True, _nrt=False, inline="always")
def remaining_tokens(max_output, generated, prompt, limit):
    """Tokens still to generate, from scalars: hot loops call this one because a
    helper that receives arrays reference-counts them on every call."""
    rem = max_output - generated
    if limit >= 0:
        rem = min(rem, limit - prompt - generated)
    return rem


@kernel(cache=True, _nrt=False, inline="always")
def remaining_generation(cfg, rq, w, q):
    """Tokens still to generate: output budget, and ``max_model_len`` when set."""
    rem = rq.i64[q, RQ_MAX_OUTPUT] - rq.i64[q, RQ_GENERATED]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]
    if limit >= 0:
        rem = min(rem, limit - seq_len(rq, q))
    return rem
