"""One SLA vocabulary for replay, sweep and size: the terms, how a run is judged
against them, and why it failed.

Two kinds of term, each with one meaning wherever it is written:

* **Per-request bounds** — the reference's ``spec.sla``: ``ttft_ms``, ``itl_ms``,
  ``e2e_ms``. A request is *good* when its TTFT, its mean inter-token gap
  ((last token - first token) / (output tokens - 1), i.e. the request's own TPOT) and
  its end-to-end latency are within the bounds (equality passes); the reference counts
  the good requests as ``goodput_completed_requests``. The run meets these bounds when
  at least the ``goodput`` fraction (default 0.99) of the requests that *arrived* is
  good: a rejected or unfinished request is never good. As in the reference, ``e2e_ms``
  excludes ``ttft_ms`` / ``itl_ms``.
* **Distribution bounds** — ``<metric>_<stat>_ms``, metric ``ttft``, ``tpot`` (one
  sample per request: its mean gap), ``itl`` (every gap between two consecutive tokens,
  pooled over all requests: the summary's ``p90_itl_ms``) or ``e2e``; stat ``mean``,
  ``p50``, ``p75``, ``p90``, ``p95``, ``p99`` or ``max``. The run meets it when the
  statistic is within the bound and every arrived request completed (a percentile over
  the completed requests alone would hide the rejected ones).

TPOT against ITL: a request whose four tokens come at 0, 10, 20 and 90 ms has a TPOT of
30 ms and gaps of 10, 10 and 70 ms; with ``itl_ms=40`` it is good (30 <= 40), while its
gaps' p90 is 70 ms, so ``itl_p90_ms=40`` fails. A streaming user feels the gaps; a
per-request mean hides a stall.

Beyond the per-term bounds: ``goodput`` (the fraction above; 0: no fraction gate),
``min_goodput_rps`` (the reference's recommend constraint: good requests per second of
the run, needs a per-request bound) and ``strict`` (true: the per-request bounds are
also applied to the means, as the reference's ``strict_sla`` and its ``min_gpus``
target do: ``ttft_ms`` -> ``ttft_mean_ms``, ``itl_ms`` -> ``tpot_mean_ms``, ``e2e_ms``
-> ``e2e_mean_ms``). The reference's ``min_gpus`` candidate filter is therefore
``strict=true,goodput=0,min_goodput_rps=R`` with its bounds. One rule is stricter than
the reference's aggregate check, which needs only one completed request: a distribution
bound also needs every arrived request completed.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field

from aisim_fast.config.payload import ConfigError, ConfigWarning

REQUEST_TERMS = ("ttft_ms", "itl_ms", "e2e_ms")
METRIC_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2e": "e2e_latency_ms"}
STAT_KEYS = {"mean": "mean", "p50": "median", "p75": "p75", "p90": "p90", "p95": "p95",
             "p99": "p99", "max": "max"}
DEFAULT_GOODPUT = 0.99
_STAT_TERM = re.compile(r"^(ttft|tpot|itl|e2e)_(mean|p50|p75|p90|p95|p99|max)_ms$")
# the sweep spec's older form {ttft_ms, itl_ms, e2e_ms, percentile: N}: one percentile
# for every bound, judged on the distributions
_LEGACY_PERCENTILES = {50: "p50", 75: "p75", 90: "p90", 95: "p95", 99: "p99"}
ALLOWED = "ttft_ms, itl_ms, e2e_ms (per request), <ttft|tpot|itl|e2e>_<mean|p50|p75|p90|p95|p99|max>_ms, " \
          "goodput, min_goodput_rps, strict"
# the reference's strict_sla: each per-request bound applied to the mean of its metric
STRICT_TERMS = {"ttft_ms": "ttft_mean_ms", "itl_ms": "tpot_mean_ms", "e2e_ms": "e2e_mean_ms"}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    failed: tuple[str, ...]           # the terms that failed, in the SLA's order
    values: dict                      # term -> the run's value (goodput: the good fraction)
    reason: str = ""                  # one line: why it failed ("" when ok)


@dataclass(frozen=True)
class Sla:
    """Validated SLA terms (``parse_sla``)."""
    request_bounds: dict = field(default_factory=dict)   # the reference's spec.sla
    stat_bounds: dict = field(default_factory=dict)      # term -> bound
    goodput: float = DEFAULT_GOODPUT
    min_goodput_rps: float | None = None
    strict: bool = False

    @property
    def empty(self) -> bool:
        return not self.request_bounds and not self.stat_bounds and self.min_goodput_rps is None

    def terms(self) -> dict:
        """Every term with its bound, as written (goodput only with per-request bounds)."""
        out = {**self.request_bounds, **self.stat_bounds}
        if self.request_bounds:
            out["goodput"] = self.goodput
        if self.min_goodput_rps is not None:
            out["min_goodput_rps"] = self.min_goodput_rps
        if self.strict:
            out["strict"] = True
        return out

    def text(self) -> str:
        return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else format(v, 'g')}"
                        for k, v in self.terms().items())

    def judge(self, row: dict) -> Verdict:
        """Judge one run's summary row (a sweep row or ``summary.json``; ``status`` other
        than ok, when present, fails every term)."""
        status = row.get("status", "ok")
        if status != "ok":
            error = str(row.get("error") or "").strip()
            return Verdict(False, ("status",), {}, f"run {status}" + (f": {error}" if error else ""))
        values, failed, why = {}, [], []
        arrived = int(row["num_requests"])
        completed = int(row["completed_requests"])
        if self.request_bounds:
            good = int(row["goodput_completed_requests"])
            fraction = good / arrived if arrived else 0.0
            values["goodput"] = fraction
            if self.goodput > 0 and fraction < self.goodput:
                failed.append("goodput")
                bounds = ", ".join(f"{k}<={v:g}" for k, v in self.request_bounds.items())
                why.append(f"{fraction:.1%} of requests meet {bounds} (need {self.goodput:.1%})")
        if self.min_goodput_rps is not None:
            rps = float(row["goodput_request_throughput_rps"])
            values["min_goodput_rps"] = rps
            if rps < self.min_goodput_rps:
                failed.append("min_goodput_rps")
                why.append(f"goodput {rps:.3g} req/s < {self.min_goodput_rps:g}")
        if self.stat_bounds and completed < arrived:
            failed.append("completed")
            why.append(f"{arrived - completed} of {arrived} requests did not complete")
        for term, bound in self.stat_bounds.items():
            value = float(row[stat_key(term)])
            values[term] = value
            if not value <= bound:
                failed.append(term)
                why.append(f"{term} {value:.4g} > {bound:g}")
        return Verdict(not failed, tuple(failed), values, "; ".join(why))


def stat_key(term: str) -> str:
    """The summary key of a distribution term: ``itl_p90_ms`` -> ``p90_itl_ms``."""
    metric, stat = _STAT_TERM.match(term).groups()
    return f"{STAT_KEYS[stat]}_{METRIC_KEYS[metric]}"


def _number(where: str, value) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: must be a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{where}: must be finite and > 0, got {value!r}")
    return number


def parse_sla(terms: dict | None, where: str = "sla", goodput: float | None = None) -> Sla:
    """Validate a mapping of SLA terms (``where`` names it in errors). ``goodput``: the
    caller's default fraction (a ``goodput`` term overrides it)."""
    if terms is None:
        return Sla()
    if not isinstance(terms, dict):
        raise ConfigError(f"{where}: must be a mapping of SLA terms ({ALLOWED})")
    terms = dict(terms)
    if "percentile" in terms:
        percentile = terms.pop("percentile")
        if percentile not in _LEGACY_PERCENTILES:
            raise ConfigError(f"{where}.percentile: must be one of {sorted(_LEGACY_PERCENTILES)}, "
                              f"got {percentile!r}")
        stat = _LEGACY_PERCENTILES[percentile]
        renamed = {k: f"{k[:-3]}_{stat}_ms" for k in REQUEST_TERMS if k in terms}
        warnings.warn(f"{where}.percentile: read as the distribution bounds "
                      f"{', '.join(renamed.values()) or '(none)'}; write those terms instead "
                      f"(ttft_ms / itl_ms / e2e_ms alone are per-request bounds)", ConfigWarning,
                      stacklevel=2)
        terms = {renamed.get(k, k): v for k, v in terms.items()}
    request, stats, min_rps, strict = {}, {}, None, False
    fraction = DEFAULT_GOODPUT if goodput is None else goodput
    for key, value in terms.items():
        if key in REQUEST_TERMS:
            request[key] = _number(f"{where}.{key}", value)
        elif isinstance(key, str) and _STAT_TERM.match(key):
            stats[key] = _number(f"{where}.{key}", value)
        elif key == "goodput":
            fraction = 0.0 if value in (0, "0") else _number(f"{where}.goodput", value)
        elif key == "strict":
            if value not in (True, False, "true", "false", "1", "0", 1, 0):
                raise ConfigError(f"{where}.strict: must be true or false, got {value!r}")
            strict = value in (True, "true", "1", 1)
        elif key == "min_goodput_rps":
            min_rps = _number(f"{where}.min_goodput_rps", value)
        else:
            raise ConfigError(f"{where}.{key}: unknown SLA term; allowed: {ALLOWED}")
    if not 0 <= fraction <= 1:
        raise ConfigError(f"{where}.goodput: must be in [0, 1], got {fraction!r}")
    if "e2e_ms" in request and ("ttft_ms" in request or "itl_ms" in request):
        raise ConfigError(f"{where}: e2e_ms is mutually exclusive with ttft_ms / itl_ms (the "
                          "reference's rule for per-request bounds; e2e_p90_ms and the like combine freely)")
    if min_rps is not None and not request:
        raise ConfigError(f"{where}.min_goodput_rps: needs a per-request bound (ttft_ms, itl_ms or e2e_ms) "
                          "that says which requests are good")
    if not request and not stats and min_rps is None:
        raise ConfigError(f"{where}: give at least one bound ({ALLOWED})")
    if strict:
        if not request:
            raise ConfigError(f"{where}.strict: applies the per-request bounds to the means; give one")
        for term, mean_term in STRICT_TERMS.items():
            if term in request:
                if mean_term in stats and stats[mean_term] != request[term]:
                    raise ConfigError(f"{where}: strict sets {mean_term} to {term}; do not give both")
                stats[mean_term] = request[term]
    return Sla(request, stats, fraction, min_rps, strict)


def parse_sla_text(text: str, flag: str = "--sla", goodput: float | None = None) -> Sla:
    """``ttft_ms=300,itl_p90_ms=40,goodput=0.95`` from the command line."""
    terms = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"{flag}: terms are NAME=VALUE separated by commas, got {part!r}; "
                              f"allowed: {ALLOWED}")
        if key in terms:
            raise ConfigError(f"{flag}: {key} given twice")
        terms[key] = value.strip()
    return parse_sla(terms, flag, goodput)
