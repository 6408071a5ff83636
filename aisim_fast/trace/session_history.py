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
``max_model_len``, or rejected by it or by a KV pool it can never fit, contributes
fewer or none, and one whose budget the rank clamps (TRT-LLM: to its pool) adds what
it emits (``emitted_lengths``; the rank's rule, known before the run on an aggregated
rank). Where the rule is not known (a disaggregated pair), a turn whose
history cannot fit the KV pool is warned of (``warn_unfit_turns``) and run with its
whole output.

The prompts are materialised up front, as the reference does, one uint32 token per
entry (``Workload.trace_block_size`` 1), but each session's conversation is stored
once and every turn's prompt is a prefix of it: memory is linear in the trace's
tokens (new input and output), not in the sum of its prompts.
"""

from __future__ import annotations

import warnings

import numpy as np

from aisim_fast.kernels.jit import compile_notice, mark_compiled
from aisim_fast.kernels.trace.session_history import fill_conversations
from aisim_fast.trace.workload import Workload


def emitted_lengths(w: Workload, emits=None) -> np.ndarray:
    """int64[q]: the output tokens each turn emits, so the history the next turn
    carries: ``emits(prompt_len, output_len)`` of every turn (vectors; the rank's rule,
    ``engine.output_budget.emitted_outright``), or its whole output when None. Prompts grow
    with the history, so sessions are walked a turn index at a time."""
    out_len = w.output_len.astype(np.int64)
    if emits is None:
        return out_len
    in_len = w.input_len.astype(np.int64)
    emitted = np.zeros(w.num_requests, np.int64)
    history = np.zeros(int(w.session.max(initial=-1)) + 1, np.int64)  # per session
    for turn in range(int(w.turn_index.max(initial=-1)) + 1):
        rows = np.flatnonzero(w.turn_index == turn)
        prompt = history[w.session[rows]] + in_len[rows]
        emitted[rows] = emits(prompt, out_len[rows])
        history[w.session[rows]] = prompt + emitted[rows]
    return emitted


def with_session_history(w: Workload, emits=None) -> Workload:
    """The delta trace ``w`` (rows of new input only) with every turn's prompt made the
    session's history: earlier turns' new input and the output they emit
    (``emitted_lengths`` with ``emits``), then its own input.

    Storage is linear in the rows, not in their prompts: each session's conversation
    (every turn's new input, then the output it emits) is laid once in ``hash_ids``, and
    a turn's prompt is a prefix of it: its ``hash_indptr`` entry is the session's start,
    so rows of a session share ids (``Workload``: starts only, the last entry the
    array's length)."""
    in_len = w.input_len.astype(np.int64)
    emitted = emitted_lengths(w, emits)
    n = w.num_requests
    if np.any(in_len > np.diff(w.hash_indptr) * w.trace_block_size):
        raise ValueError("a row's input_length exceeds the capacity of its hash_ids")
    # rows session-major, each row's piece its new input then the output it emits
    rows = np.argsort(w.session, kind="stable")
    piece = in_len[rows] + emitted[rows]
    piece_start = np.zeros(n, np.int64)
    piece_start[rows] = np.cumsum(piece) - piece
    out_plan, authored = w.output_plan()
    conversation = np.empty(int(piece.sum()), np.uint32)
    compile_notice(["trace"])
    fill_conversations(w.hash_indptr, w.hash_ids, w.trace_block_size, in_len, emitted, out_plan,
                       authored.astype(np.uint32), piece_start, conversation)
    mark_compiled("trace")
    # a turn's prompt: its session's conversation from the start up to its own input's end
    first_turn = np.zeros(int(w.session.max(initial=-1)) + 1, np.int64)
    opening = w.turn_index == 0
    first_turn[w.session[opening]] = piece_start[opening]
    base = first_turn[w.session]
    return w._replace(
        trace_block_size=1,
        input_len=piece_start + in_len - base,
        hash_indptr=np.append(base, len(conversation)).astype(np.int64),
        hash_ids=conversation,
        out_plan=out_plan,
        authored_tokens=None if not len(authored) else authored,
    )


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
