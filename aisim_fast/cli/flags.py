"""A replay described on the command line: ``--spec`` read as a payload, or the flags turned
into a payload, both parsed by the one payload parser (``config.payload.parse_payload``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from aisim_fast.cli.parser import (DEFAULT_ARRIVAL_SPEEDUP_RATIO, DEFAULT_TRACE_BLOCK_SIZE, UsageError,
                                    aic_flags)
from aisim_fast.config.payload import (ConfigError, ReplaySetup, check_attention_dp, check_disaggregated_pair,
                                       parse_payload, parse_placement, parse_rank, set_aic_timing)
from aisim_fast.trace.workload import default_trace_path

# Flags that describe a replay without a spec; with --spec they would be silently
# ignored or contradict the spec, so they are refused.
DISAGG_FLAGS = (("prefill_workers", "--prefill-workers"), ("decode_workers", "--decode-workers"),
                ("prefill_engine_args", "--prefill-engine-args"),
                ("decode_engine_args", "--decode-engine-args"),
                ("kv_transfer_bandwidth", "--kv-transfer-bandwidth"),
                ("kv_bytes_per_token", "--kv-bytes-per-token"),
                ("handoff_latency_ms", "--handoff-latency-ms"),
                ("prefill_dp_size", "--prefill-dp-size"), ("decode_dp_size", "--decode-dp-size"))
NO_SPEC_FLAGS = (("backend", "--backend"), ("workers", "--workers"),
                 ("engine_args", "--engine-args"), ("concurrency", "--concurrency"),
                 ("trace_block_size", "--trace-block-size"),
                 ("arrival_speedup_ratio", "--arrival-speedup-ratio"),
                 ("placement", "--placement"), ("placement_seed", "--placement-seed"),
                 ("router_json", "--router-json"), ("dp_size", "--dp-size"),
                 ("max_sim_time_ms", "--max-sim-time-ms")) + DISAGG_FLAGS


# ---------------------------------------------------------------------------------------
# resolving the replay


def _read_json_file(path: Path, what: str):
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


def setup_from_spec(args) -> tuple[ReplaySetup, int, dict]:
    given = [flag for attr, flag in NO_SPEC_FLAGS if getattr(args, attr) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} cannot be combined with --spec; "
                         "change the spec file instead")
    if args.trace is not None:
        raise UsageError("with --spec, give the trace as --trace PATH")
    spec_path = Path(args.spec)
    payload = _read_json_file(spec_path, "spec file")
    if aic_flags(args):
        payload = set_aic_timing(payload, **aic_flags(args), where="--")
    setup = parse_payload(payload, spec_path.parent, args.trace_flag)
    source = {"mode": "spec", "spec_file": str(spec_path.resolve()),
              "trace_override": args.trace_flag is not None}
    return setup, setup.gpus_per_worker, source


def _engine_args(text: str | None, flag: str, backend: str) -> dict:
    """Reference rank fields from a --*engine-args JSON object, over {"backend": ...}."""
    fields = {"backend": backend}
    if text is None:
        return fields
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: not valid JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"{flag}: must be a JSON object of rank fields, got {extra!r}")
    if "backend" in extra and extra["backend"] != backend:
        raise ConfigError(f"{flag}.backend: {extra['backend']!r} contradicts --backend {backend} "
                          "(prefill and decode pools must use the same backend)")
    fields.update(extra)
    return fields


def _flag_count(value: int | None, flag: str) -> int:
    if value is None or value < 1:
        raise ConfigError(f"{flag}: must be an integer >= 1, got {value}")
    return value


def _disaggregated_from_flags(args) -> dict:
    """Pools and transfer model of a disaggregated replay given by flags. The transfer
    flags are the source (prefill) ranks' engine args; a value also given in an
    engine-args JSON must agree with the flag."""
    if args.workers is not None:
        raise UsageError("--workers is the aggregated pool size; with --prefill-workers give "
                         "--decode-workers instead")
    if args.engine_args is not None:
        raise UsageError("--engine-args describes an aggregated pool; use --prefill-engine-args "
                         "and --decode-engine-args")
    if args.decode_workers is None or args.prefill_workers is None:
        raise UsageError("a disaggregated replay needs both --prefill-workers and --decode-workers")
    transfer = {}
    if args.kv_transfer_bandwidth is not None:
        bw = args.kv_transfer_bandwidth
        if not math.isfinite(bw) or bw < 0:
            raise ConfigError(f"--kv-transfer-bandwidth: must be a finite number >= 0 "
                              f"(decimal GB/s), got {bw}")
        transfer["kv_transfer_bandwidth"] = bw
    if args.kv_bytes_per_token is not None:
        if args.kv_bytes_per_token < 1:
            raise ConfigError(f"--kv-bytes-per-token: must be an integer >= 1, got "
                              f"{args.kv_bytes_per_token}")
        transfer["kv_transfer_bytes_per_token"] = args.kv_bytes_per_token
    latency = 0.0 if args.handoff_latency_ms is None else args.handoff_latency_ms
    if not math.isfinite(latency) or latency < 0:
        raise ConfigError(f"--handoff-latency-ms: must be a finite number >= 0, got {latency}")
    pools = {}
    for role, text, flag in (("prefill", args.prefill_engine_args, "--prefill-engine-args"),
                             ("decode", args.decode_engine_args, "--decode-engine-args")):
        fields = _engine_args(text, flag, args.backend)
        for key, value in transfer.items():
            if key in fields and fields[key] != value:
                raise ConfigError(f"{flag}.{key}: {fields[key]!r} contradicts the flag value {value!r}")
            fields[key] = value
        if fields.setdefault("worker_type", role) != role:
            raise ConfigError(f"{flag}.worker_type: must be {role!r}, got {fields['worker_type']!r}")
        pools[role] = parse_rank(fields, flag)
    check_disaggregated_pair(pools["prefill"], pools["decode"], "--decode-engine-args")
    dp = {role: 1 if value is None else _flag_count(value, flag)
          for role, value, flag in (("prefill", args.prefill_dp_size, "--prefill-dp-size"),
                                    ("decode", args.decode_dp_size, "--decode-dp-size"))}
    for role, flag in (("prefill", "--prefill-engine-args"), ("decode", "--decode-engine-args")):
        check_attention_dp(pools[role], dp[role], flag, role)
    return dict(rank=pools["decode"], workers=_flag_count(args.decode_workers, "--decode-workers"),
                prefill_rank=pools["prefill"],
                prefill_workers=_flag_count(args.prefill_workers, "--prefill-workers"),
                handoff_latency_ms=float(latency), dp_size=dp["decode"], prefill_dp_size=dp["prefill"])


def setup_from_flags(args) -> tuple[ReplaySetup, int, dict]:
    if args.trace is not None and args.trace_flag is not None:
        raise UsageError("give the trace either as TRACE or as --trace, not both")
    disaggregated = any(getattr(args, attr) is not None for attr, _ in DISAGG_FLAGS)
    missing = [flag for flag, absent in (("--backend", args.backend is None),
                                         ("--workers", args.workers is None and not disaggregated))
               if absent]
    if missing:
        raise UsageError(f"without --spec, {' and '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} required"
                         + (" (or --prefill-workers and --decode-workers for disaggregated pools)"
                            if "--workers" in missing else ""))
    if aic_flags(args):
        # the flags' pools, timed by AIC: one payload through the spec path's parser
        return _setup_from_flag_payload(args, disaggregated)
    if disaggregated:
        if args.prefill_workers is None and args.decode_workers is None:
            given = [flag for attr, flag in DISAGG_FLAGS if getattr(args, attr) is not None]
            raise UsageError(f"{', '.join(given)} need a disaggregated topology: give "
                             "--prefill-workers and --decode-workers")
        if args.dp_size is not None:
            raise UsageError("--dp-size: sets the aggregated workers' ranks; a disaggregated pool's are "
                             "--prefill-dp-size and --decode-dp-size")
        topology = _disaggregated_from_flags(args)
    else:
        topology = dict(rank=parse_rank(_engine_args(args.engine_args, "--engine-args", args.backend),
                                        "--engine-args"),
                        workers=_flag_count(args.workers, "--workers"),
                        dp_size=1 if args.dp_size is None else _flag_count(args.dp_size, "--dp-size"))
        check_attention_dp(topology["rank"], topology["dp_size"], "--engine-args")
    concurrency = 0
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise ConfigError(f"--concurrency: must be an integer >= 1, got {args.concurrency}")
        concurrency = args.concurrency
    block_tokens = DEFAULT_TRACE_BLOCK_SIZE if args.trace_block_size is None else args.trace_block_size
    if block_tokens < 1:
        raise ConfigError(f"--trace-block-size: must be an integer >= 1, got {block_tokens}")
    ratio = (DEFAULT_ARRIVAL_SPEEDUP_RATIO if args.arrival_speedup_ratio is None
             else args.arrival_speedup_ratio)
    if not (math.isfinite(ratio) and ratio > 0.0):
        raise ConfigError(f"--arrival-speedup-ratio: must be a finite number > 0, got {ratio}")
    trace = args.trace if args.trace is not None else args.trace_flag
    default_trace = trace is None
    trace_path = str(default_trace_path() if default_trace else Path(trace))
    if args.placement_seed is not None and args.placement not in ("random", "kv_router"):
        raise UsageError("--placement-seed needs --placement random or kv_router")
    if args.router_json is not None and args.placement != "kv_router":
        raise UsageError("--router-json needs --placement kv_router")
    if args.placement_seed is not None and not 0 <= args.placement_seed < 2 ** 63:
        raise ConfigError(f"--placement-seed: must be an integer in [0, 2**63), got {args.placement_seed}")
    router = None
    if args.placement == "kv_router":
        try:
            knobs = json.loads(args.router_json) if args.router_json is not None else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--router-json: not valid JSON ({exc})") from None
        if not isinstance(knobs, dict) or "seed" in knobs:
            raise ConfigError("--router-json: must be a JSON object of router knobs (the seed is "
                              "--placement-seed)")
        _, _, router = parse_placement({"provider": "kv_router", "config": knobs}, "--router-json")
    max_sim_time_ms = None
    if args.max_sim_time_ms is not None:
        max_sim_time_ms = args.max_sim_time_ms
        if not (math.isfinite(max_sim_time_ms) and max_sim_time_ms >= 0.0):
            raise ConfigError(f"--max-sim-time-ms: must be a finite number >= 0, got {max_sim_time_ms}")
    setup = ReplaySetup(trace_path=trace_path, trace_block_size=block_tokens,
                        arrival_speedup_ratio=ratio, concurrency=concurrency, sla={},
                        placement=args.placement or "round_robin",
                        placement_seed=args.placement_seed or 0, router=router,
                        max_sim_time_ms=max_sim_time_ms, **topology)
    return setup, setup.gpus_per_worker, {"mode": "flags", "default_trace": default_trace}


def _setup_from_flag_payload(args, disaggregated: bool) -> tuple[ReplaySetup, int, dict]:
    """Flags with --model / --system: the setup the flags give, as a payload, with
    every pool's timing set by set_aic_timing (which also sets tensor parallelism)."""
    plain = argparse.Namespace(**{**vars(args), "model": None, "system": None, "tp": None,
                                  "backend_version": None})
    setup, _, source = setup_from_flags(plain)

    def block(rank, tp):
        return {"tensor_parallel_size": tp, "rank": rank.payload()}

    explicit_blocks = "num_gpu_blocks" in json.dumps([args.engine_args, args.prefill_engine_args,
                                                      args.decode_engine_args])
    if disaggregated:
        topology = {"kind": "disaggregated", "prefill": {"initial_workers": setup.prefill_workers},
                    "decode": {"initial_workers": setup.workers},
                    "handoff_latency_ms": setup.handoff_latency_ms}
        engine = {"prefill": {**block(setup.prefill_rank, 1), "dp_size": setup.prefill_dp_size},
                  "decode": {**block(setup.rank, 1), "dp_size": setup.dp_size}}
    else:
        topology = {"kind": "aggregated", "workers": {"initial_workers": setup.workers}}
        engine = {**block(setup.rank, 1), "dp_size": setup.dp_size}
    if not explicit_blocks:  # no --*engine-args capacity: estimated from model + GPU memory
        for b in ([engine["prefill"], engine["decode"]] if disaggregated else [engine]):
            b["rank"].pop("num_gpu_blocks", None)
    payload = {"spec": {"topology": topology, "engine": engine,
                        "adapters": {"placement": {"provider": setup.placement,
                                                   "config": _placement_config(setup)}},
                        "max_sim_time_ms": setup.max_sim_time_ms},
               "traffic": {"trace_path": setup.trace_path, "trace_block_size": setup.trace_block_size,
                           "arrival_speedup_ratio": setup.arrival_speedup_ratio,
                           **({"load_type": "concurrency", "replay_concurrency": setup.concurrency}
                              if setup.concurrency else {})}}
    payload = set_aic_timing(payload, **aic_flags(args), where="--")
    setup = parse_payload(payload, ".", None)
    return setup, setup.gpus_per_worker, source


def _placement_config(setup: ReplaySetup) -> dict | None:
    if setup.placement == "random":
        return {"seed": setup.placement_seed}
    if setup.placement == "kv_router":
        return {"seed": setup.placement_seed, **dataclasses.asdict(setup.router)}
    return None
