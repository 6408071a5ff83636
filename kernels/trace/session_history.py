"""Filling the sessions' conversations of a delta trace (``trace.session_history``):
each row's new input synthesised from its hash ids, then the output tokens it emits,
written straight into the conversation array (no per-token index arrays: a
million-row trace's conversations are gigabytes already)."""

from numba import njit

from aisim_fast.kernels.trace.output_plan import output_token_ids


@njit(cache=True, _nrt=False)
def fill_conversations(hash_indptr, hash_ids, trace_block_size, input_len, emitted, out_plan, out_authored,
                       piece_start, conversation):
    """Row r's piece of ``conversation`` at ``piece_start[r]``: its ``input_len[r]``
    prompt tokens (block i is ``trace_block_size`` copies of the row's i-th hash id, the
    last cut short), then the first ``emitted[r]`` of its output token ids (authored, or
    its slice of the plan stream)."""
    for r in range(input_len.shape[0]):
        at = piece_start[r]
        h0 = hash_indptr[r]
        for k in range(input_len[r]):
            conversation[at + k] = hash_ids[h0 + k // trace_block_size]
        if emitted[r] > 0:
            output_token_ids(out_plan, out_authored, r, 0, emitted[r], conversation, at + input_len[r])
