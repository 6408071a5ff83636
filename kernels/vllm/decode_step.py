"""The decode step shared by every path that schedules a running request of the
vLLM core: the pass's fast path (``vllm.core.run_pass``), the full schedule step
(``vllm.core.schedule_request``) and runs of decode passes (``vllm.decode_run``) all
record what a request was scheduled for in a pass with ``stamp_scheduled``, and
classify its contribution to the pass's timing with ``classify``.

What a pass records per scheduled request (``RQ_SCHED_*``) is what a later
preemption in the same pass undoes and what the pass log counts, so the three
paths must write it identically: here is the one place that does.
"""


from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.loop.request_state import remaining_tokens
from aisim_fast.kernels.schema.layout import (ACC_BUDGET, ACC_COMPLETE, ACC_DECODE_BATCH, ACC_DECODE_KV,
                                              ACC_SCHEDULED_TOKENS, RQ_ALLOCATED, RQ_FAST_LIMIT, RQ_GENERATED,
                                              RQ_MAX_OUTPUT, RQ_NUM_COMPUTED, RQ_PROMPT_LEN, RQ_SCHED_CLASS,
                                              RQ_SCHED_LEN, RQ_SCHED_PREFIX, RQ_SCHED_PROMPT, RQ_SCHED_STAMP,
                                              RQ_SCHED_TERMINAL, RQ_SCHED_TOKENS)

# what a scheduled request contributes to its pass's timing (RQ_SCHED_CLASS)
CLASS_NONE = 0      # not ready to emit (prompt chunk pending), or a free first token
CLASS_DECODE = 1    # in the decode batch
CLASS_COMPLETE = 2  # ready with nothing left to generate: a terminal without a token


@kernel(cache=True, _nrt=False, inline="always")
def classify(acc, computed, length, remaining, free_first_token):
    """Class of a request just scheduled up to ``computed`` tokens of ``length``;
    adds it to the pass's decode-batch counters (``acc[ACC_DECODE_BATCH]`` requests, ``acc[ACC_DECODE_KV]``
    their KV tokens, ``acc[ACC_COMPLETE]`` complete ones)."""
    if computed < length:
        return CLASS_NONE
    if remaining <= 0:
        acc[ACC_COMPLETE] += 1
        return CLASS_COMPLETE
    if free_first_token:
        return CLASS_NONE
    acc[ACC_DECODE_BATCH] += 1
    acc[ACC_DECODE_KV] += length
    return CLASS_DECODE


@kernel(cache=True, _nrt=False, inline="always")
def stamp_scheduled(rq_i, q, stamp, used, prompt_tokens, prompt_before, length, terminal,
                    sched_class):
    """Record that q was scheduled in the pass ``stamp``: ``used`` tokens, of which
    ``prompt_tokens`` prompt tokens after ``prompt_before`` computed ones, at sequence
    length ``length``; ``terminal`` = nothing left to generate afterwards."""
    rq_i[q, RQ_SCHED_STAMP] = stamp
    rq_i[q, RQ_SCHED_TOKENS] = used
    rq_i[q, RQ_SCHED_PROMPT] = prompt_tokens
    rq_i[q, RQ_SCHED_PREFIX] = prompt_before
    rq_i[q, RQ_SCHED_LEN] = length
    rq_i[q, RQ_SCHED_TERMINAL] = 1 if terminal else 0
    rq_i[q, RQ_SCHED_CLASS] = sched_class


@kernel(cache=True, _nrt=False, inline="always")
def fast_decode_step(rq_i, q, acc, stamp, limit):
    """The bulk of all scheduling: a running request past its prompt whose next
    tokens fit in its last block and complete no block. Does exactly what the full
    schedule step does in that case and returns the tokens scheduled; returns 0,
    changing nothing, when q needs the full step (``RQ_FAST_LIMIT`` stands for
    "after // bs == before // bs and ceil(after / bs) <= ceil(allocated / bs)"
    without four integer divisions)."""
    before = rq_i[q, RQ_NUM_COMPUTED]
    prompt = rq_i[q, RQ_PROMPT_LEN]
    if before < prompt:
        return 0
    generated = rq_i[q, RQ_GENERATED]
    used = min(prompt + generated - before, acc[ACC_BUDGET])
    after = before + used
    if used <= 0 or after > rq_i[q, RQ_FAST_LIMIT]:
        return 0
    if after > rq_i[q, RQ_ALLOCATED]:
        rq_i[q, RQ_ALLOCATED] = after
    rq_i[q, RQ_NUM_COMPUTED] = after
    rem = remaining_tokens(rq_i[q, RQ_MAX_OUTPUT], generated, prompt, limit)
    stamp_scheduled(rq_i, q, stamp, used, 0, prompt, prompt + generated, rem <= 0,
                    classify(acc, after, prompt + generated, rem, False))
    acc[ACC_BUDGET] -= used
    acc[ACC_SCHEDULED_TOKENS] += used
    return used
