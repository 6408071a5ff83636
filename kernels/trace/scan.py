"""Compiled scanner for the common shape of a Mooncake JSONL trace.

Public Mooncake traces are one flat object per line with integer ``timestamp``,
``input_length``, ``output_length`` and a ``hash_ids`` list of integers. Parsing
them with ``json`` and validating field by field in Python costs most of a 10k-row
load; this scanner reads that shape straight from the file's bytes. Anything else
(another key, a string, a float, a negative number, a duplicate key, an overflow,
an escape) makes it report failure, and the loader then takes its general Python
path, which also produces the file:line error messages. So the scanner only ever
accepts rows whose meaning is unambiguous, and gives exactly what ``json`` would.
"""

import numpy as np
from numba import njit

from aisim_fast.kernels.jit import kernel

SCAN_OK = 0
SCAN_UNSUPPORTED = 1   # not the simple shape: use the general loader

# keys recognized by the scanner (bit per key, to reject duplicates)
_KEY_TIMESTAMP = 1
_KEY_INPUT = 2
_KEY_OUTPUT = 4
_KEY_HASH_IDS = 8

_U64_MAX = np.uint64(0xFFFFFFFFFFFFFFFF)


@kernel(cache=True, inline="always")
def _is_space(c):
    return c == 32 or c == 9 or c == 13


@kernel(cache=True)
def _skip_space(data, i, end):
    while i < end and _is_space(data[i]):
        i += 1
    return i


@kernel(cache=True)
def _parse_uint(data, i, end):
    """(value, next index, ok) of a JSON non-negative integer without sign, fraction
    or exponent (a fraction or exponent is reported as not ok)."""
    if i >= end or data[i] < 48 or data[i] > 57:
        return np.uint64(0), i, False
    if data[i] == 48 and i + 1 < end and 48 <= data[i + 1] <= 57:
        return np.uint64(0), i, False  # leading zero: not JSON
    value = np.uint64(0)
    while i < end and 48 <= data[i] <= 57:
        digit = np.uint64(data[i] - 48)
        if value > (_U64_MAX - digit) // np.uint64(10):
            return np.uint64(0), i, False  # beyond 2**64 - 1
        value = value * np.uint64(10) + digit
        i += 1
    if i < end and (data[i] == 46 or data[i] == 101 or data[i] == 69):  # . e E
        return np.uint64(0), i, False
    return value, i, True


@kernel(cache=True)
def _key_at(data, i, end):
    """(key bit, index after the closing quote) of a quoted key, 0 if unknown."""
    j = i + 1
    while j < end and data[j] != 34:
        if data[j] == 92:  # backslash escape
            return 0, j
        j += 1
    if j >= end:
        return 0, j
    n = j - (i + 1)
    k = i + 1
    key = 0
    if n == 9 and data[k] == 116 and data[k + 8] == 112:  # timestamp
        if data[k + 1] == 105 and data[k + 2] == 109 and data[k + 3] == 101 and data[k + 4] == 115 \
                and data[k + 5] == 116 and data[k + 6] == 97 and data[k + 7] == 109:
            key = _KEY_TIMESTAMP
    elif n == 12 and data[k + 6] == 108:  # input_length
        if data[k] == 105 and data[k + 1] == 110 and data[k + 2] == 112 and data[k + 3] == 117 \
                and data[k + 4] == 116 and data[k + 5] == 95 and data[k + 7] == 101 \
                and data[k + 8] == 110 and data[k + 9] == 103 and data[k + 10] == 116 \
                and data[k + 11] == 104:
            key = _KEY_INPUT
    elif n == 13 and data[k + 7] == 108:  # output_length
        if data[k] == 111 and data[k + 1] == 117 and data[k + 2] == 116 and data[k + 3] == 112 \
                and data[k + 4] == 117 and data[k + 5] == 116 and data[k + 6] == 95 \
                and data[k + 8] == 101 and data[k + 9] == 110 and data[k + 10] == 103 \
                and data[k + 11] == 116 and data[k + 12] == 104:
            key = _KEY_OUTPUT
    elif n == 8 and data[k + 4] == 95:  # hash_ids
        if data[k] == 104 and data[k + 1] == 97 and data[k + 2] == 115 and data[k + 3] == 104 \
                and data[k + 5] == 105 and data[k + 6] == 100 and data[k + 7] == 115:
            key = _KEY_HASH_IDS
    return key, j + 1


@njit(cache=True)
def scan_simple_trace(data, max_rows):
    """Scan ``data`` (uint8 bytes of the file). Returns (status, line_no[r],
    timestamp[r] (NaN if absent), input_len[r] (-1 if absent), output_len[r]
    (-1 if absent), hash_indptr[r+1], hash_ids (uint64)); ``max_rows`` < 0 = all."""
    n = data.shape[0]
    # upper bounds: rows <= newlines + 1, hash ids <= commas + rows
    n_lines = 1
    n_commas = 0
    for i in range(n):
        if data[i] == 10:
            n_lines += 1
        elif data[i] == 44:
            n_commas += 1
    line_no = np.empty(n_lines, np.int64)
    ts = np.empty(n_lines, np.float64)
    input_len = np.empty(n_lines, np.int64)
    output_len = np.empty(n_lines, np.int64)
    indptr = np.zeros(n_lines + 1, np.int64)
    hashes = np.empty(n_commas + n_lines, np.uint64)
    rows = 0
    nnz = 0
    pos = 0
    line = 0
    while pos < n:
        if max_rows >= 0 and rows >= max_rows:
            break
        line += 1
        end = pos
        while end < n and data[end] != 10:
            end += 1
        i = _skip_space(data, pos, end)
        next_pos = end + 1
        if i == end:  # blank line
            pos = next_pos
            continue
        if data[i] != 123:  # {
            return SCAN_UNSUPPORTED, line_no[:0], ts[:0], input_len[:0], output_len[:0], indptr[:1], hashes[:0]
        seen = 0
        row_ts = np.nan
        row_in = -1
        row_out = -1
        i = _skip_space(data, i + 1, end)
        ok = True
        if i < end and data[i] == 125:  # {} : no hash_ids, let the loader say so
            ok = False
        while ok:
            if i >= end or data[i] != 34:
                ok = False
                break
            key, i = _key_at(data, i, end)
            if key == 0 or (seen & key) != 0:
                ok = False
                break
            seen |= key
            i = _skip_space(data, i, end)
            if i >= end or data[i] != 58:  # :
                ok = False
                break
            i = _skip_space(data, i + 1, end)
            if key == _KEY_HASH_IDS:
                if i >= end or data[i] != 91:  # [
                    ok = False
                    break
                i = _skip_space(data, i + 1, end)
                if i < end and data[i] == 93:  # empty list: the loader's error
                    ok = False
                    break
                while True:
                    v, i, good = _parse_uint(data, i, end)
                    if not good:
                        ok = False
                        break
                    hashes[nnz] = v
                    nnz += 1
                    i = _skip_space(data, i, end)
                    if i < end and data[i] == 44:
                        i = _skip_space(data, i + 1, end)
                        continue
                    if i < end and data[i] == 93:
                        i += 1
                        break
                    ok = False
                    break
                if not ok:
                    break
            else:
                v, i, good = _parse_uint(data, i, end)
                if not good or v >= np.uint64(1 << 53):
                    ok = False
                    break
                if key == _KEY_TIMESTAMP:
                    row_ts = np.float64(v)
                elif key == _KEY_INPUT:
                    row_in = np.int64(v)
                else:
                    row_out = np.int64(v)
            i = _skip_space(data, i, end)
            if i < end and data[i] == 44:
                i = _skip_space(data, i + 1, end)
                continue
            if i < end and data[i] == 125:
                i = _skip_space(data, i + 1, end)
                if i != end:
                    ok = False
                break
            ok = False
        if not ok or (seen & _KEY_HASH_IDS) == 0:
            return SCAN_UNSUPPORTED, line_no[:0], ts[:0], input_len[:0], output_len[:0], indptr[:1], hashes[:0]
        line_no[rows] = line
        ts[rows] = row_ts
        input_len[rows] = row_in
        output_len[rows] = row_out
        indptr[rows + 1] = nnz
        rows += 1
        pos = next_pos
    return (SCAN_OK, line_no[:rows], ts[:rows], input_len[:rows], output_len[:rows],
            indptr[:rows + 1], hashes[:nnz])
