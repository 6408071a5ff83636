"""Public request-length traces in CSV, read as trace formats (beyond the reference,
which reads none of them): the Azure LLM inference traces (2023 and 2024) and
BurstGPT.

Both record when each request arrived and its prompt and output lengths, but no
prompt content, so every request is its own single-turn session whose prompt shares
no block with any other (as the reference treats length-only prompts): prefix
caching finds nothing to reuse, and what a run measures is load, batching and KV
capacity.

* ``azure`` (``AzureLLMInferenceTrace_{code,conv}.csv`` of 2023,
  ``AzureLLMInferenceTrace_{code,conv}_1week.csv`` of 2024): ``TIMESTAMP`` (wall
  clock, e.g. ``2023-11-16 18:17:03.9799600`` or with a ``+00:00`` offset),
  ``ContextTokens`` (prompt), ``GeneratedTokens`` (output).
* ``burstgpt`` (``BurstGPT_*.csv``): ``Timestamp`` (seconds from the trace start),
  ``Request tokens`` (prompt), ``Response tokens`` (output; 0 for a failed request,
  kept as a request that generates nothing); ``Model`` and ``Log Type`` are not
  read (cut the file to one model first if it mixes them).

Arrivals are re-based so the first request arrives at 0 and divided by
``arrival_speedup_ratio``, as a Mooncake trace's. Rows keep file order for equal
arrivals. A row that cannot be read (a missing or negative length, an unparsable
timestamp, a prompt of 0 tokens) is an error naming the file and its line.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd

from aisim_fast.trace.workload import TraceError, Workload, read_trace_bytes

# beyond the reference: named as such where a run reports its trace format
PUBLIC_CSV_FORMATS = ("azure", "burstgpt")
# (arrival column, prompt column, output column) of each format's header
_COLUMNS = {"azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
            "burstgpt": ("Timestamp", "Request tokens", "Response tokens")}
_BLOCK = 512  # tokens per generated block id (any size works: no id repeats across rows)


def load_public_csv(path, trace_format: str, *, arrival_speedup_ratio: float = 1.0,
                    max_rows: int | None = None) -> Workload:
    """Load an ``azure`` or ``burstgpt`` CSV (gzip-compressed too) as a ``Workload``."""
    if trace_format not in PUBLIC_CSV_FORMATS:
        raise ValueError(f"trace_format must be one of {', '.join(PUBLIC_CSV_FORMATS)}, got {trace_format!r}")
    path_str = str(path)
    at_col, in_col, out_col = _COLUMNS[trace_format]
    try:
        frame = pd.read_csv(io.BytesIO(read_trace_bytes(path_str)), nrows=max_rows, dtype=str,
                            keep_default_na=False, skipinitialspace=True)
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise TraceError(path_str, None, f"not a readable CSV ({str(exc).strip()})") from None
    except pd.errors.EmptyDataError:
        raise TraceError(path_str, None, "no requests (the file is empty)") from None
    missing = [c for c in (at_col, in_col, out_col) if c not in frame.columns]
    if missing:
        raise TraceError(path_str, 1, f"the header lacks {', '.join(repr(c) for c in missing)} of a "
                                      f"{trace_format} trace (it has {', '.join(map(repr, frame.columns))})")
    if not len(frame):
        raise TraceError(path_str, None, "no requests (only a header)")
    line_no = np.arange(2, len(frame) + 2, dtype=np.int64)  # the header is line 1
    input_len = _lengths(frame[in_col], in_col, path_str, line_no, minimum=1)
    output_len = _lengths(frame[out_col], out_col, path_str, line_no, minimum=0)
    if trace_format == "azure":
        stamps = pd.to_datetime(frame[at_col], format="ISO8601", utc=True, errors="coerce")
        bad = stamps.isna().to_numpy()
        arrival_ms = (stamps - stamps.min()).dt.total_seconds().to_numpy() * 1000.0 if not bad.all() else None
    else:
        seconds = pd.to_numeric(frame[at_col], errors="coerce").to_numpy(np.float64)
        bad = ~np.isfinite(seconds)
        arrival_ms = (seconds - np.nanmin(seconds)) * 1000.0 if not bad.all() else None
    if bad.any():
        q = int(np.argmax(bad))
        raise TraceError(path_str, int(line_no[q]), f"{at_col} {frame[at_col].iloc[q]!r} is not a "
                                                    f"{'timestamp' if trace_format == 'azure' else 'number of seconds'}")
    start_ms = np.asarray(arrival_ms, np.float64) / float(arrival_speedup_ratio)
    n = len(frame)
    n_ids = -(-input_len // _BLOCK)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(n_ids, out=indptr[1:])
    names = np.empty(n, dtype=object)
    names[:] = [f"request_{k}" for k in line_no.tolist()]
    return Workload(
        path=path_str,
        trace_block_size=_BLOCK,
        line_no=line_no,
        request_name=names,
        session=np.arange(n, dtype=np.int32),
        turn_index=np.zeros(n, np.int32),
        start_ms=start_ms,
        delay_ms=np.zeros(n, np.float64),
        input_len=input_len,
        output_len=output_len,
        hash_indptr=indptr,
        hash_ids=np.arange(indptr[-1], dtype=np.uint32),  # every block its own id
        # equal arrivals keep file order, as a Mooncake trace's
        order=np.argsort(start_ms, kind="stable").astype(np.int64),
    )


def _lengths(column: pd.Series, name: str, path: str, line_no: np.ndarray, minimum: int) -> np.ndarray:
    values = pd.to_numeric(column, errors="coerce").to_numpy(np.float64)
    bad = ~np.isfinite(values) | (values < minimum) | (values != np.floor(values)) | (values >= 2**31)
    if bad.any():
        q = int(np.argmax(bad))
        raise TraceError(path, int(line_no[q]), f"{name} {column.iloc[q]!r} is not a whole number of tokens "
                                                f">= {minimum}")
    return values.astype(np.int64)
