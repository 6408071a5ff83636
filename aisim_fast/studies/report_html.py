"""``report.html``: one self-contained page per sweep or sizing run -- its plots (PNG
files embedded as data URIs) and its answer table -- that opens in a browser offline:
no script, no stylesheet or font from anywhere else."""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path

import pandas as pd

REPORT_FILE = "report.html"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
p.meta { color: #555; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.4em 0; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.6em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f0f0f0; } tr.answer td { background: #e6f4e6; font-weight: bold; }
"""


def _image(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(frame: pd.DataFrame, highlight: int | None = None, table_id: str = "") -> str:
    rows = []
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    for i, (_, row) in enumerate(frame.iterrows()):
        cells = "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row)
        rows.append(f'<tr{" class=answer" if i == highlight else ""}>{cells}</tr>')
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if value != value else f"{value:,.4g}"
    return str(value)


def write_report(path: Path, title: str, meta: str, sections: list) -> Path:
    """Write the page: ``sections`` = [(heading, [item, ...])], an item a PNG path, a
    DataFrame (a table; with ``highlight`` row, ``(frame, row)``) or a line of text."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
             f"<p class=meta>{html.escape(meta)}</p>"]
    for heading, items in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        for item in items:
            if isinstance(item, (str, os.PathLike)) and str(item).endswith(".png"):
                parts.append(_image(Path(item), heading))
            elif isinstance(item, pd.DataFrame):
                parts.append(_table(item, table_id="answer" if heading.lower().startswith("answer") else ""))
            elif isinstance(item, tuple):
                frame, highlight = item
                parts.append(_table(frame, highlight, "answer" if heading.lower().startswith("answer") else ""))
            else:
                parts.append(f"<p>{html.escape(str(item))}</p>")
    parts.append("</body></html>\n")
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text("".join(parts), encoding="utf-8")
    os.replace(tmp, path)
    return path
