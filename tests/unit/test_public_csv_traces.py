"""Public CSV traces read as trace formats (``trace.public_csv``, beyond the reference):
Azure LLM inference (2023 / 2024) and BurstGPT: arrivals re-based to 0 and scaled,
lengths as recorded, every prompt its own blocks, and bad rows named by file and line."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from aisim_fast.config.payload import parse_payload
from aisim_fast.trace.formats import ALL_TRACE_FORMATS, TRACE_FORMATS, load_trace
from aisim_fast.trace.workload import TraceError, prompt_tokens
from support.paths import DATA_DIR

AZURE = DATA_DIR / "traces" / "azure_2023_code_50.csv"
BURST = DATA_DIR / "traces" / "burstgpt_sample.csv"


def test_azure_rows_are_the_files():
    w = load_trace(AZURE, "azure")
    raw = pd.read_csv(AZURE)
    stamps = pd.to_datetime(raw["TIMESTAMP"])
    want_ms = ((stamps - stamps.min()).dt.total_seconds() * 1000).to_numpy()
    assert w.num_requests == w.num_sessions == 50
    assert np.allclose(w.start_ms, want_ms, rtol=0, atol=1e-6) and w.start_ms[0] == 0.0
    assert w.input_len.tolist() == raw["ContextTokens"].tolist()
    assert w.output_len.tolist() == raw["GeneratedTokens"].tolist()
    assert w.request_name[0] == "request_2" and w.line_no[-1] == 51  # the header is line 1
    # no prompt shares a token with another: nothing to reuse
    seen = set()
    for q in range(w.num_requests):
        tokens = set(prompt_tokens(w, q).tolist())
        assert len(prompt_tokens(w, q)) == w.input_len[q] and not tokens & seen
        seen |= tokens
    fast = load_trace(AZURE, "azure", arrival_speedup_ratio=4.0, max_rows=10)
    assert fast.num_requests == 10 and np.allclose(fast.start_ms, w.start_ms[:10] / 4.0)


def test_azure_2024_offsets_and_gzip(tmp_path):
    """The 2024 traces write a UTC offset; a gzip file reads the same."""
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2024-05-10 00:00:00.009930+00:00,100,5\n2024-05-10 00:00:01.509930+00:00,2000,0\n")
    path = tmp_path / "a.csv.gz"
    path.write_bytes(gzip.compress(text.encode()))
    w = load_trace(path, "azure")
    assert w.start_ms.tolist() == [0.0, 1500.0] and w.output_len.tolist() == [5, 0]


def test_burstgpt_rows_are_the_files():
    w = load_trace(BURST, "burstgpt")
    assert w.start_ms.tolist() == [0.0, 40000.0, 113000.0, 113000.0, 155000.0]
    assert w.input_len.tolist() == [472, 1087, 417, 1360, 25]
    assert w.output_len.tolist() == [18, 0, 89, 296, 2]  # a failed request generates nothing
    assert w.order.tolist() == [0, 1, 2, 3, 4]  # equal arrivals keep file order


@pytest.mark.parametrize("fmt,text,line,words", [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,2\nyesterday,5,1\n", 3,
     "TIMESTAMP 'yesterday' is not a timestamp"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,0,2\n", 2,
     "ContextTokens '0' is not a whole number of tokens >= 1"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,-1\n", 2,
     "GeneratedTokens '-1' is not a whole number of tokens >= 0"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens\n1,x,10,2\n2,x,7.5,1\n", 3,
     "Request tokens '7.5' is not a whole number"),
    ("burstgpt", "Timestamp,Request tokens\n1,10\n", 1, "the header lacks 'Response tokens'"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, fmt, text, line, words):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=f"t.csv:{line}: {words}"):
        load_trace(path, fmt)


def test_the_formats_are_beyond_the_reference_and_say_so():
    assert set(ALL_TRACE_FORMATS) - set(TRACE_FORMATS) == {"azure", "burstgpt"}
    payload = {"spec": {"topology": {"kind": "aggregated", "workers": {"initial_workers": 1}},
                        "engine": {"rank": {"backend": "vllm"}}},
               "traffic": {"trace_path": str(BURST), "trace_format": "burstgpt"}}
    setup = parse_payload(payload)
    assert setup.beyond_reference and "burstgpt" in setup.beyond_reference[0]
    payload["traffic"]["trace_format"] = "mooncake"
    assert parse_payload(payload).beyond_reference == []
