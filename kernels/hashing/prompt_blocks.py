"""Prompt block hashes of trace rows, computed once per (trace, engine block size)
and shared by every simulation of a batch that replays that trace."""

import numpy as np
from numba import njit

from aisim_fast.kernels.hashing.xxh3 import XXH3_SEED, hash_chain, xxh3_64_u32


@njit(cache=True)
def count_prompt_blocks(input_len, block_size):
    """CSR row pointer of the complete prompt blocks of every row."""
    indptr = np.zeros(input_len.shape[0] + 1, np.int64)
    for r in range(input_len.shape[0]):
        indptr[r + 1] = indptr[r] + input_len[r] // block_size
    return indptr


@njit(cache=True)
def hash_prompt_blocks(hash_indptr, hash_ids, input_len, trace_block_size, block_size,
                       phash_indptr, phash):
    """Sequence hashes (XXH3-64 seed 1337, chained parent||local) of the complete
    engine blocks of each row's synthesized prompt: block i of ``hash_ids`` is
    ``trace_block_size`` copies of the interned id, truncated at ``input_len``."""
    tokens = np.empty(block_size, np.uint32)
    for r in range(input_len.shape[0]):
        h0 = hash_indptr[r]
        parent = np.uint64(0)
        for i in range(phash_indptr[r + 1] - phash_indptr[r]):
            # fill run by run: one trace block spans many engine tokens
            pos = i * block_size
            end = pos + block_size
            j = 0
            while pos < end:
                run_end = min(end, (pos // trace_block_size + 1) * trace_block_size)
                token = hash_ids[h0 + pos // trace_block_size]
                while pos < run_end:
                    tokens[j] = token
                    j += 1
                    pos += 1
            local = xxh3_64_u32(tokens, 0, block_size, XXH3_SEED)
            if i == 0:
                parent = local
            else:
                parent = hash_chain(parent, local)
            phash[phash_indptr[r] + i] = parent
