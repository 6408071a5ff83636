"""Conversation history as the prompt: the ``mooncake-delta`` trace format.

In a delta trace a later turn's row carries only its *new* input (its own
``input_length`` and ``hash_ids``); the prompt the engine sees is the session's
history so far -- every earlier turn's new input followed by the output tokens that
turn generated -- and then the row's own tokens. A session of turns with new inputs
``in_0, in_1, ...`` and outputs ``out_0, out_1, ...`` therefore sends prompts of
``in_0``, ``in_0 + out_0 + in_1``, ... tokens (the reference's rows: 1282, then
1282 + 219 + 1939 = 3440).

The output tokens are the rows' planned output (``kernels.trace.output_plan``), the
ids the reference's engine emits, so the history's blocks hash as the reference's
do and a turn reuses the blocks its predecessor cached (prompt and generated
tokens). The history holds the tokens a turn *emits*: a turn cut short by
``max_model_len``, or rejected by it, contributes fewer or none (``emitted_lengths``).
A turn rejected for want of KV capacity also emits none; whether the engine rejects
it is not known before the run, so a turn whose history cannot fit the KV pool is
warned of (``warn_unfit_turns``) and run with its whole output.

The prompts are materialised up front, as the reference does: memory is the sum of
every turn's whole prompt (quadratic in turns per session), stored as one uint32
token per entry (``Workload.trace_block_size`` 1).
"""

from __future__ import annotations

import warnings

import numpy as np

from aisim_fast.kernels.trace.output_plan import plan_words
from aisim_fast.trace.workload import Workload


def own_tokens(w: Workload) -> tuple[np.ndarray, np.ndarray]:
    """(int64[q + 1], uint32[nnz]): every row's tokens synthesised from its own hash
    ids (``workload.prompt_tokens`` of each row), CSR over rows in file order."""
    block = w.trace_block_size
    n_ids = np.diff(w.hash_indptr)
    # token k of a row is its hash id number k // block: repeat each id block times,
    # then cut each row at its input length
    per_id = np.repeat(w.hash_ids, block)
    first = w.hash_indptr[:-1] * block
    lens = w.input_len.astype(np.int64)
    if np.any(lens > n_ids * block):
        raise ValueError("a row's input_length exceeds the capacity of its hash_ids")
    indptr = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=indptr[1:])
    take = np.repeat(first - indptr[:-1], lens) + np.arange(indptr[-1], dtype=np.int64)
    return indptr, per_id[take]


def output_tokens(w: Workload) -> tuple[np.ndarray, np.ndarray]:
    """(int64[q + 1], uint32[nnz]): every row's output token ids (authored, or its
    slice of the plan stream), CSR over rows in file order."""
    out_plan, authored = w.output_plan()
    lens = w.output_len.astype(np.int64)
    indptr = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=indptr[1:])
    planned = out_plan >= 0
    n_words = int((out_plan[planned] + lens[planned]).max(initial=0))
    stream = np.empty(n_words, np.uint32)
    if n_words:
        plan_words(0, n_words, stream, 0)
    # each row's source: its plan words, or its authored ids
    src_start = np.where(planned, out_plan, -1 - out_plan)
    source = np.concatenate([stream, authored.astype(np.uint32)])
    base = np.where(planned, 0, n_words) + src_start
    take = np.repeat(base - indptr[:-1], lens) + np.arange(indptr[-1], dtype=np.int64)
    return indptr, source[take]


def emitted_lengths(w: Workload, max_model_len: int | None) -> np.ndarray:
    """int64[q]: the output tokens each turn emits, so the history the next turn
    carries. Within ``max_model_len`` a turn whose prompt reaches the limit is
    rejected (none) and one whose prompt plus output passes it stops at the limit;
    without a limit every turn emits its whole output. Prompts grow with the history,
    so sessions are walked a turn index at a time."""
    out_len = w.output_len.astype(np.int64)
    if max_model_len is None or max_model_len < 0:
        return out_len
    in_len = w.input_len.astype(np.int64)
    emitted = np.zeros(w.num_requests, np.int64)
    history = np.zeros(int(w.session.max(initial=-1)) + 1, np.int64)  # per session
    for turn in range(int(w.turn_index.max(initial=-1)) + 1):
        rows = np.flatnonzero(w.turn_index == turn)
        prompt = history[w.session[rows]] + in_len[rows]
        emitted[rows] = np.clip(np.minimum(out_len[rows], max_model_len - prompt), 0, None)
        history[w.session[rows]] = prompt + emitted[rows]
    return emitted


def with_session_history(w: Workload, max_model_len: int | None = None) -> Workload:
    """The delta trace ``w`` (rows of new input only) with every turn's prompt made the
    session's history: earlier turns' new input and the output they emit
    (``emitted_lengths``), then its own input."""
    own_ptr, own = own_tokens(w)
    out_ptr, out = output_tokens(w)
    in_len = w.input_len.astype(np.int64)
    emitted = emitted_lengths(w, max_model_len)
    n = w.num_requests
    # the sessions' conversations laid end to end: rows session-major, each row's new
    # input then the output it emits
    rows = np.argsort(w.session, kind="stable")
    piece = in_len[rows] + emitted[rows]
    piece_start = np.zeros(n, np.int64)
    piece_start[rows] = np.cumsum(piece) - piece
    conversation = np.empty(int(piece.sum()), np.uint32)
    conversation[np.repeat(piece_start - own_ptr[:-1], in_len)
                 + np.arange(own_ptr[-1], dtype=np.int64)] = own
    # a row's first ``emitted`` output tokens, after its input
    src = np.repeat(out_ptr[:-1], emitted) + _ranks(emitted)
    conversation[np.repeat(piece_start + in_len, emitted) + _ranks(emitted)] = out[src]
    # a turn's prompt: its session's conversation from the start up to its own input's end
    first_turn = np.zeros(int(w.session.max(initial=-1)) + 1, np.int64)
    opening = w.turn_index == 0
    first_turn[w.session[opening]] = piece_start[opening]
    base = first_turn[w.session]
    prompt_len = piece_start + in_len - base
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(prompt_len, out=indptr[1:])
    take = np.repeat(base - indptr[:-1], prompt_len) + np.arange(indptr[-1], dtype=np.int64)
    out_plan, authored = w.output_plan()
    return w._replace(
        trace_block_size=1,
        input_len=prompt_len,
        hash_indptr=indptr,
        hash_ids=conversation[take],
        out_plan=out_plan,
        authored_tokens=None if not len(authored) else authored,
    )


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, .., counts[0] - 1, 0, 1, .., counts[1] - 1, ...: each entry's place in its run."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) - np.repeat(ends - counts, counts)


class HistoryWarning(UserWarning):
    """A delta trace's history may differ from the reference's."""


def warn_unfit_turns(w: Workload, pool_tokens: int) -> None:
    """Warn once when a turn that feeds a later one holds more tokens (prompt and
    output) than one rank's KV pool (``pool_tokens``): the engine would reject it, and
    the reference's next turn then carries none of its output where this run's
    carries all of it."""
    total = w.input_len.astype(np.int64) + w.output_len.astype(np.int64)
    last_row = np.full(int(w.session.max(initial=-1)) + 1, -1, np.int64)
    last_row[w.session] = np.arange(w.num_requests)
    feeds = np.ones(w.num_requests, bool)
    feeds[last_row] = False
    unfit = np.flatnonzero(feeds & (total > pool_tokens))
    if len(unfit):
        q = int(unfit[0])
        warnings.warn(
            f"{w.path}:{int(w.line_no[q])}: turn {int(w.turn_index[q])} of session {w.request_name[q]!r} "
            f"holds {int(total[q])} tokens, more than a rank's KV pool ({pool_tokens}); the engine "
            f"rejects it, and the next turn's history here still carries its whole output (the "
            f"reference's carries none); {len(unfit)} such turns", HistoryWarning, stacklevel=2)
