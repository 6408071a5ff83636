"""What a request may generate on its rank, decided before it runs: the output budget
(the rank's clamps) and, for a turn whose output feeds its session's next prompt, what
it emits outright (rejections, ``max_model_len``)."""

from __future__ import annotations

import numpy as np


def output_budget(rank, prompt_len, output_len) -> np.ndarray:
    """The output budget of requests on the rank that generates them: TRT-LLM clamps it
    to the pool when the prompt fits in it; SGLang to ``max_model_len`` (sglang.md 2;
    a prompt at or past the limit is rejected by the pass instead)."""
    prompt = np.asarray(prompt_len, np.int64)
    out = np.asarray(output_len, np.int64)
    if rank.backend == "trtllm":
        pool_tokens = rank.num_gpu_blocks * rank.block_size
        fits = prompt < pool_tokens
        out = np.where(fits, np.minimum(out, pool_tokens - prompt), out)
    elif rank.backend == "sglang" and rank.max_model_len is not None:
        fits = prompt < rank.max_model_len
        out = np.where(fits, np.minimum(out, rank.max_model_len - prompt), out)
    return out


def emitted_outright(rank, prompt_len, output_len) -> np.ndarray:
    """The output tokens fresh requests emit on an aggregated rank, as far as the rank
    decides it before they run: none when rejected (a prompt at or past
    ``max_model_len``; a pool it can never fit: vLLM its prompt's blocks, TRT-LLM its
    prompt's and budget's), else the output budget cut at ``max_model_len``. What a
    delta trace's or a session load's next turn carries (``session_history``)."""
    prompt = np.asarray(prompt_len, np.int64)
    out = output_budget(rank, prompt, output_len)
    rejected = np.zeros(prompt.shape, bool)
    if rank.max_model_len is not None:
        out = np.clip(np.minimum(out, rank.max_model_len - prompt), 0, None)
        rejected |= prompt >= rank.max_model_len
    if rank.backend == "vllm":
        rejected |= -(-prompt // rank.block_size) > rank.num_gpu_blocks
    elif rank.backend == "trtllm":
        rejected |= -(-(prompt + out) // rank.block_size) > rank.num_gpu_blocks
    return np.where(rejected, 0, out)
