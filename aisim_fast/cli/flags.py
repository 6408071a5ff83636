"""A replay described on the command line: ``--spec`` read as a payload, or the flags turned
into a payload, both parsed by the one payload parser (``config.payload.parse_payload``)."""

from __future__ import annotations

import json
from pathlib import Path

from aisim_fast.cli.parser import (DEFAULT_ARRIVAL_SPEEDUP_RATIO, DEFAULT_TRACE_BLOCK_SIZE, UsageError,
                                    aic_flags)
from aisim_fast.config import speculation
from aisim_fast.config.payload import (ConfigError, ReplaySetup, parse_payload, read_payload_file,
                                       set_aic_timing)
from aisim_fast.config.predict_config import read_predict_config
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
# a synthetic load in place of the trace (traffic.source_type synthetic / synthetic-session)
LOAD_FLAGS = (("load", "--load"), ("isl", "--isl"), ("osl", "--osl"), ("requests", "--requests"),
              ("rate", "--rate"), ("arrival_seed", "--arrival-seed"), ("kv_fraction", "--kv-fraction"),
              ("cached_prefix", "--cached-prefix"), ("turns", "--turns"),
              ("shared_prefix_ratio", "--shared-prefix-ratio"), ("prefix_groups", "--prefix-groups"),
              ("think_ms", "--think-ms"))
NO_SPEC_FLAGS = (("backend", "--backend"), ("workers", "--workers"),
                 ("engine_args", "--engine-args"), ("concurrency", "--concurrency"),
                 ("trace_block_size", "--trace-block-size"),
                 ("arrival_speedup_ratio", "--arrival-speedup-ratio"),
                 ("placement", "--placement"), ("placement_seed", "--placement-seed"),
                 ("router_json", "--router-json"), ("dp_size", "--dp-size"),
                 ("speculation", "--speculation"), ("acceptance", "--acceptance"),
                 ("accepted", "--accepted"), ("speculation_seed", "--speculation-seed"),
                 ("max_sim_time_ms", "--max-sim-time-ms"), ("trace_format", "--trace-format"),
                 ("agentic_lanes", "--agentic-lanes")) \
    + DISAGG_FLAGS + LOAD_FLAGS


# ---------------------------------------------------------------------------------------
# resolving the replay


def setup_from_spec(args) -> tuple[ReplaySetup, int, dict]:
    """--spec (a payload) or --predict-config (a predict config, lowered to its payload)."""
    flag = "--spec" if args.spec is not None else "--predict-config"
    if args.spec is not None and args.predict_config is not None:
        raise UsageError("give one of --spec and --predict-config")
    # (getattr's default: size takes a subset of the replay flags)
    given = [name for attr, name in NO_SPEC_FLAGS if getattr(args, attr, None) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} cannot be combined with {flag}; "
                         "change the config file instead")
    if args.trace is not None:
        raise UsageError(f"with {flag}, give the trace as --trace PATH")
    if args.spec is not None:
        spec_path = Path(args.spec)
        payload = read_payload_file(spec_path)
        source = {"mode": "spec", "spec_file": str(spec_path.resolve())}
    else:
        spec_path = Path(args.predict_config)
        payload = read_predict_config(spec_path)
        source = {"mode": "predict_config", "predict_config": str(spec_path.resolve())}
    if aic_flags(args):
        payload = set_aic_timing(payload, **aic_flags(args), where="--")
    setup = parse_payload(payload, spec_path.parent, args.trace_flag)
    source["trace_override"] = args.trace_flag is not None
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


def speculation_fields(args) -> dict:
    """The rank fields ``--speculation KIND:N`` with ``--acceptance`` / ``--accepted`` /
    ``--speculation-seed`` set (none without ``--speculation``)."""
    given = [flag for attr, flag in (("acceptance", "--acceptance"), ("accepted", "--accepted"),
                                     ("speculation_seed", "--speculation-seed"))
             if getattr(args, attr, None) is not None]
    if getattr(args, "speculation", None) is None:
        if given:
            raise UsageError(f"{given[0]} needs --speculation KIND:N")
        return {}
    fields = speculation.rank_fields(args.speculation)
    if fields and ("@" in args.speculation) and (args.acceptance is not None or args.accepted is not None):
        raise UsageError("--speculation KIND:N@.. already gives the acceptance; drop --acceptance / "
                         "--accepted")
    if args.acceptance is not None and args.accepted is not None:
        raise UsageError("--acceptance and --accepted are two ways to give the same rates; give one")
    if not fields:
        if given:
            raise UsageError(f"{given[0]} needs speculation (--speculation none turns it off)")
        return {}
    if args.acceptance is not None:
        fields["aic_nextn_accept_rates"] = args.acceptance
    if args.accepted is not None:
        fields["aic_nextn_accept_rates"] = speculation.rates_for_expected(
            fields["aic_nextn"], args.accepted, "--accepted")
    if args.speculation_seed is not None:
        fields["aic_mtp_seed"] = args.speculation_seed
    return fields


def _transfer_fields(args) -> dict:
    """The transfer flags as the rank fields they set (on both pools' ranks: the source
    side's are the ones that time the transfer)."""
    fields = {}
    if args.kv_transfer_bandwidth is not None:
        fields["kv_transfer_bandwidth"] = args.kv_transfer_bandwidth
    if args.kv_bytes_per_token is not None:
        fields["kv_transfer_bytes_per_token"] = args.kv_bytes_per_token
    return fields


# Where a flag's value lands in the payload: an error the payload parser reports at a
# path is reported at the flag (longer paths first: the first match wins)
FLAG_PATHS = (
    ("spec.engine.prefill.rank.kv_transfer_bandwidth", "--kv-transfer-bandwidth"),
    ("spec.engine.decode.rank.kv_transfer_bandwidth", "--kv-transfer-bandwidth"),
    ("spec.engine.prefill.rank.kv_transfer_bytes_per_token", "--kv-bytes-per-token"),
    ("spec.engine.decode.rank.kv_transfer_bytes_per_token", "--kv-bytes-per-token"),
    ("spec.engine.prefill.rank", "--prefill-engine-args"),
    ("spec.engine.decode.rank", "--decode-engine-args"),
    ("spec.engine.prefill.dp_size", "--prefill-dp-size"),
    ("spec.engine.decode.dp_size", "--decode-dp-size"),
    ("spec.engine.rank", "--engine-args"),
    ("spec.engine.dp_size", "--dp-size"),
    ("spec.topology.workers.initial_workers", "--workers"),
    ("spec.topology.prefill.initial_workers", "--prefill-workers"),
    ("spec.topology.decode.initial_workers", "--decode-workers"),
    ("spec.topology.handoff_latency_ms", "--handoff-latency-ms"),
    ("spec.adapters.placement.config.seed", "--placement-seed"),
    ("spec.adapters.placement.config", "--router-json"),
    ("spec.max_sim_time_ms", "--max-sim-time-ms"),
    ("traffic.replay_concurrency", "--concurrency"),
    ("traffic.concurrency", "--concurrency"),
    ("traffic.trace_format", "--trace-format"),
    ("traffic.agentic_lanes", "--agentic-lanes"),
    ("traffic.load_type", "--load"),
    ("traffic.isl", "--isl"),
    ("traffic.osl", "--osl"),
    ("traffic.request_count", "--requests"),
    ("traffic.request_rate", "--rate"),
    ("traffic.arrival_interval_ms", "--rate"),
    ("traffic.arrival_seed", "--arrival-seed"),
    ("traffic.kv_load_ratio", "--kv-fraction"),
    ("traffic.cached_prefix_tokens", "--cached-prefix"),
    ("traffic.turns_per_session", "--turns"),
    ("traffic.shared_prefix_ratio", "--shared-prefix-ratio"),
    ("traffic.num_prefix_groups", "--prefix-groups"),
    ("traffic.inter_turn_delay_ms", "--think-ms"),
    ("traffic.trace_block_size", "--trace-block-size"),
    ("traffic.arrival_speedup_ratio", "--arrival-speedup-ratio"),
)


def at_flag(exc: ConfigError) -> ConfigError:
    """The payload parser's error, named by the flag that gave the value."""
    message = str(exc)
    for path, flag in FLAG_PATHS:
        if message == path or message.startswith((path + ":", path + ".")):
            return ConfigError(flag + message[len(path):])
    return exc


def payload_from_flags(args) -> dict:
    """The execution payload the replay flags describe (values as given: the payload
    parser checks them)."""
    disaggregated = any(getattr(args, attr) is not None for attr, _ in DISAGG_FLAGS)
    if disaggregated:
        if args.prefill_workers is None and args.decode_workers is None:
            given = [flag for attr, flag in DISAGG_FLAGS if getattr(args, attr) is not None]
            raise UsageError(f"{', '.join(given)} need a disaggregated topology: give "
                             "--prefill-workers and --decode-workers")
        if args.workers is not None:
            raise UsageError("--workers is the aggregated pool size; with --prefill-workers give "
                             "--decode-workers instead")
        if args.engine_args is not None:
            raise UsageError("--engine-args describes an aggregated pool; use --prefill-engine-args "
                             "and --decode-engine-args")
        if args.dp_size is not None:
            raise UsageError("--dp-size: sets the aggregated workers' ranks; a disaggregated pool's are "
                             "--prefill-dp-size and --decode-dp-size")
        if args.decode_workers is None or args.prefill_workers is None:
            raise UsageError("a disaggregated replay needs both --prefill-workers and --decode-workers")
        transfer = {**_transfer_fields(args), **speculation_fields(args)}
        engine = {}
        for role, text, flag, dp in (("prefill", args.prefill_engine_args, "--prefill-engine-args",
                                      args.prefill_dp_size),
                                     ("decode", args.decode_engine_args, "--decode-engine-args",
                                      args.decode_dp_size)):
            fields = _engine_args(text, flag, args.backend)
            for key, value in transfer.items():
                if key in fields and fields[key] != value:
                    raise ConfigError(f"{flag}.{key}: {fields[key]!r} contradicts the flag value {value!r}")
                fields[key] = value
            engine[role] = {"rank": fields, **({"dp_size": dp} if dp is not None else {})}
        topology = {"kind": "disaggregated", "prefill": {"initial_workers": args.prefill_workers},
                    "decode": {"initial_workers": args.decode_workers},
                    **({"handoff_latency_ms": args.handoff_latency_ms}
                       if args.handoff_latency_ms is not None else {})}
    else:
        rank = _engine_args(args.engine_args, "--engine-args", args.backend)
        for key, value in speculation_fields(args).items():
            if key in rank and rank[key] != value:
                raise ConfigError(f"--engine-args.{key}: {rank[key]!r} contradicts --speculation's {value!r}")
            rank[key] = value
        engine = {"rank": rank,
                  **({"dp_size": args.dp_size} if args.dp_size is not None else {})}
        topology = {"kind": "aggregated", "workers": {"initial_workers": args.workers}}
    if args.placement_seed is not None and args.placement not in ("random", "kv_router"):
        raise UsageError("--placement-seed needs --placement random or kv_router")
    if args.router_json is not None and args.placement != "kv_router":
        raise UsageError("--router-json needs --placement kv_router")
    config = {}
    if args.placement == "kv_router" and args.router_json is not None:
        try:
            config = json.loads(args.router_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--router-json: not valid JSON ({exc})") from None
        if not isinstance(config, dict) or "seed" in config:
            raise ConfigError("--router-json: must be a JSON object of router knobs (the seed is "
                              "--placement-seed)")
    if args.placement_seed is not None:
        config = {**config, "seed": args.placement_seed}
    spec = {"topology": topology, "engine": engine,
            "adapters": {"placement": {"provider": args.placement or "round_robin",
                                       **({"config": config} if config else {})}}}
    if args.max_sim_time_ms is not None:
        spec["max_sim_time_ms"] = args.max_sim_time_ms
    trace = args.trace if args.trace is not None else args.trace_flag
    if any(getattr(args, attr, None) is not None for attr, _ in LOAD_FLAGS):  # size has none
        return {"spec": spec, "traffic": _synthetic_traffic(args, trace)}
    traffic = {"trace_path": str(default_trace_path() if trace is None else Path(trace)),
               "trace_block_size": (DEFAULT_TRACE_BLOCK_SIZE if args.trace_block_size is None
                                    else args.trace_block_size),
               "arrival_speedup_ratio": (DEFAULT_ARRIVAL_SPEEDUP_RATIO if args.arrival_speedup_ratio is None
                                         else args.arrival_speedup_ratio)}
    if args.concurrency is not None:
        traffic.update(load_type="concurrency", replay_concurrency=args.concurrency)
    if getattr(args, "trace_format", None) is not None:  # size has no --trace-format
        traffic["trace_format"] = args.trace_format
        if args.trace_format in ("agentic_mooncake", "dynamo", "weka"):
            # the reference projects an agentic trace's requests onto a configured model
            # (a Dynamo trace is agentic when its records carry agent_context)
            traffic["execution_model"] = getattr(args, "model", None) or "unspecified"
        if args.trace_format in ("dynamo", "weka") and args.trace_block_size is None:
            del traffic["trace_block_size"]  # the trace's own
    if getattr(args, "agentic_lanes", None) is not None:
        traffic["agentic_lanes"] = args.agentic_lanes
    return {"spec": spec, "traffic": traffic}


def _synthetic_traffic(args, trace) -> dict:
    """The synthetic load the load flags describe (values as given: the payload parser
    checks them, and its errors name the flags)."""
    given = [flag for attr, flag in LOAD_FLAGS if getattr(args, attr) is not None]
    for attr, flag in (("trace_block_size", "--trace-block-size"),
                       ("arrival_speedup_ratio", "--arrival-speedup-ratio"), ("trace_format", "--trace-format")):
        if getattr(args, attr) is not None:
            raise UsageError(f"{flag} is for traces; {given[0]} asks for a synthetic load")
    if trace is not None:
        raise UsageError(f"a synthetic load ({', '.join(given)}) replaces the trace: give one of them")
    missing = [flag for attr, flag in (("load", "--load"), ("isl", "--isl"), ("osl", "--osl"),
                                       ("requests", "--requests")) if getattr(args, attr) is None]
    if missing:
        raise UsageError(f"a synthetic load needs {', '.join(missing)} (given: {', '.join(given)})")
    sessions = args.turns is not None and args.turns > 1
    for attr, flag in (("shared_prefix_ratio", "--shared-prefix-ratio"), ("prefix_groups", "--prefix-groups"),
                       ("think_ms", "--think-ms")):
        if getattr(args, attr) is not None and not sessions:
            raise UsageError(f"{flag} shapes sessions: give --turns N (N > 1) too")
    wants = {"concurrency": ("--concurrency", args.concurrency), "poisson": ("--rate", args.rate),
             "constant_rate": ("--rate", args.rate), "kv_capacity_fraction": ("--kv-fraction", args.kv_fraction)}
    flag, value = wants[args.load]
    if value is None:
        raise UsageError(f"--load {args.load} needs {flag}")
    for attr, other in (("concurrency", "--concurrency"), ("rate", "--rate"), ("kv_fraction", "--kv-fraction")):
        if getattr(args, attr) is not None and other != flag:
            raise UsageError(f"{other} does not apply to --load {args.load}")
    if args.arrival_seed is not None and args.load != "poisson":
        raise UsageError("--arrival-seed seeds poisson arrivals: give --load poisson")
    traffic = {"source_type": "synthetic-session" if sessions else "synthetic", "load_type": args.load,
               "isl": args.isl, "osl": args.osl, "request_count": args.requests}
    if args.cached_prefix is not None:
        traffic["cached_prefix_tokens"] = args.cached_prefix
    if args.load == "concurrency":
        traffic["concurrency"] = args.concurrency
    elif args.load == "kv_capacity_fraction":
        traffic["kv_load_ratio"] = args.kv_fraction
    elif args.load == "poisson":
        traffic["request_rate"] = args.rate
        if args.arrival_seed is not None:
            traffic["arrival_seed"] = args.arrival_seed
    else:  # the reference's CLI writes a constant rate as its interval
        traffic["arrival_interval_ms"] = 1000.0 / args.rate if args.rate > 0 else args.rate
    if sessions:
        traffic["turns_per_session"] = args.turns
        for attr, key in (("shared_prefix_ratio", "shared_prefix_ratio"), ("prefix_groups", "num_prefix_groups"),
                          ("think_ms", "inter_turn_delay_ms")):
            if getattr(args, attr) is not None:
                traffic[key] = getattr(args, attr)
    return traffic


def setup_from_flags(args) -> tuple[ReplaySetup, int, dict]:
    """The replay the flags describe: their payload (``payload_from_flags``, timed by AIC
    with --model / --system), through the one payload parser; an error names the flag."""
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
    payload = payload_from_flags(args)
    if aic_flags(args):
        payload = set_aic_timing(payload, **aic_flags(args), where="--")
    try:
        setup = parse_payload(payload, ".", None)
    except ConfigError as exc:
        raise at_flag(exc) from None
    default_trace = args.trace is None and args.trace_flag is None
    return setup, setup.gpus_per_worker, {"mode": "flags", "default_trace": default_trace}
