"""A reference ``predict`` config (the YAML its ``aisimulate predict --stack engine`` reads),
lowered to the execution payload that CLI writes, so ``parse_payload`` runs it unchanged.

The lowering follows the reference's own (its config classes, compiler and runner): role
defaults (a prefill worker admits one sequence), the backend's native block size and
memory fraction, ``context_length: max`` read from the model's config, ``auto`` KV bytes
per token from the model's geometry, a KV pool sized from GPU memory by the AIC memory
model, and the canonical AIC timing config with the database's current backend version.
What the reference resolves from its own package (model configs, systems, versions) comes
from aiconfigurator-core's bundled data (the ``aic`` extra).

Keys of the config that aisim_fast does not simulate are refused with their path in the
config and the reason; unknown keys are refused as the reference refuses them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from aisim_fast.config.payload import NATIVE_BLOCK_SIZE, ConfigError, parse_frontend, read_config_text
from aisim_fast.config.speculation import rates_for_expected
from aisim_fast.trace.formats import MULTI_FILE_FORMATS, TRACE_FORMATS

# the backend's memory-fraction key and its default (the reference's compiler)
_MEMORY_FRACTION_KEY = {"vllm": "gpu_memory_utilization", "sglang": "mem_fraction_static",
                        "trtllm": "free_gpu_memory_fraction"}
_DEFAULT_MEMORY_FRACTION = {"vllm": 0.9, "sglang": 0.88, "trtllm": 0.9}
_ROLE_MAX_SEQUENCES = {"aggregated": 256, "prefill": 1, "decode": 256}
_QUANT_MODES = ("gemm_quant_mode", "moe_quant_mode", "fmha_quant_mode", "kvcache_quant_mode",
                "comm_quant_mode")
# the canonical AIC config's estimator settings as the reference's CLI writes them by default
_TRANSFER_POLICY = ["xshape", "xquant", "xprofile", "xop"]


def _default_estimator_config() -> dict:
    sampling = {"bins_per_axis": [4, 4], "max_observations": 64}
    return {
        "features": {"attention_kv_weight": 1.0, "prefill_attention_pair_weight": 1.0,
                     "ffn_token_weight": 1.0},
        "op_level": {},
        "fpm_interpolation": {"method": "sol"},
        "fpm_regression": {"sampling": dict(sampling), "min_observations": 5,
                           "fit": {"kind": "standardized_nnls", "singular_ridge_scale": 1e-09,
                                   "rebuild_interval": None}},
        "correction": {"enabled": True, "feature_space": "legacy_workload", "sampling": dict(sampling),
                       "min_observations": 5, "factor_bounds": {"min": 0.5, "max": 2.0},
                       "max_num_tokens": 8192, "max_batch_size": 512, "max_kv_tokens": 2000000},
    }


# ---------------------------------------------------------------------------------------
# checking one section


def _fail(path: str, message: str):
    raise ConfigError(f"{path}: {message}")


def _not_simulated(path: str, what: str):
    _fail(path, f"not simulated by aisim_fast ({what}); remove it from the config")


def _section(path: str, raw: Any, allowed: tuple[str, ...]) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        _fail(path, f"must be a mapping, got {raw!r}")
    for key in raw:
        if key not in allowed:
            _fail(f"{path}.{key}" if path else str(key),
                  "unknown field; allowed: " + ", ".join(allowed))
    return raw


def _int(path: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(path, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _number(path: str, value: Any, *, low: float = 0.0, positive: bool = False,
            high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or (positive and value <= low) or (high is not None and value > high):
        bound = f"in ({low}, {high}]" if high is not None else ("> 0" if positive else f">= {low}")
        _fail(path, f"must be a number {bound}, got {value!r}")
    return float(value)


def _choice(path: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        _fail(path, f"must be one of {', '.join(map(str, allowed))}; got {value!r}")
    return value


def _neutral(path: str, value: Any, neutral: tuple, what: str) -> None:
    if not any(value is n if n is None or isinstance(n, bool) else value == n for n in neutral):
        _not_simulated(path, what)


# ---------------------------------------------------------------------------------------
# traffic


_TRAFFIC_KEYS = ("source", "load", "stop")
_SOURCE_KEYS = ("type", "paths", "format", "block_size", "nested_timestamp_basis",
                "input_tokens", "output_tokens", "images", "cached_prefix_tokens",
                "new_input_tokens_per_turn", "output_tokens_per_turn", "session")
_LOAD_KEYS = ("type", "concurrency", "requests_per_second", "sessions_per_second", "seed", "speedup",
              "agentic_lanes", "agentic_snapshot", "agentic_warmup", "agentic_warmup_policy",
              "agentic_profile")
_STOP_KEYS = ("requests", "requests_per_load_unit", "sessions", "sessions_per_load_unit",
              "max_virtual_time_seconds")
_TRACE_FORMATS = ("mooncake", "mooncake-delta", "agentic_mooncake", "applied_compute_agentic",
                  "dynamo", "weka")


def _traffic(raw: Any) -> tuple[dict, int | None, float | None]:
    """The payload's ``traffic``, the in-flight cap and the virtual-time cap (ms)."""
    if raw is None:
        # the reference's default traffic: 100 synthetic requests of 1024 in / 128 out
        # under concurrency 10
        raw = {"source": {"type": "synthetic"}, "load": {"type": "concurrency", "concurrency": 10},
               "stop": {"requests": 100}}
    traffic = _section("traffic", raw, _TRAFFIC_KEYS)
    source = _section("traffic.source", traffic.get("source"), _SOURCE_KEYS)
    load = _section("traffic.load", traffic.get("load"), _LOAD_KEYS)
    stop = _section("traffic.stop", traffic.get("stop"), _STOP_KEYS)
    kind = source.get("type", "synthetic")
    _choice("traffic.source.type", kind, ("trace", "synthetic", "synthetic-session"))
    if kind != "trace":
        return _synthetic_traffic(kind, source, load, stop)
    for key in ("input_tokens", "output_tokens", "images", "cached_prefix_tokens",
                "new_input_tokens_per_turn", "output_tokens_per_turn", "session"):
        if key in source:
            _fail(f"traffic.source.{key}", "belongs to synthetic sources, not type: trace")
    paths = source.get("paths")
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        _fail("traffic.source.paths", f"must be a list of at least one non-empty path, got {paths!r}")
    trace_format = _choice("traffic.source.format", source.get("format", "mooncake"), _TRACE_FORMATS)
    if trace_format not in TRACE_FORMATS:
        _not_simulated("traffic.source.format", f"the {trace_format!r} trace format")
    if len(paths) != 1 and trace_format not in MULTI_FILE_FORMATS:
        _fail("traffic.source.paths", f"trace format {trace_format!r} takes exactly one path")
    basis = source.get("nested_timestamp_basis")
    if basis is not None and trace_format != "weka":
        _fail("traffic.source.nested_timestamp_basis", "is only valid for trace format 'weka'")
    if basis is not None:
        _choice("traffic.source.nested_timestamp_basis", basis, ("auto", "absolute", "relative"))
    # dynamo and weka traces carry their block size: the CLI writes one only when given
    block_size = None if trace_format in ("dynamo", "weka") and source.get("block_size") is None else \
        _int("traffic.source.block_size", source.get("block_size", 512))

    load_type = _choice("traffic.load.type", load.get("type", "concurrency"),
                        ("concurrency", "poisson", "constant_rate", "trace_timestamps"))
    if load_type not in ("trace_timestamps", "concurrency"):
        _fail("traffic.load.type", "trace traffic requires trace_timestamps or concurrency load")
    if trace_format == "applied_compute_agentic" and load_type != "concurrency":
        _fail("traffic.load.type", "applied_compute_agentic requires concurrency load")
    if trace_format == "agentic_mooncake":
        if load_type != "trace_timestamps":
            _fail("traffic.load.type", "agentic_mooncake requires trace_timestamps load")
        if stop.get("max_virtual_time_seconds") is not None:
            _fail("traffic.stop.max_virtual_time_seconds", "agentic_mooncake does not support max virtual time")
    elif load.get("agentic_lanes") is not None and trace_format not in ("dynamo", "weka"):
        _fail("traffic.load.agentic_lanes", "agentic_lanes requires weka, agentic_mooncake, or agentic Dynamo input")
    if load.get("agentic_profile") is not None:
        _not_simulated("traffic.load.agentic_profile", "agentic profiles")
    snapshot = load.get("agentic_snapshot")
    if snapshot is not None:
        if load.get("agentic_lanes") is None:
            _fail("traffic.load.agentic_snapshot", "agentic_snapshot requires positive agentic_lanes")
        for key in ("initial_selections", "corpus_cursor"):
            if isinstance(snapshot, dict) and snapshot.get(key) is not None:
                _not_simulated(f"traffic.load.agentic_snapshot.{key}", "chosen snapshot cuts")
    if load.get("agentic_warmup", False) is not False:
        _not_simulated("traffic.load.agentic_warmup", "agentic replay")
    if load.get("agentic_warmup_policy", "repeated_prefixes") != "repeated_prefixes":
        _not_simulated("traffic.load.agentic_warmup_policy", "agentic replay")
    for key in ("requests_per_second", "sessions_per_second", "seed"):
        if load.get(key) is not None:
            _fail(f"traffic.load.{key}", f"does not apply to {load_type} load of a trace")
    for key in ("requests", "requests_per_load_unit", "sessions", "sessions_per_load_unit"):
        if stop.get(key) is not None:
            _fail(f"traffic.stop.{key}", "trace traffic only accepts max_virtual_time_seconds")

    out: dict[str, Any] = {"source_type": "trace", "load_type": load_type, "trace_paths": list(paths),
                           "trace_path": paths[0], "trace_format": trace_format}
    if block_size is not None:
        out["trace_block_size"] = block_size
    if basis is not None:
        out["weka_nested_timestamp_basis"] = basis
    in_flight = None
    if load_type == "concurrency":
        if load.get("speedup") is not None:
            _fail("traffic.load.speedup", "does not apply to concurrency load")
        in_flight = _int("traffic.load.concurrency", load.get("concurrency", 10))
        out["replay_concurrency"] = in_flight
    else:
        if load.get("concurrency") is not None:
            _fail("traffic.load.concurrency", "does not apply to trace_timestamps load")
        speedup = load.get("speedup")
        out["arrival_speedup_ratio"] = 1.0 if speedup is None else _number(
            "traffic.load.speedup", speedup, positive=True)
        if load.get("agentic_lanes") is not None:
            out["agentic_lanes"] = _int("traffic.load.agentic_lanes", load["agentic_lanes"])
        if snapshot is not None:  # checked with the payload (config.payload)
            out["agentic_snapshot"] = snapshot
    cap_ms = None
    if stop.get("max_virtual_time_seconds") is not None:
        cap_ms = 1000.0 * _number("traffic.stop.max_virtual_time_seconds",
                                  stop["max_virtual_time_seconds"], positive=True)
        out["max_sim_time_ms"] = cap_ms
    return out, in_flight, cap_ms


def _synthetic_traffic(kind: str, source: dict, load: dict, stop: dict) -> tuple[dict, int | None, float | None]:
    """A synthetic source as the reference's CLI lowers it: ``synthetic``'s
    ``input_tokens`` / ``output_tokens`` / ``cached_prefix_tokens`` to isl / osl /
    cached prefix, or ``synthetic-session``'s ``new_input_tokens_per_turn`` /
    ``output_tokens_per_turn`` (1024 / 128) and ``session`` (turns >= 2, default 4;
    shared prefix ratio and groups; think time); a rate (``requests_per_second``, or
    ``sessions_per_second`` for sessions) to ``arrival_interval_ms`` (constant) or
    ``request_rate`` with ``arrival_seed`` (poisson, seed 42 when unset); the stop
    (``requests`` / ``sessions``, or per load unit: times the concurrency or rate,
    Python-rounded, the ratio kept beside it)."""
    sessions = kind == "synthetic-session"
    theirs = ("new_input_tokens_per_turn", "output_tokens_per_turn", "session") if not sessions else \
        ("input_tokens", "output_tokens", "cached_prefix_tokens", "images", "block_size")
    for key in ("paths", "format", "nested_timestamp_basis", *theirs):
        if source.get(key) is not None:
            _fail(f"traffic.source.{key}", f"does not apply to a {kind} source")
    if source.get("images") is not None:
        _not_simulated("traffic.source.images", "vision inputs")
    out: dict[str, Any] = {"source_type": kind}
    if sessions:
        shape = _section("traffic.source.session", source.get("session"),
                         ("turns", "shared_prefix_ratio", "prefix_groups", "inter_turn_delay_ms"))
        if source.get("session") is None:
            _fail("traffic.source.session", "required for a synthetic-session source")
        share = _number("traffic.source.session.shared_prefix_ratio", shape.get("shared_prefix_ratio", 0.0),
                        high=1.0)
        groups = _int("traffic.source.session.prefix_groups", shape.get("prefix_groups", 0), minimum=0)
        if share > 0.0 and groups == 0:
            _fail("traffic.source.session.prefix_groups", "must be positive when shared_prefix_ratio is positive")
        out.update(isl=_int("traffic.source.new_input_tokens_per_turn", source.get("new_input_tokens_per_turn", 1024)),
                   osl=_int("traffic.source.output_tokens_per_turn", source.get("output_tokens_per_turn", 128)),
                   turns_per_session=_int("traffic.source.session.turns", shape.get("turns", 4), minimum=2),
                   shared_prefix_ratio=share, num_prefix_groups=groups,
                   inter_turn_delay_ms=_number("traffic.source.session.inter_turn_delay_ms",
                                               shape.get("inter_turn_delay_ms", 0.0)))
    else:
        out.update(isl=_int("traffic.source.input_tokens", source.get("input_tokens", 1024)),
                   osl=_int("traffic.source.output_tokens", source.get("output_tokens", 128)),
                   cached_prefix_tokens=_int("traffic.source.cached_prefix_tokens",
                                             source.get("cached_prefix_tokens", 0), minimum=0))
    load_type = _choice("traffic.load.type", load.get("type", "concurrency"),
                        ("concurrency", "poisson", "constant_rate", "trace_timestamps"))
    if load_type == "trace_timestamps":
        _fail("traffic.load.type", "a synthetic source has no timestamps: concurrency, poisson or constant_rate")
    rate_key, wrong_key = ("sessions_per_second", "requests_per_second") if sessions else \
        ("requests_per_second", "sessions_per_second")
    if load.get(wrong_key) is not None:
        _fail(f"traffic.load.{wrong_key}", "traffic load rate unit does not match source type")
    for key in ("agentic_lanes", "agentic_snapshot", "agentic_profile", "speedup"):
        if load.get(key) is not None:
            _fail(f"traffic.load.{key}", f"does not apply to {load_type} load of a synthetic source")
    out["load_type"] = load_type
    in_flight = None
    if load_type == "concurrency":
        in_flight = _int("traffic.load.concurrency", load.get("concurrency", 10))
        out["concurrency"] = in_flight
        load_unit = float(in_flight)
        for key in (rate_key, "seed"):
            if load.get(key) is not None:
                _fail(f"traffic.load.{key}", "does not apply to concurrency load")
    else:
        rate = _number(f"traffic.load.{rate_key}", load.get(rate_key), positive=True)
        load_unit = float(rate)
        if load.get("concurrency") is not None:
            _fail("traffic.load.concurrency", f"does not apply to {load_type} load")
        if load_type == "constant_rate":
            out["arrival_interval_ms"] = 1000.0 / rate
        else:
            out["request_rate"] = float(rate)
            out["arrival_seed"] = _int("traffic.load.seed", load.get("seed", 42), minimum=0)
    count_key, unit_key = ("sessions", "sessions_per_load_unit") if sessions else \
        ("requests", "requests_per_load_unit")
    for key in (("requests", "requests_per_load_unit") if sessions else ("sessions", "sessions_per_load_unit")):
        if stop.get(key) is not None:
            _fail(f"traffic.stop.{key}", f"synthetic {'session' if sessions else 'request'} traffic "
                                         f"requires a {'session' if sessions else 'request'} stop")
    if stop.get(count_key) is not None and stop.get(unit_key) is not None:
        _fail("traffic.stop", "requires exactly one count condition")
    if stop.get(count_key) is not None:
        out["request_count"] = _int(f"traffic.stop.{count_key}", stop[count_key])
    elif stop.get(unit_key) is not None:
        ratio = _number(f"traffic.stop.{unit_key}", stop[unit_key], positive=True)
        out["num_request_ratio"] = float(ratio)
        out["request_count"] = max(1, int(round(ratio * load_unit)))  # the CLI's (Python) rounding
    else:
        _fail(f"traffic.stop.{count_key}", f"required for a {kind} source (or {unit_key})")
    if stop.get("max_virtual_time_seconds") is not None:
        # (the reference's words: its traffic model refuses the cap beside a synthetic source)
        _fail("traffic.stop.max_virtual_time_seconds", "max_virtual_time_seconds is trace-only")
    out["trace_block_size"] = _int("traffic.source.block_size", source.get("block_size", 512))
    return out, in_flight, None


# ---------------------------------------------------------------------------------------
# engine


_ENGINE_KEYS = ("mode", "model", "fpm_profile", "hardware", "backend", "backend_version",
                "decoder_replay", "enable_shared_layer", "strict_provenance", "context_length",
                "speculation", "workers", "kv_transfer", "tokenization", "afd", "nextn",
                "nextn_accepted", "enable_chunked_prefill", "enable_eplb", "wideep_num_slots",
                "moe_backend", "moe_kernel_source", "attention_backend", *_QUANT_MODES,
                "database_mode", "transfer_policy", "systems_paths", "systems_path",
                "estimation_mode", "fallback_policy", "estimator_config")
_WORKER_KEYS = ("hardware", "context_length", "parallelism", "scheduler", "kv_cache", "timing",
                "startup_seconds", "host_loop", "frontend", "host_profile", "vision")
_PARALLEL_KEYS = ("replicas", "tensor", "pipeline", "attention_data", "moe_tensor", "moe_expert",
                  "prefill_context", "decode_context")
_SCHEDULER_KEYS = ("max_batched_tokens", "max_sequences", "prefill_schedule_interval",
                   "prefill_decode_interval")
_KV_KEYS = ("block_size", "prefix_match_unit", "prefix_caching", "bytes_per_token", "capacity",
            "host_offload", "g3_offload", "kvcr", "state_cache")
_CAPACITY_KEYS = ("type", "memory_fraction", "blocks", "bytes", "cuda_graph_reserved_bytes")
_TIMING_KEYS = ("type", "forward_model", "fpm_parquet_path", "estimation_mode", "fallback_policy",
                "estimator_config", "systems_paths", "database_mode", "transfer_policy",
                "prefill_ms", "decode_ms", "attention_backend", *_QUANT_MODES)
_TRANSFER_KEYS = ("bytes_per_token", "bandwidth_gb_per_second", "timing_mode")


def _check_engine_controls(engine: dict) -> None:
    """The engine-wide keys of features aisim_fast does not simulate, at their neutral values."""
    for key, neutral, what in (
            ("fpm_profile", (None,), "forward-pass-measurement (FPM) profile timing"),
            ("afd", (None,), "attention/FFN disaggregation"),
            ("decoder_replay", (False,), "decoder replay"),
            ("enable_shared_layer", (None, False), "a shared-layer model"),
            ("strict_provenance", (None, False), "strict provenance checking"),
            ("enable_eplb", (False,), "expert-parallel load balancing"),
            ("wideep_num_slots", (None,), "wide expert parallelism"),
            ("moe_backend", (None,), "a non-default MoE backend"),
            ("moe_kernel_source", (None,), "a non-default MoE kernel source"),
            ("attention_backend", (None,), "a non-default attention kernel backend"),
            ("database_mode", ("SILICON", "silicon"), "a database mode other than SILICON"),
            ("transfer_policy", (None,), "a non-default database transfer policy"),
            ("estimation_mode", ("auto", "op_level"), "an estimation mode other than op_level"),
            ("fallback_policy", ("deny",), "fallback policy 'allow'"),
            ("estimator_config", ({}, None), "estimator tuning (estimator_config)")):
        if key in engine:
            _neutral(f"engine.{key}", engine[key], neutral, what)


def _speculation(engine: dict, backend: str, workers: dict) -> tuple[dict, dict]:
    """(rank keys, timing-config keys) ``engine.speculation`` / ``engine.nextn`` lower to,
    as the reference's CLI lowers them: MTP (``nextn`` with ``nextn_accepted``, or
    ``{kind: mtp, params: {depth}, expected_accepted_tokens}``) priced by the AIC timing
    of every worker; ngram prompt lookup (vLLM) under polynomial or fixed timing. The
    schemes whose drafts need draft op tables (EAGLE-3, draft models, ngram's
    sequence-basis verify under AIC) are refused with that reason."""
    nextn = engine.get("nextn", 0)
    if isinstance(nextn, bool) or not isinstance(nextn, int) or not 0 <= nextn <= 5:
        _fail("engine.nextn", f"must be an integer in 0..5, got {nextn!r}")
    accepted = engine.get("nextn_accepted")
    raw = engine.get("speculation")
    if raw is not None and (nextn or accepted is not None):
        _fail("engine.speculation", "cannot be combined with nextn / nextn_accepted")
    if nextn or accepted is not None:
        if not nextn:
            _fail("engine.nextn_accepted", "requires nextn > 0")
        if accepted is None:
            _fail("engine.nextn", "nextn requires explicit nextn_accepted")
        _number("engine.nextn_accepted", accepted, high=float(nextn))
        _aic_timed("engine.nextn", workers)
        return ({"aic_nextn": nextn, "aic_nextn_accept_rates": rates_for_expected(nextn, accepted,
                                                                                   "engine.nextn_accepted")},
                {"nextn": nextn})
    if raw is None:
        return {}, {}
    spec = _section("engine.speculation", raw, ("kind", "num_speculative_tokens", "acceptance_rates",
                                                "seed", "params", "draft_model_path", "draft_config",
                                                "expected_accepted_tokens"))
    kind = spec.get("kind")
    seed = spec.get("seed", 42)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        _fail("engine.speculation.seed", f"must be an integer in [0, 2**64), got {seed!r}")
    if kind == "mtp":
        params = _section("engine.speculation.params", spec.get("params"), ("depth",))
        depth = params.get("depth")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= 5:
            _fail("engine.speculation.params.depth", f"must be an integer in 1..5, got {depth!r}")
        if depth == 0:
            _fail("engine.speculation", "omit speculation to disable it")
        expected = spec.get("expected_accepted_tokens")
        if expected is None:
            _fail("engine.speculation.expected_accepted_tokens", "required (the accepted drafts expected "
                                                                 "per verify pass)")
        _number("engine.speculation.expected_accepted_tokens", expected, high=float(depth))
        if backend not in ("vllm", "sglang"):
            _fail("engine.backend", f"mtp speculation supports vllm and sglang, got {backend!r}")
        for role, worker in workers.items():
            if worker["capacity_type"] != "fixed":
                _fail(f"engine.workers.{role}.kv_cache.capacity", "speculation requires explicit fixed KV "
                      "capacity (its draft memory is not modelled)")
        _aic_timed("engine.speculation", workers)
        return ({"aic_nextn": depth,
                 "aic_nextn_accept_rates": rates_for_expected(depth, expected,
                                                              "engine.speculation.expected_accepted_tokens"),
                 "aic_mtp_seed": seed},
                {"speculation": {"kind": "mtp", "params": {"depth": depth}}})
    if kind != "ngram":
        _not_simulated("engine.speculation.kind", f"{kind!r} speculation (its draft costs come from draft "
                       "op tables of the AIC timing model); ngram and mtp are simulated")
    if backend != "vllm":
        _fail("engine.backend", f"ngram speculation supports only vllm, got {backend!r}")
    n = spec.get("num_speculative_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 5:
        _fail("engine.speculation.num_speculative_tokens", f"must be an integer in 1..5, got {n!r}")
    rates = spec.get("acceptance_rates")
    if not isinstance(rates, list) or len(rates) != n:
        _fail("engine.speculation.acceptance_rates", f"must list {n} rates (one per draft), got {rates!r}")
    for i, rate in enumerate(rates):
        _number(f"engine.speculation.acceptance_rates[{i}]", rate)
        if not 0 <= rate <= 1:
            _fail(f"engine.speculation.acceptance_rates[{i}]", f"must be in [0, 1], got {rate}")
    for role, worker in workers.items():
        if worker["timing_type"] == "default":
            _not_simulated(f"engine.workers.{role}.timing", "ngram speculation under AIC op-level timing "
                           "(its sequence-basis verify op tables); use timing: {type: polynomial} or fixed")
    return {"aic_nextn": n, "aic_nextn_accept_rates": ",".join(str(rate) for rate in rates),
            "aic_mtp_seed": seed}, {}


def _aic_timed(path: str, workers: dict) -> None:
    """MTP is priced by the AIC timing: every language worker keeps the default timing."""
    for role, worker in workers.items():
        if worker["timing_type"] != "default":
            _fail(path, f"an active nextn is an engine model control: it requires default timing in every "
                        f"language role (workers.{role}.timing is {worker['timing_type']})")


def _tokenization(raw: Any) -> dict | None:
    """``engine.tokenization`` as the payload's top-level ``tokenization`` (per-token
    time in ms); none when it costs nothing, as the reference writes it."""
    if raw is None:
        return None
    tok = _section("engine.tokenization", raw, ("workers", "base_ms", "per_input_token_us"))
    workers = _int("engine.tokenization.workers", tok.get("workers", 1))
    base_ms = _number("engine.tokenization.base_ms", tok.get("base_ms", 0.0))
    per_token_us = _number("engine.tokenization.per_input_token_us", tok.get("per_input_token_us", 0.0))
    if base_ms == 0 and per_token_us == 0:
        return None
    return {"workers": workers, "base_ms": base_ms, "per_input_token_ms": per_token_us / 1000.0}


def _frontend(raw: Any, path: str) -> dict:
    """A worker's ``frontend`` as the payload carries it: its stages, each with
    ``concurrency_scale`` spelled out (empty when not given); checked as the payload's."""
    if not isinstance(raw, dict) or set(raw) - {"stages", "measured_for"}:
        _fail(path, f"must be an object with stages, got {raw!r}")
    stages = raw.get("stages")
    out = {"stages": [{"workers": st.get("workers"), "service_ms": st.get("service_ms"),
                       "concurrency_scale": list(st.get("concurrency_scale") or [])}
                      if isinstance(st, dict) else st for st in stages]
           if isinstance(stages, list) else stages}
    parse_frontend(out, path)
    return out


def _worker(engine: dict, role: str, raw: Any, backend: str) -> dict:
    """One worker section with the reference's defaults filled in and checked."""
    path = f"engine.workers.{role}"
    worker = _section(path, raw if raw is not None else {}, _WORKER_KEYS)
    if role == "decode":
        for key in ("host_loop", "frontend", "host_profile", "vision"):
            if key in worker:
                _fail(f"{path}.{key}", "unknown field for a decode worker")
    if worker.get("host_profile") is not None:
        _not_simulated(f"{path}.host_profile", "frontend stages resolved from a host cost table")
    frontend = worker.get("frontend")
    # (the reference's config: frontend stages imply the host loop)
    host_loop = worker.get("host_loop", frontend is not None)
    if not isinstance(host_loop, bool):
        _fail(f"{path}.host_loop", f"must be true or false, got {host_loop!r}")
    if frontend is not None:
        if not host_loop:
            _fail(f"{path}.frontend", "frontend stages run ahead of the scheduler loop; drop host_loop: false")
        frontend = _frontend(frontend, f"{path}.frontend")
    if host_loop and backend != "sglang":
        # (the reference's words)
        _fail(f"{path}.host_loop", f"workers.{role}.host_loop and workers.{role}.vision are supported "
              "only for backend=sglang")
    if host_loop and role != "aggregated":
        _fail(f"{path}.host_loop", "sglang.host_loop is supported only for aggregated ranks (the "
              "reference's core refuses a prefill rank's host loop)")
    if worker.get("vision") is not None:
        _not_simulated(f"{path}.vision", "a vision encoder")
    hardware = worker.get("hardware")
    if hardware is not None:
        if role == "aggregated":
            _fail(f"{path}.hardware", "worker hardware overrides require prefill/decode workers "
                                      "in disaggregated mode")
        if not isinstance(hardware, str) or not hardware.strip() or hardware.strip() != hardware \
                or hardware == "auto":
            _fail(f"{path}.hardware", "must be one concrete non-empty hardware identifier")
    startup_s = _number(f"{path}.startup_seconds", worker.get("startup_seconds", 0.0))

    par = _section(f"{path}.parallelism", worker.get("parallelism"), _PARALLEL_KEYS)
    parallel = {key: _int(f"{path}.parallelism.{key}", par.get(key, 1))
                for key in ("replicas", "tensor", "pipeline", "attention_data", "moe_tensor",
                            "moe_expert")}
    for key, what in (("prefill_context", "prefill context parallelism"),
                      ("decode_context", "decode context parallelism")):
        if par.get(key) is not None:
            _int(f"{path}.parallelism.{key}", par[key])
            if par[key] != 1:
                _not_simulated(f"{path}.parallelism.{key}", what)
    if parallel["pipeline"] != 1:
        _not_simulated(f"{path}.parallelism.pipeline", "pipeline parallelism")

    sch = _section(f"{path}.scheduler", worker.get("scheduler"), _SCHEDULER_KEYS)
    scheduler = {
        "max_num_batched_tokens": _int(f"{path}.scheduler.max_batched_tokens",
                                       sch.get("max_batched_tokens", 8192)),
        "max_num_seqs": _int(f"{path}.scheduler.max_sequences",
                             sch.get("max_sequences", _ROLE_MAX_SEQUENCES[role])),
        "prefill_schedule_interval": _int(f"{path}.scheduler.prefill_schedule_interval",
                                          sch.get("prefill_schedule_interval", 1)),
        "prefill_decode_interval": _int(f"{path}.scheduler.prefill_decode_interval",
                                        sch.get("prefill_decode_interval", 0), minimum=0),
    }
    for key, native, neutral in (("prefill_schedule_interval", "vllm", 1),
                                 ("prefill_decode_interval", "sglang", 0)):
        if backend != native and scheduler[key] != neutral:
            _fail(f"{path}.scheduler.{key}", f"is supported only for backend={native}")

    kv = _section(f"{path}.kv_cache", worker.get("kv_cache"), _KV_KEYS)
    for key, what in (("host_offload", "G2 host KV offload"), ("g3_offload", "the G3 KV tier"),
                      ("kvcr", "KVCR peer fetch"), ("state_cache", "a state cache"),
                      ("prefix_match_unit", "a prefix match unit (state caches)")):
        if kv.get(key) is not None:
            _not_simulated(f"{path}.kv_cache.{key}", what)
    block_size = kv.get("block_size")
    if block_size is not None:
        _int(f"{path}.kv_cache.block_size", block_size)
        if backend != "sglang" and block_size < 2:
            _fail(f"{path}.kv_cache.block_size", "vLLM and TensorRT-LLM require block_size >= 2")
    prefix_caching = kv.get("prefix_caching", True)
    if not isinstance(prefix_caching, bool):
        _fail(f"{path}.kv_cache.prefix_caching", f"must be true or false, got {prefix_caching!r}")
    bytes_per_token = kv.get("bytes_per_token", "auto")
    if bytes_per_token != "auto":
        _int(f"{path}.kv_cache.bytes_per_token", bytes_per_token)
    cap = _section(f"{path}.kv_cache.capacity", kv.get("capacity"), _CAPACITY_KEYS)
    cap_path = f"{path}.kv_cache.capacity"
    capacity_type = _choice(f"{cap_path}.type", cap.get("type", "default"), ("default", "fixed"))
    reserve = cap.get("cuda_graph_reserved_bytes", 0)
    if isinstance(reserve, bool) or not isinstance(reserve, int) or not 0 <= reserve <= 2 ** 53:
        _fail(f"{cap_path}.cuda_graph_reserved_bytes", f"must be an integer in [0, 2**53], got {reserve!r}")
    fraction = cap.get("memory_fraction")
    if fraction is not None:
        _number(f"{cap_path}.memory_fraction", fraction, low=0.0, positive=True, high=1.0)
    if capacity_type == "fixed":
        if (cap.get("blocks") is None) == (cap.get("bytes") is None):
            _fail(cap_path, "fixed KV capacity takes exactly one of blocks or bytes")
        if fraction is not None:
            _fail(f"{cap_path}.memory_fraction", "fixed KV capacity rejects memory_fraction")
        if reserve != 0:
            _fail(f"{cap_path}.cuda_graph_reserved_bytes", "fixed KV capacity rejects it")
        if cap.get("blocks") is not None:
            _int(f"{cap_path}.blocks", cap["blocks"])
        else:
            _int(f"{cap_path}.bytes", cap["bytes"])
            if block_size is None or bytes_per_token == "auto":
                _fail(f"{cap_path}.bytes", "capacity in bytes requires explicit kv_cache.block_size "
                                           "and kv_cache.bytes_per_token")
    elif cap.get("blocks") is not None or cap.get("bytes") is not None:
        _fail(cap_path, "default KV capacity rejects blocks or bytes (use type: fixed)")

    tim = _section(f"{path}.timing", worker.get("timing"), _TIMING_KEYS)
    timing_type = _choice(f"{path}.timing.type", tim.get("type", "default"),
                          ("default", "fixed", "polynomial"))
    for key in ("forward_model", "estimation_mode"):
        if key in tim:
            _neutral(f"{path}.timing.{key}", tim[key], ("op_level",) + (("auto",) if key != "forward_model"
                                                                       else ()),
                     "an estimation mode other than op_level")
    for key, neutral, what in (("fpm_parquet_path", (None,), "FPM timing"),
                               ("fallback_policy", (None, "deny"), "fallback policy 'allow'"),
                               ("estimator_config", (None, {}), "estimator tuning (estimator_config)"),
                               ("systems_paths", (None,), "a systems folder of one's own"),
                               ("database_mode", (None, "SILICON", "silicon"),
                                "a database mode other than SILICON"),
                               ("transfer_policy", (None,), "a non-default database transfer policy"),
                               ("attention_backend", (None,), "a non-default attention kernel backend")):
        if key in tim:
            _neutral(f"{path}.timing.{key}", tim[key], neutral, what)
    if timing_type != "default":
        for key in (*_QUANT_MODES, "attention_backend", "estimation_mode", "fallback_policy",
                    "estimator_config", "systems_paths", "database_mode", "transfer_policy"):
            if tim.get(key) is not None:
                _fail(f"{path}.timing.{key}", "requires default timing")
    if timing_type == "fixed":
        for key in ("prefill_ms", "decode_ms"):
            if tim.get(key) is None:
                _fail(f"{path}.timing.{key}", "fixed timing requires prefill_ms and decode_ms")
            _number(f"{path}.timing.{key}", tim[key])
    else:
        for key in ("prefill_ms", "decode_ms"):
            if tim.get(key) is not None:
                _fail(f"{path}.timing.{key}", f"{timing_type} timing rejects fixed timing values")

    context_length = worker.get("context_length")
    if context_length is not None:
        _int(f"{path}.context_length", context_length)
    return {"path": path, "hardware": hardware, "parallel": parallel, "scheduler": scheduler,
            "block_size": NATIVE_BLOCK_SIZE[backend] if block_size is None else block_size,
            "explicit_block_size": block_size, "prefix_caching": prefix_caching,
            "bytes_per_token": bytes_per_token, "capacity_type": capacity_type,
            "blocks": cap.get("blocks"), "bytes": cap.get("bytes"), "memory_fraction": fraction,
            "cuda_graph_reserved_bytes": reserve, "timing": tim, "timing_type": timing_type,
            "context_length": context_length, "startup_delay_ms": 1000.0 * startup_s,
            "host_loop": host_loop, "frontend": frontend}


def _model_config(model: str) -> dict:
    from aisim_fast.aic import timing as aic
    aic._package("engine.model")
    from aiconfigurator_core.sdk.memory import NaiveKVCacheEstimator
    config = NaiveKVCacheEstimator._load_config(model, False)
    if not isinstance(config, dict):
        _fail("engine.model", f"no model config for {model!r} in aiconfigurator-core's data; "
                              "the database has: " + aic._closest(model, aic.models()))
    return config


def _context_length(model: str) -> int:
    """``context_length: max``: the model config's longest context (the reference's keys)."""
    config = _model_config(model)
    mappings = [config.get("text_config"), config]
    for mapping in mappings:
        if not isinstance(mapping, dict):
            continue
        for name in ("max_position_embeddings", "model_max_length", "max_sequence_length",
                     "seq_length", "n_positions"):
            value = mapping.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    _fail("engine.context_length", f"the config of {model!r} declares no maximum context length; "
                                   "give engine.context_length")


def _kv_bytes_per_token(model: str, parallel: dict) -> int:
    """``bytes_per_token: auto``: KV bytes per token of one rank from the model geometry."""
    _model_config(model)
    from aiconfigurator_core.sdk.memory import NaiveKVCacheEstimator
    estimator = NaiveKVCacheEstimator.from_model_path(
        model, tp_size=parallel["tensor"], pp_size=parallel["pipeline"],
        moe_tp_size=parallel["moe_tensor"], moe_ep_size=parallel["moe_expert"],
        allow_hf_config_download=False)
    value = estimator.kv_bytes_per_token()
    if not value:
        _fail("engine.kv_transfer.bytes_per_token", f"cannot derive KV bytes per token of {model!r}; "
                                                    "give a number")
    return int(value)


def _aic_identity(engine: dict, worker: dict, role: str, backend: str, version: str) -> dict:
    """The canonical AIC timing config the reference's CLI writes for a default-timed rank."""
    par = worker["parallel"]
    sharded_moe = par["moe_tensor"] * par["moe_expert"] > 1
    timing = worker["timing"]
    quant = {key: timing.get(key) if timing.get(key) is not None else engine.get(key)
             for key in _QUANT_MODES}
    return {
        "model": engine["model"], "system": worker["hardware"] or engine["hardware"],
        "backend": backend, "worker_type": role, "backend_version": version, "fpm_profile": None,
        "tp": par["tensor"], "pp": par["pipeline"], "attention_dp": par["attention_data"], "dcp": None,
        "moe_tp_size": par["moe_tensor"] if sharded_moe else None,
        "moe_ep_size": par["moe_expert"] if sharded_moe else None,
        "gemm_quant_mode": quant["gemm_quant_mode"], "moe_quant_mode": quant["moe_quant_mode"],
        "fmha_quant_mode": quant["fmha_quant_mode"], "fpm_fmha_quant_mode": None,
        "kvcache_quant_mode": quant["kvcache_quant_mode"], "comm_quant_mode": quant["comm_quant_mode"],
        "nextn": 0, "speculation": None, "kv_block_size": worker["block_size"],
        "decoder_replay": False, "estimation_mode": "op_level", "database_mode": "SILICON",
        "transfer_policy": list(_TRANSFER_POLICY), "fallback_policy": "deny",
        "estimator_config": _default_estimator_config(), "attention_backend": None,
        "moe_kernel_source": None, "moe_backend": None, "enable_eplb": False, "wideep_num_slots": None,
        "enable_shared_layer": None, "strict_provenance": False,
    }


def _current_version(engine: dict, system: str, backend: str, path: str) -> str:
    from aisim_fast.aic import timing as aic
    aic._package(path)
    if system not in aic.systems():
        _fail(path, f"unknown hardware {system!r}; the database has: "
                    + aic._closest(system, aic.systems()))
    slots = aic.backend_versions(system, backend)
    if not slots:
        _fail(path, f"the database has no {backend} data for {system!r}")
    requested = engine.get("backend_version")
    if requested is None:
        return slots.get("current") or sorted(slots.values())[-1]
    if requested in slots:
        return slots[requested]
    if requested in slots.values():
        return requested
    listed = ", ".join(f"{v} ({k})" for k, v in slots.items())
    _fail("engine.backend_version", f"{requested!r} is not in the database for {system}/{backend}; "
                                    f"it has: {listed}")


def _sized_blocks(engine: dict, worker: dict, role: str, backend: str, version: str,
                  fraction: float) -> int:
    """KV blocks of a memory-sized pool, by the AIC memory model (as the reference sizes
    the pool of a rank of any timing)."""
    from aisim_fast.aic import timing as aic
    raw = {"model": engine["model"], "backend": backend, "system": worker["hardware"] or engine["hardware"],
           "backend_version": version, "tp": worker["parallel"]["tensor"],
           "attention_dp": worker["parallel"]["attention_data"], "kv_block_size": worker["block_size"],
           _MEMORY_FRACTION_KEY[backend]: fraction,
           "cuda_graph_reserved_bytes": worker["cuda_graph_reserved_bytes"]}
    par = worker["parallel"]
    if par["moe_tensor"] * par["moe_expert"] > 1:
        raw.update(moe_tp_size=par["moe_tensor"], moe_ep_size=par["moe_expert"])
    for key in _QUANT_MODES:
        value = worker["timing"].get(key) if worker["timing"].get(key) is not None else engine.get(key)
        if value is not None:
            raw[key] = value
    config = aic.parse_config(raw, f"{worker['path']}.kv_cache.capacity", backend=backend,
                              block_size=worker["block_size"], tp=par["tensor"],
                              dp=par["attention_data"], check_buildable=False)
    return aic.estimate_num_gpu_blocks(config, worker["block_size"],
                                       worker["scheduler"]["max_num_batched_tokens"],
                                       f"{worker['path']}.kv_cache.capacity",
                                       max_batch_size=worker["scheduler"]["max_num_seqs"])


def _pool(engine: dict, worker: dict, role: str, backend: str, version: str | None,
          transfer: dict | None) -> dict:
    """One pool of ``spec.engine``: the engine-level fields and its ``rank``."""
    par = worker["parallel"]
    rank: dict[str, Any] = {**worker["scheduler"], "block_size": worker["block_size"],
                            "enable_prefix_caching": worker["prefix_caching"]}
    context = worker["context_length"]
    if context is None and isinstance(engine.get("context_length"), int):
        context = engine["context_length"]
    if backend == "vllm" or context is not None:
        rank["max_model_len"] = context if context is not None else _context_length(engine["model"])
    explicit = worker["capacity_type"] == "fixed"
    fraction = None
    if worker["capacity_type"] == "fixed":
        if worker["blocks"] is not None:
            rank["num_gpu_blocks"] = worker["blocks"]
        else:
            rank["num_gpu_blocks"] = worker["bytes"] // (worker["block_size"] * worker["bytes_per_token"])
            if rank["num_gpu_blocks"] < 1:
                _fail(f"{worker['path']}.kv_cache.capacity.bytes", "holds less than one KV block")
    else:
        if backend == "sglang":
            # aiconfigurator-core 0.12.0's SGLang memory model leaves less for KV than the
            # reference's (Qwen3-32B, tp 2, H200, fraction 0.88: 724,366 tokens against
            # 733,828), so a pool sized here would not be the reference's pool
            _fail(f"{worker['path']}.kv_cache.capacity", "an SGLang KV pool sized from GPU memory is "
                  "not reproduced by aisim_fast (its memory model differs from the reference's for "
                  "SGLang); give capacity: {type: fixed, blocks: N}")
        fraction = worker["memory_fraction"]
        if fraction is None:
            fraction = _DEFAULT_MEMORY_FRACTION[backend]
        rank["num_gpu_blocks"] = _sized_blocks(engine, worker, role, backend, version, fraction)
        # a default-timed rank is re-sized by the run from its timing config's memory
        # fraction; any other rank keeps the blocks sized here
        explicit = worker["timing_type"] != "default"
    timing = worker["timing"]
    if worker["timing_type"] == "fixed":
        rank["timing_model"] = {"type": "fixed", "prefill_ms": float(timing["prefill_ms"]),
                                "decode_ms": float(timing["decode_ms"])}
    elif worker["timing_type"] == "polynomial":
        rank["timing_model"] = {"type": "polynomial"}
    else:
        config = _aic_identity(engine, worker, role, backend, version)
        if fraction is not None:
            config[_MEMORY_FRACTION_KEY[backend]] = fraction
            config["cuda_graph_reserved_bytes"] = worker["cuda_graph_reserved_bytes"]
        rank["timing_model"] = {"type": "external", "provider": "aic", "config": config}
    if engine.get("enable_chunked_prefill") is not None and role != "decode":
        rank["enable_chunked_prefill"] = engine["enable_chunked_prefill"]
    if transfer is not None:
        rank.update(transfer)
    if worker["host_loop"]:
        # the reference's host-aware path reads its batch budget from chunked_prefill_size
        rank["sglang"] = {"chunked_prefill_size": rank["max_num_batched_tokens"], "host_loop": True}
    if worker["frontend"] is not None:
        rank["frontend"] = worker["frontend"]
    rank["backend"] = backend
    return {"dp_size": par["attention_data"], "tensor_parallel_size": par["tensor"],
            "prefill_context_parallel_size": 1, "num_gpu_blocks_is_explicit": explicit, "rank": rank}


def lower_predict_config(doc: Any) -> dict:
    """The execution payload the reference's ``predict --stack engine`` writes for ``doc``
    (a parsed predict config), for the part of its surface aisim_fast simulates."""
    top = _section("", doc, ("traffic", "engine", "evaluation", "execution"))
    if "engine" not in top:
        _fail("engine", "required (the model, hardware, backend and workers to simulate)")
    traffic, in_flight, cap_ms = _traffic(top.get("traffic"))
    evaluation = _section("evaluation", top.get("evaluation"), ("sla",))
    sla_raw = _section("evaluation.sla", evaluation.get("sla"), ("ttft_ms", "itl_ms", "e2e_ms"))
    sla = {key: _number(f"evaluation.sla.{key}", sla_raw[key], positive=True)
           for key in ("ttft_ms", "itl_ms", "e2e_ms") if sla_raw.get(key) is not None}
    if "e2e_ms" in sla and ("ttft_ms" in sla or "itl_ms" in sla):
        _fail("evaluation.sla.e2e_ms", "is mutually exclusive with ttft_ms/itl_ms")
    # execution.resources bounds the reference's host process, not the simulation
    _section("execution", top.get("execution"), ("resources",))

    engine = _section("engine", top["engine"], _ENGINE_KEYS)
    mode = _choice("engine.mode", engine.get("mode", "aggregated"), ("aggregated", "disaggregated", "afd"))
    if mode == "afd":
        _not_simulated("engine.mode", "attention/FFN disaggregation (afd)")
    if traffic.get("trace_format") == "mooncake-delta" and mode != "aggregated":
        # the reference's CLI refuses it (its native core runs it; a payload can ask)
        _fail("traffic.source.format", "mooncake-delta requires aggregated engine mode")
    for key in ("model", "hardware"):
        if not isinstance(engine.get(key), str) or not engine[key]:
            _fail(f"engine.{key}", f"required, a non-empty string; got {engine.get(key)!r}")
    if engine["hardware"] == "auto":
        _fail("engine.hardware", "'auto' is for recommendation only; name the hardware")
    backend = _choice("engine.backend", engine.get("backend", "vllm"), ("vllm", "sglang", "trtllm"))
    context_length = engine.get("context_length", "max")
    if context_length != "max":
        _int("engine.context_length", context_length)
    if engine.get("enable_chunked_prefill") not in (None, True, False):
        _fail("engine.enable_chunked_prefill", "must be true or false")
    _check_engine_controls(engine)
    workers = _section("engine.workers", engine.get("workers"),
                       ("encoder", "aggregated", "prefill", "decode"))
    if workers.get("encoder") is not None:
        _not_simulated("engine.workers.encoder", "an encoder pool (EPD)")
    roles = ("aggregated",) if mode == "aggregated" else ("prefill", "decode")
    for role in roles:  # what is missing before what is extra, in the reference's order
        if workers.get(role) is None:
            _fail(f"engine.workers.{role}", f"{mode} mode requires workers.{role}")
    for role in ("aggregated", "prefill", "decode"):
        if role not in roles and workers.get(role) is not None:
            _fail(f"engine.workers.{role}", f"{mode} mode rejects {role} workers")
    if mode == "aggregated" and engine.get("kv_transfer") is not None:
        _fail("engine.kv_transfer", "aggregated mode rejects kv_transfer")
    parsed = {role: _worker(engine, role, workers[role], backend) for role in roles}

    # the AIC database's backend version: the current one of each pool's hardware
    # (one common version for heterogeneous prefill and decode hardware)
    needs_aic = {role: w["timing_type"] == "default" or w["capacity_type"] == "default"
                 for role, w in parsed.items()}
    versions = {role: _current_version(engine, w["hardware"] or engine["hardware"], backend,
                                       f"engine.workers.{role}.hardware" if w["hardware"] else "engine.hardware")
                for role, w in parsed.items() if needs_aic[role]}
    if mode == "disaggregated" and len(set(versions.values())) > 1:
        _fail("engine.backend_version", "heterogeneous P/D hardware requires one common backend_version; "
                                        f"the current versions are {versions}; set engine.backend_version")

    transfer = None
    if mode == "disaggregated" and engine.get("kv_transfer") is not None:
        kt = _section("engine.kv_transfer", engine["kv_transfer"], _TRANSFER_KEYS)
        per_token = kt.get("bytes_per_token", "auto")
        if per_token == "auto":
            per_token = _kv_bytes_per_token(engine["model"], parsed["prefill"]["parallel"])
        else:
            _int("engine.kv_transfer.bytes_per_token", per_token)
        transfer = {"kv_transfer_bytes_per_token": per_token}
        if kt.get("bandwidth_gb_per_second") is not None:
            transfer["kv_transfer_bandwidth"] = _number("engine.kv_transfer.bandwidth_gb_per_second",
                                                        kt["bandwidth_gb_per_second"], positive=True)
        transfer["kv_transfer_timing_mode"] = _choice(
            "engine.kv_transfer.timing_mode", kt.get("timing_mode", "destination_missing"),
            ("full_prompt", "destination_missing"))

    pools = {role: _pool(engine, w, role, backend, versions.get(role), transfer)
             for role, w in parsed.items()}
    rank_keys, timing_keys = _speculation(engine, backend, parsed)
    for pool in pools.values():
        pool["rank"].update(rank_keys)
        config = pool["rank"]["timing_model"].get("config")
        if timing_keys and config is not None:
            config.update(timing_keys)
    if mode == "aggregated":
        topology = {"kind": "aggregated",
                    "workers": {"initial_workers": parsed["aggregated"]["parallel"]["replicas"],
                                "startup_delay_ms": parsed["aggregated"]["startup_delay_ms"]}}
        spec_engine = pools["aggregated"]
    else:
        topology = {"kind": "disaggregated",
                    "prefill": {"initial_workers": parsed["prefill"]["parallel"]["replicas"],
                                "startup_delay_ms": parsed["prefill"]["startup_delay_ms"]},
                    "decode": {"initial_workers": parsed["decode"]["parallel"]["replicas"],
                               "startup_delay_ms": parsed["decode"]["startup_delay_ms"]},
                    "handoff_latency_ms": 0.0}
        spec_engine = pools
    payload_extra = {}
    tokenization = _tokenization(engine.get("tokenization"))
    if tokenization is not None:
        payload_extra["tokenization"] = tokenization
    spec = {"version": 1, "topology": topology, "engine": spec_engine,
            "adapters": {"placement": {"provider": "round_robin", "config": None},
                         "scaling": {"provider": "none", "config": None}},
            "max_sim_time_ms": cap_ms, "max_in_flight": in_flight, "record_per_request": True,
            "sla": sla, "requests": []}
    if traffic.get("trace_format") in ("dynamo", "agentic_mooncake", "weka"):
        # the CLI names its target model for Dynamo and agentic traces (agentic replay
        # projects their requests onto it)
        traffic["execution_model"] = engine["model"]
    return {"spec": spec, "traffic": traffic, **payload_extra}


def read_predict_config(path: str | Path) -> dict:
    """A predict config file, parsed (YAML or JSON), with the file named in every error."""
    path = Path(path)
    text = read_config_text(path, "predict config")
    import yaml
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a predict config is a mapping with traffic and engine, got {doc!r}")
    try:
        return lower_predict_config(doc)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
