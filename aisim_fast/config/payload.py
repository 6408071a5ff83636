"""Configuration: the rank scheduler fields and the replay execution payload, with
the reference's names and defaults (spec/engine.md §1, reference/README.md §4).

Unknown fields are rejected, as the reference's ``deny_unknown_fields`` does, and
every error names the field path and what is allowed. Fields the reference has
but aisim_fast does not simulate yet are rejected when set to a non-default
value rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from aisim_fast.aic import timing as aic
from aisim_fast.kernels.schema.layout import SPEC_MAX_NEXTN
from aisim_fast.trace.inline_requests import InlineRequestError, parse_inline_requests
from aisim_fast.trace.synthetic import LOAD_TYPES as SYNTHETIC_LOAD_TYPES, SyntheticLoad
from aisim_fast.trace.formats import ALL_TRACE_FORMATS, MULTI_FILE_FORMATS, TRACE_FORMATS

BACKENDS = ("vllm", "trtllm", "sglang")
SIMULATED_BACKENDS = ("vllm", "trtllm", "sglang")
NATIVE_BLOCK_SIZE = {"vllm": 64, "sglang": 1, "trtllm": 32}
TIMING_TYPES = ("polynomial", "fixed", "external")
TIMING_PROVIDERS = ("aic",)  # external providers (the reference's only one)
PREEMPTION_MODES = ("lifo", "fifo")
TRANSFER_MODES = ("full_prompt", "destination_missing")
WORKER_TYPES = ("aggregated", "prefill", "decode")
# placement providers (kernels.routing.placement, kernels.routing.kv_router); the reference has round_robin only
PLACEMENTS = ("round_robin", "random", "kv_router")


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the field path."""


class ConfigWarning(UserWarning):
    """An input the reference accepts and runs in its own way; the message starts with
    the field path and says how it is run."""


def _warn(path: str, message: str) -> None:
    warnings.warn(f"{path}: {message}", ConfigWarning, stacklevel=3)


def _fail(path: str, message: str):
    raise ConfigError(f"{path}: {message}")


def _int(path: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        _fail(path, f"must be an integer >= {minimum}, got {value}")
    return value


def _float(path: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(path, f"must be a finite number >= {minimum}, got {value!r}")
    if value < minimum:
        _fail(path, f"must be a finite number >= {minimum}, got {value}")
    return float(value)


def _positive_float(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        _fail(path, f"must be a finite number > 0, got {value!r}")
    return float(value)


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"must be true or false, got {value!r}")
    return value


def _obj(path: str, value: Any) -> dict:
    """A JSON object member; absent (None) reads as empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(path, f"must be an object, got {json.dumps(value)[:40]}")
    return value


def _choice(path: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        _fail(path, f"must be one of {', '.join(allowed)}; got {value!r}")
    return value


@dataclass(frozen=True)
class RankConfig:
    """Scheduler configuration of one rank (reference ``EngineConfig``)."""
    backend: str = "vllm"
    num_gpu_blocks: int = 16384
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "lifo"
    speedup_ratio: float = 1.0
    decode_speedup_ratio: float = 1.0
    worker_type: str = "aggregated"
    timing_model: str = "polynomial"
    fixed_prefill_ms: float = 0.0
    fixed_decode_ms: float = 0.0
    kv_transfer_bandwidth: float | None = None
    kv_transfer_bytes_per_token: int | None = None
    kv_transfer_timing_mode: str = "full_prompt"
    # SGLang (backend sglang): the rank's ``sglang`` block
    sglang_schedule_policy: str = "fifo"
    sglang_max_prefill_tokens: int = 16384
    sglang_chunked_prefill_size: int = 8192
    sglang_clip_max_new_tokens: int = 4096
    sglang_schedule_conservativeness: float = 1.0
    sglang_host_loop: bool = False       # the overlapped host loop (kernels.sglang.host_loop)
    # SGLang: the frontend's stages ahead of the scheduler (kernels.sglang.frontend), each
    # (workers, service_ms, concurrency_scale); None = none
    frontend: tuple | None = None
    # SGLang: passes without prefill after one that prefilled (a top-level rank field)
    prefill_decode_interval: int = 0
    # speculative decoding (kernels.spec): drafts per verify pass (None = none), their
    # conditional acceptance rates as given, and the rank samplers' base seed
    aic_nextn: int | None = None
    aic_nextn_accept_rates: str | None = None
    aic_mtp_seed: int = 42
    # vLLM with attention DP: prefills are admitted on every N-th group pass only
    # (engine.md 5.7; no effect with dp_size 1)
    prefill_schedule_interval: int = 1
    # KV events (vLLM / TRT-LLM): a replay writes them (kv_events.parquet), with each
    # stored block's token ids too
    emit_kv_events: bool = False
    emit_kv_token_ids: bool = False
    # timing_model "aic" (the payload's external provider): its resolved config
    aic: Any = None                      # aisim_fast.aic.timing.AicConfig
    num_gpu_blocks_estimated: bool = False  # num_gpu_blocks from the AIC memory model

    def for_worker(self, w: int, dp_size: int = 1) -> "RankConfig":
        """This rank as worker ``w`` of its pool replayed on its own (a unit of a split
        run, a rank of the rank protocol): a speculating rank's sampler is seeded by the
        worker's number in its pool (``aic_mtp_seed + w * dp_size``, kernels.spec.sampler),
        and alone it is worker 0."""
        if self.aic_nextn is None or w == 0:
            return self
        return replace(self, aic_mtp_seed=self.aic_mtp_seed + w * dp_size)

    def to_json(self) -> dict:
        d = asdict(self)
        d["aic"] = None if self.aic is None else self.aic.to_json()
        return d

    def payload(self) -> dict:
        """The rank as a spec payload gives it (the reference's field names; unset
        fields left out)."""
        raw = {k: v for k, v in asdict(self).items()
               if k not in ("aic", "num_gpu_blocks_estimated", "fixed_prefill_ms", "fixed_decode_ms")
               and not k.startswith("sglang_") and v is not None}
        raw["timing_model"] = self.timing_json()
        if self.backend == "sglang":
            raw["sglang"] = {key: getattr(self, "sglang_" + key) for key in SGLANG_KEYS}
        if self.frontend is not None:
            raw["frontend"] = {"stages": [{"workers": k, "service_ms": ms, "concurrency_scale": list(scale)}
                                          for k, ms, scale in self.frontend]}
        return raw

    def timing_json(self) -> dict:
        """The rank's ``timing_model`` as a spec payload gives it."""
        if self.timing_model == "fixed":
            return {"type": "fixed", "prefill_ms": self.fixed_prefill_ms, "decode_ms": self.fixed_decode_ms}
        if self.timing_model == "aic":
            return {"type": "external", "provider": "aic", "config": self.aic.spec_json()}
        return {"type": "polynomial"}


# Reference fields accepted only at their default (or absent): value = default.
_UNSIMULATED = {
    "native_host_offload": None,  # the tiers first: they are what a payload with them asks for
    "g3_offload": None,
    "kv_cache_bytes_per_token": None,  # accepted without a tier on an explicit pool (parse_rank)
    "state_cache": None,
    "vision": None,
}


DEFAULT_ACCEPT_RATES = (0.85, 0.3, 0.0, 0.0, 0.0)  # the reference's, cut or padded to nextn


def accept_rates(nextn: int, rates: str | None, path: str = "aic_nextn_accept_rates") -> tuple[float, ...]:
    """The conditional acceptance rate of each of ``nextn`` drafts: ``rates`` (a comma
    list) or the reference's defaults, each checked finite in [0, 1], then cut or
    zero-padded to ``nextn`` entries."""
    if rates is None or not rates.strip():
        parsed = list(DEFAULT_ACCEPT_RATES)
    else:
        parsed = []
        for item in rates.split(","):
            try:
                parsed.append(float(item.strip()))
            except ValueError:
                _fail(path, f"invalid value {item.strip()!r}: not a number")
    for i, rate in enumerate(parsed):
        if not math.isfinite(rate) or not 0.0 <= rate <= 1.0:
            _fail(f"{path}[{i}]", f"must be finite and in [0, 1], got {rate}")
    return tuple((parsed + [0.0] * nextn)[:nextn])


def parse_speculation(raw: dict, path: str, decode_speedup_ratio: float, backend: str = "vllm",
                      dp_size: int = 1) -> dict:
    """A rank's speculative-decoding keys, checked as the reference checks them; what
    aisim_fast does not simulate yet (SGLang ranks, attention DP, AIC timing) refused."""
    out: dict[str, Any] = {}
    nextn = raw.get("aic_nextn")
    rates = raw.get("aic_nextn_accept_rates")
    if nextn is None:
        if rates is not None:
            _fail(f"{path}.aic_nextn_accept_rates", "requires aic_nextn")
    else:
        out["aic_nextn"] = _int(f"{path}.aic_nextn", nextn, 1)
        if out["aic_nextn"] > SPEC_MAX_NEXTN:
            _fail(f"{path}.aic_nextn", f"must be in 1..={SPEC_MAX_NEXTN}, got {nextn}")
        if rates is not None and not isinstance(rates, str):
            _fail(f"{path}.aic_nextn_accept_rates", f"must be a comma-separated string, got {rates!r}")
        accept_rates(out["aic_nextn"], rates, f"{path}.aic_nextn_accept_rates")
        out["aic_nextn_accept_rates"] = rates
        sglang = raw.get("sglang") if isinstance(raw.get("sglang"), dict) else {}
        if backend == "sglang" and (sglang.get("host_loop") or raw.get("frontend") is not None):
            _fail(f"{path}.aic_nextn", "speculation with SGLang's host loop is not simulated by aisim_fast "
                  "yet (without it, it is)")
        if dp_size > 1:
            _fail(f"{path}.aic_nextn", "speculation with attention DP (dp_size > 1) is not simulated by "
                  "aisim_fast yet")
        if decode_speedup_ratio != 1.0:
            _fail(f"{path}.decode_speedup_ratio", "must be 1.0 with aic_nextn (the reference models "
                  f"speculative speed-up by its multi-token passes), got {decode_speedup_ratio}")
    seed = raw.get("aic_mtp_seed", 42)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        _fail(f"{path}.aic_mtp_seed", f"must be an integer in [0, 2**64), got {seed!r}")
    out["aic_mtp_seed"] = seed
    return out


def parse_rank(raw: dict, path: str = "rank", tensor_parallel_size: int = 1, dp_size: int = 1) -> RankConfig:
    """Validate a reference rank dict and fill the reference's defaults
    (``tensor_parallel_size``, ``dp_size``: the engine's, which an AIC timing config
    must match)."""
    if not isinstance(raw, dict):
        _fail(path, f"must be an object, got {type(raw).__name__}")
    raw = dict(raw)
    if "kv_bytes_per_token" in raw:
        if "kv_transfer_bytes_per_token" in raw:
            _fail(f"{path}.kv_bytes_per_token", "duplicate field (alias of kv_transfer_bytes_per_token)")
        raw["kv_transfer_bytes_per_token"] = raw.pop("kv_bytes_per_token")
    known = {f for f in RankConfig.__dataclass_fields__
             if not f.startswith(("fixed_", "sglang_")) and f not in ("aic", "num_gpu_blocks_estimated")}
    known |= set(_UNSIMULATED) | {"sglang", "trtllm"}
    for key in raw:
        if key not in known:
            _fail(f"{path}.{key}", "unknown field; allowed: " + ", ".join(sorted(known)))
    if raw.get("kv_cache_bytes_per_token") is not None and raw.get("native_host_offload") is None \
            and raw.get("g3_offload") is None:
        # it prices the KV tiers' transfers only: with none, a positive count changes no
        # request (measured: golden_kv_tiers B_plain, and A_plain and S_plain800 given one)
        per_token = raw["kv_cache_bytes_per_token"]
        if isinstance(per_token, bool) or not isinstance(per_token, int) or per_token < 0:
            _fail(f"{path}.kv_cache_bytes_per_token", f"must be a positive integer, got {per_token!r}")
        if per_token == 0:
            _fail(f"{path}.kv_cache_bytes_per_token", "kv_cache_bytes_per_token must be positive")
        raw = {k: v for k, v in raw.items() if k != "kv_cache_bytes_per_token"}
    for key, default in _UNSIMULATED.items():
        if key in raw and raw[key] is not None and raw[key] != default:
            _fail(f"{path}.{key}", f"is not simulated by aisim_fast; only the default {default!r} is accepted")

    out: dict[str, Any] = {}
    backend = _choice(f"{path}.backend", raw.get("backend", "vllm"), BACKENDS)
    if backend not in SIMULATED_BACKENDS:
        _fail(f"{path}.backend", f"{backend!r} is not simulated yet; use one of {', '.join(SIMULATED_BACKENDS)}")
    out["backend"] = backend
    if "num_gpu_blocks" in raw and raw["num_gpu_blocks"] is None:
        _fail(f"{path}.num_gpu_blocks", "explicit null is not allowed; give an integer >= 1")
    out["num_gpu_blocks"] = _int(f"{path}.num_gpu_blocks", raw.get("num_gpu_blocks", 16384), 1)
    # SGLang's page may be a single token; vLLM and TRT-LLM blocks hold 2 at least
    out["block_size"] = _int(f"{path}.block_size", raw.get("block_size", NATIVE_BLOCK_SIZE[backend]),
                             1 if backend == "sglang" else 2)
    out["max_num_seqs"] = _int(f"{path}.max_num_seqs", raw.get("max_num_seqs", 256), 1)
    out["max_num_batched_tokens"] = _int(
        f"{path}.max_num_batched_tokens", raw.get("max_num_batched_tokens", 8192), 1)
    if raw.get("max_model_len") is not None:
        out["max_model_len"] = _int(f"{path}.max_model_len", raw["max_model_len"], 1)
    out["enable_prefix_caching"] = _bool(
        f"{path}.enable_prefix_caching", raw.get("enable_prefix_caching", True))
    for key in ("emit_kv_events", "emit_kv_token_ids"):
        out[key] = _bool(f"{path}.{key}", raw.get(key, False))
    out["enable_chunked_prefill"] = _bool(
        f"{path}.enable_chunked_prefill", raw.get("enable_chunked_prefill", True))
    out["preemption_mode"] = _choice(
        f"{path}.preemption_mode", raw.get("preemption_mode", "lifo"), PREEMPTION_MODES)
    out["speedup_ratio"] = _float(f"{path}.speedup_ratio", raw.get("speedup_ratio", 1.0))
    out["decode_speedup_ratio"] = _float(
        f"{path}.decode_speedup_ratio", raw.get("decode_speedup_ratio", 1.0))
    out["worker_type"] = _choice(f"{path}.worker_type", raw.get("worker_type", "aggregated"), WORKER_TYPES)
    timing = raw.get("timing_model") or {"type": "polynomial"}
    if not isinstance(timing, dict):
        _fail(f"{path}.timing_model", f"must be an object with a 'type', got {timing!r}")
    kind = _choice(f"{path}.timing_model.type", timing.get("type"), TIMING_TYPES)
    allowed = {"fixed": {"type", "prefill_ms", "decode_ms"},
               "external": {"type", "provider", "config"}}.get(kind, {"type"})
    extra = set(timing) - allowed
    if extra:
        _fail(f"{path}.timing_model.{sorted(extra)[0]}", f"unknown field for timing type {kind!r}")
    out["timing_model"] = kind
    if kind == "fixed":
        for key in ("prefill_ms", "decode_ms"):
            if key not in timing:
                _fail(f"{path}.timing_model.{key}", "required for the fixed timing model")
            out[f"fixed_{key}"] = _float(f"{path}.timing_model.{key}", timing[key])
    if kind == "external":
        _choice(f"{path}.timing_model.provider", timing.get("provider"), TIMING_PROVIDERS)
        out["timing_model"] = "aic"
        try:
            out["aic"] = aic.parse_config(timing.get("config"), f"{path}.timing_model.config",
                                          backend=backend, block_size=out["block_size"],
                                          tp=tensor_parallel_size, dp=dp_size)
            if "num_gpu_blocks" not in raw:
                if backend == "sglang":
                    # aiconfigurator-core 0.12.0's SGLang memory model leaves less for KV
                    # than the reference's (Qwen3-32B, tp 2, H200, fraction 0.88: 724,366
                    # tokens against 733,828): a pool sized here is not the reference's
                    _fail(f"{path}.num_gpu_blocks", "an SGLang pool sized from GPU memory is not "
                          "reproduced by aisim_fast (its memory model differs from the reference's "
                          "for SGLang); give num_gpu_blocks (with num_gpu_blocks_is_explicit: true)")
                out["num_gpu_blocks"] = aic.estimate_num_gpu_blocks(
                    out["aic"], out["block_size"], out["max_num_batched_tokens"],
                    f"{path}.timing_model.config")
                out["num_gpu_blocks_estimated"] = True
        except aic.AicError as exc:
            raise ConfigError(str(exc)) from None
    if raw.get("kv_transfer_bandwidth") is not None:
        bw = raw["kv_transfer_bandwidth"]
        if isinstance(bw, (int, float)) and not isinstance(bw, bool) and bw < 0:
            _fail(f"{path}.kv_transfer_bandwidth", f"must be >= 0 (decimal GB/s), got {bw}")
        out["kv_transfer_bandwidth"] = _float(f"{path}.kv_transfer_bandwidth", bw)
    if raw.get("kv_transfer_bytes_per_token") is not None:
        out["kv_transfer_bytes_per_token"] = _int(
            f"{path}.kv_transfer_bytes_per_token", raw["kv_transfer_bytes_per_token"], 1)
    out["kv_transfer_timing_mode"] = _choice(
        f"{path}.kv_transfer_timing_mode", raw.get("kv_transfer_timing_mode", "full_prompt"),
        TRANSFER_MODES)
    trt = raw.get("trtllm")
    if trt is not None:
        if not isinstance(trt, dict) or set(trt) - {"capacity_scheduler_policy"}:
            _fail(f"{path}.trtllm", "only {capacity_scheduler_policy: guaranteed_no_evict} is accepted")
        _choice(f"{path}.trtllm.capacity_scheduler_policy",
                trt.get("capacity_scheduler_policy", "guaranteed_no_evict"), ("guaranteed_no_evict",))
    if raw.get("sglang") is not None and backend != "sglang":
        _fail(f"{path}.sglang", "only valid with backend sglang")
    interval = raw.get("prefill_decode_interval")
    out["prefill_decode_interval"] = 0 if interval is None else _int(
        f"{path}.prefill_decode_interval", interval, 0)
    if out["prefill_decode_interval"] != 0 and backend != "sglang":
        _fail(f"{path}.prefill_decode_interval", f"SGLang only (the reference refuses it for {backend} "
                                                 "unless 0)")
    cadence = raw.get("prefill_schedule_interval")
    out["prefill_schedule_interval"] = 1 if cadence is None else _int(
        f"{path}.prefill_schedule_interval", cadence, 1)
    if out["prefill_schedule_interval"] != 1 and backend != "vllm":
        _fail(f"{path}.prefill_schedule_interval", f"vLLM only (the reference refuses it for {backend} "
                                                   "unless 1" + ("; use prefill_decode_interval"
                                                                 if backend == "sglang" else "") + ")")
    if backend == "sglang":
        out.update(_parse_sglang(raw, path, out))
    out.update(parse_speculation(raw, path, out["decode_speedup_ratio"], backend, dp_size))
    if out.get("aic") is not None and out["aic"].nextn != (out.get("aic_nextn") or 0):
        # (the reference's check: an MTP-priced verify pass is the rank's speculation)
        key = "speculation" if json.loads(dict(out["aic"].cli_fields).get("speculation", "null")) else "nextn"
        _fail(f"{path}.timing_model.config.{key}", f"AIC {'speculative depth' if key == 'speculation' else 'nextn'}"
              f"={out['aic'].nextn} does not match engine aic_nextn={out.get('aic_nextn')}")
    if raw.get("frontend") is not None:
        if backend != "sglang":
            _fail(f"{path}.frontend", "frontend stages are SGLang's (backend sglang)")
        out["frontend"] = parse_frontend(raw["frontend"], f"{path}.frontend")
        if not out["sglang_host_loop"]:
            # (the reference's config words; its core needs the loop the stages feed)
            _fail(f"{path}.frontend", "frontend stages run ahead of the scheduler loop; set "
                  "sglang.host_loop: true")
    return RankConfig(**out)


SGLANG_KEYS = ("schedule_policy", "max_prefill_tokens", "chunked_prefill_size", "clip_max_new_tokens",
               "schedule_conservativeness", "host_loop")


def parse_frontend(raw: Any, path: str) -> tuple:
    """``{"stages": [{"workers", "service_ms", "concurrency_scale"}, ...]}``: the pools a
    request crosses in order before the scheduler's inbox (kernels.sglang.frontend)."""
    if not isinstance(raw, dict) or set(raw) - {"stages"}:
        _fail(path, f"must be an object with stages, got {raw!r}")
    stages = raw.get("stages")
    if not isinstance(stages, list) or not stages:
        _fail(f"{path}.stages", f"must be a list of at least one stage, got {stages!r}")
    out = []
    for i, stage in enumerate(stages):
        where = f"{path}.stages[{i}]"
        if not isinstance(stage, dict):
            _fail(where, f"must be an object, got {stage!r}")
        for key in stage:
            if key not in ("workers", "service_ms", "concurrency_scale"):
                _fail(f"{where}.{key}", "unknown field; allowed: concurrency_scale, service_ms, workers")
        workers = _int(f"{where}.workers", stage.get("workers"), 1)
        service = _float(f"{where}.service_ms", stage.get("service_ms"))
        if not (math.isfinite(service) and service >= 0):
            _fail(f"{where}.service_ms", f"must be finite and >= 0, got {service!r}")
        scale = stage.get("concurrency_scale") or []
        if not isinstance(scale, list):
            _fail(f"{where}.concurrency_scale", f"must be a list of numbers, got {scale!r}")
        values = []
        for j, x in enumerate(scale):
            v = _float(f"{where}.concurrency_scale[{j}]", x)
            if not (math.isfinite(v) and v > 0):
                _fail(f"{where}.concurrency_scale[{j}]", f"must be finite and > 0, got {x!r}")
            values.append(v)
        out.append((workers, service, tuple(values)))
    return tuple(out)


def _parse_sglang(raw: dict, path: str, out: dict) -> dict:
    """The ``sglang`` block of an SGLang rank, checked as the reference checks it."""
    if not out["enable_chunked_prefill"]:
        _fail(f"{path}.enable_chunked_prefill", "SGLang requires chunked prefill (true)")
    sg = raw.get("sglang") or {}
    if not isinstance(sg, dict):
        _fail(f"{path}.sglang", f"must be an object, got {type(sg).__name__}")
    for key in sg:
        if key not in SGLANG_KEYS:
            _fail(f"{path}.sglang.{key}", "unknown or not simulated field; allowed: " + ", ".join(SGLANG_KEYS))
    policy = sg.get("schedule_policy", "fifo")
    if policy == "fcfs":
        policy = "fifo"
    policy = _choice(f"{path}.sglang.schedule_policy", policy, ("fifo", "lpm"))
    res = {"sglang_schedule_policy": policy}
    for key, default in (("max_prefill_tokens", 16384), ("chunked_prefill_size", 8192),
                         ("clip_max_new_tokens", 4096)):
        value = sg.get(key, default)
        res[f"sglang_{key}"] = _int(f"{path}.sglang.{key}", value, 1)
    if res["sglang_chunked_prefill_size"] % out["block_size"] != 0:
        _fail(f"{path}.sglang.chunked_prefill_size",
              f"must be divisible by block_size ({out['block_size']}), as the reference requires")
    cons = _float(f"{path}.sglang.schedule_conservativeness", sg.get("schedule_conservativeness", 1.0))
    if not (cons >= 0.0 and cons != float("inf")):
        _fail(f"{path}.sglang.schedule_conservativeness", f"must be finite and >= 0, got {cons}")
    res["sglang_schedule_conservativeness"] = cons
    res["sglang_host_loop"] = _bool(f"{path}.sglang.host_loop", sg.get("host_loop", False))
    return res


@dataclass(frozen=True)
class RouterConfig:
    """Knobs of the ``kv_router`` placement (Dynamo's names and defaults)."""
    overlap_score_credit: float = 1.0
    prefill_load_scale: float = 1.0
    router_temperature: float = 0.0
    pin_to_trace_worker: bool = False  # place on each trace row's ``worker``; costs still logged


ROUTER_KEYS = ("overlap_score_credit", "prefill_load_scale", "router_temperature", "seed",
               "pin_to_trace_worker")


@dataclass(frozen=True)
class TokenizationConfig:
    """The payload's ``tokenization``: a pool of ``workers`` servers ahead of each
    worker's scheduler, ``base_ms + per_input_token_ms * prompt tokens`` per request
    (kernels.loop.tokenization)."""
    workers: int = 1
    base_ms: float = 0.0
    per_input_token_ms: float = 0.0


_TOKENIZATION_KEYS = ("workers", "base_ms", "per_input_token_ms")


def parse_tokenization(raw: Any, path: str = "tokenization") -> TokenizationConfig | None:
    """The payload's top-level ``tokenization``; None for null (no pool)."""
    if raw is None:
        return None
    tok = _obj(path, raw)
    for key in tok:
        if key not in _TOKENIZATION_KEYS:
            _fail(f"{path}.{key}", "unknown field; allowed: " + ", ".join(_TOKENIZATION_KEYS))
    return TokenizationConfig(workers=_int(f"{path}.workers", tok.get("workers", 1), 1),
                              base_ms=_float(f"{path}.base_ms", tok.get("base_ms", 0.0)),
                              per_input_token_ms=_float(f"{path}.per_input_token_ms",
                                                        tok.get("per_input_token_ms", 0.0)))


def check_tokenization(tok: TokenizationConfig, path: str, *, placement: str) -> None:
    """The combinations the tokenization pool is simulated in (checked against the
    reference: aggregated workers, or the prefill workers of a disaggregated run, each
    with a pool of its own shared by its attention-DP ranks, placed at arrival; the
    reference runs no kv_router placement to check a pool against)."""
    if placement == "kv_router":
        _fail(path, "a tokenization pool with kv_router placement is not simulated yet")


@dataclass(frozen=True)
class ReplaySetup:
    """One replay: topology, rank config, and the traffic to drive it."""
    rank: RankConfig
    workers: int
    trace_path: str
    trace_block_size: int = 512
    trace_format: str = "mooncake"       # one of trace.formats.ALL_TRACE_FORMATS
    more_trace_paths: tuple = ()         # a multi-file format's files after trace_path (dynamo)
    arrival_speedup_ratio: float = 1.0
    concurrency: int = 0                 # closed-loop session cap; 0 = trace timestamps
    sla: dict = field(default_factory=dict)
    tensor_parallel_size: int = 1        # GPUs per rank in the GPU-hour accounting
    dp_size: int = 1                     # attention-DP ranks per worker (kernels.dp.attention_dp)
    # Disaggregated topology: ``rank``/``workers``/``tensor_parallel_size`` describe
    # the decode pool and these the prefill pool; prefill_workers 0 = aggregated.
    prefill_rank: RankConfig | None = None
    prefill_workers: int = 0
    prefill_tensor_parallel_size: int = 1
    prefill_dp_size: int = 1             # attention-DP ranks per prefill worker
    handoff_latency_ms: float = 0.0      # transfer delay when the timing model is incomplete
    placement: str = "round_robin"       # one of PLACEMENTS
    placement_seed: int = 0              # generator seed of the random placement / router ties
    router: RouterConfig | None = None   # placement kv_router
    # simulated-time cap (spec replay.md 12.11): the run stops after the last instant at
    # or before it; requests unfinished then have no record. None = run to the end
    max_sim_time_ms: float | None = None
    # the payload's top-level tokenization pool (kernels.loop.tokenization); None = none
    tokenization: TokenizationConfig | None = None
    # requests given inline (spec.requests) in place of a trace (trace_path ""); None = a trace
    requests: tuple | None = None
    # a synthetic load (traffic.source_type synthetic) in place of a trace (trace_path "")
    synthetic: SyntheticLoad | None = None
    # the payload's capture_performance_diagnostics: the summary's performance_diagnostics
    # (per op latency and speed of light, aic.performance_diagnostics)
    capture_performance_diagnostics: bool = False
    # agentic_mooncake: plays run this many at a time (trace.agentic_graph); None = all at once
    agentic_lanes: int | None = None
    # weka: how nested subagent times read (trace.weka; auto: as the corpus shows)
    weka_basis: str = "auto"
    # agentic_snapshot's seed: each lane replays one play cut at a seeded instant
    # (trace.agentic_snapshot); None = the whole graph
    agentic_snapshot_seed: int | None = None
    # the model an agentic trace's requests are projected to (traffic.execution_model)
    execution_model: str | None = None
    # the trace path as the payload names it (an agentic legacy trace's provenance digest)
    trace_named: str = ""
    # (field, reason) of what the run refuses once its trace is read and agentic (an
    # agentic_mooncake or Weka trace always, a Dynamo trace as its records say), in the
    # reference's order: the reference reads and cuts the graph first, so a snapshot's
    # boundary error comes before these (check_agentic_trace)
    agentic_refusals: tuple = ()

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0

    @property
    def beyond_reference(self) -> list[str]:
        """What this run asks for that the reference does not simulate (empty for a
        reference-compatible run); a run's summary lists it."""
        out = []
        if self.from_trace_file and self.trace_format not in TRACE_FORMATS:
            out.append(f"trace_format {self.trace_format} (the reference reads {', '.join(TRACE_FORMATS)} "
                       "and its agentic formats)")
        return out

    @property
    def from_trace_file(self) -> bool:
        """Its requests come from a trace file (not inline, not a synthetic load)."""
        return self.requests is None and self.synthetic is None

    @property
    def gpus_per_worker(self) -> int:
        """GPUs of one worker of the aggregated or decode pool: tensor parallelism x
        attention-DP ranks (the reference's ``aic_gpus_per_worker``)."""
        return self.tensor_parallel_size * self.dp_size

    @property
    def prefill_gpus_per_worker(self) -> int:
        """GPUs of one prefill worker (disaggregated): its tensor parallelism x ranks."""
        return self.prefill_tensor_parallel_size * self.prefill_dp_size

    @property
    def pools(self) -> list[tuple[str, RankConfig]]:
        """(role, rank) of each pool: the aggregated one, or decode then prefill."""
        if self.disaggregated:
            return [("decode", self.rank), ("prefill", self.prefill_rank)]
        return [("aggregated", self.rank)]

    def to_json(self) -> dict:
        d = asdict(self)
        d["rank"] = self.rank.to_json()
        if self.requests is not None:  # their count, not their token ids
            d["requests"] = {"inline": len(self.requests)}
        if self.prefill_rank is not None:
            d["prefill_rank"] = self.prefill_rank.to_json()
        return d


_SYNTHETIC_KEYS = {"source_type", "load_type", "isl", "osl", "cached_prefix_tokens", "concurrency",
                   "replay_concurrency", "request_count", "num_request_ratio", "arrival_interval_ms",
                   "request_rate", "arrival_seed", "trace_block_size", "max_sim_time_ms", "kv_load_ratio",
                   "turns_per_session", "shared_prefix_ratio", "num_prefix_groups", "inter_turn_delay_ms"}


def parse_synthetic(traffic: dict, pool_kv_tokens: int) -> tuple[SyntheticLoad, int]:
    """``traffic`` of ``source_type: synthetic`` or ``synthetic-session``: the load and
    the closed-loop concurrency it runs under (0 for an open-loop rate).
    ``pool_kv_tokens``: the KV tokens of the pool that generates (every rank of the
    aggregated or decode pool), which a ``kv_capacity_fraction`` load is sized from."""
    for key in traffic:
        if key not in _SYNTHETIC_KEYS:
            _fail(f"traffic.{key}", "unknown or unsupported field of a synthetic load; allowed: "
                  + ", ".join(sorted(_SYNTHETIC_KEYS)))
    source = traffic["source_type"]
    load = _choice("traffic.load_type", traffic.get("load_type"), SYNTHETIC_LOAD_TYPES)
    isl = _int("traffic.isl", traffic.get("isl"), 1)
    osl = _int("traffic.osl", traffic.get("osl"), 1)
    cached = _int("traffic.cached_prefix_tokens", traffic.get("cached_prefix_tokens", 0), 0)
    if cached > isl:
        _fail("traffic.cached_prefix_tokens", f"must be <= isl ({isl}), got {cached}")
    sessions: dict[str, Any] = {"source_type": source}
    if source == "synthetic-session":
        sessions["turns_per_session"] = _int("traffic.turns_per_session", traffic.get("turns_per_session", 4), 1)
    elif traffic.get("turns_per_session") not in (None, 1):
        _warn("traffic.turns_per_session", "a 'synthetic' source has one turn per request (the reference "
              "ignores turns_per_session there too); use source_type 'synthetic-session' for sessions")
    share = _float("traffic.shared_prefix_ratio", traffic.get("shared_prefix_ratio", 0.0))
    if not 0.0 <= share <= 1.0:
        _fail("traffic.shared_prefix_ratio", f"must be within [0, 1], got {traffic.get('shared_prefix_ratio')!r}")
    sessions["shared_prefix_ratio"] = share
    sessions["num_prefix_groups"] = _int("traffic.num_prefix_groups", traffic.get("num_prefix_groups", 0), 0)
    if sessions["num_prefix_groups"] >= 1 << 32:
        _fail("traffic.num_prefix_groups", f"must be < 2**32, got {sessions['num_prefix_groups']}")
    delay = _float("traffic.inter_turn_delay_ms", traffic.get("inter_turn_delay_ms", 0.0))
    if not (math.isfinite(delay) and delay >= 0):
        _fail("traffic.inter_turn_delay_ms", f"must be a finite number >= 0, got {traffic.get('inter_turn_delay_ms')!r}")
    sessions["inter_turn_delay_ms"] = delay
    concurrency = 0
    extra: dict[str, Any] = {}
    if load == "concurrency":
        concurrency = _int("traffic.concurrency",
                           traffic.get("concurrency", traffic.get("replay_concurrency")), 1)
        extra["concurrency"] = concurrency
        load_unit = float(concurrency)
    elif load == "kv_capacity_fraction":
        # the reference refuses 0 too ("KV load ratio must be positive")
        ratio = _positive_float("traffic.kv_load_ratio", traffic.get("kv_load_ratio"))
        concurrency = kv_fraction_concurrency(ratio, isl, osl, pool_kv_tokens)
        extra.update(concurrency=concurrency, kv_load_ratio=ratio)
        load_unit = float(concurrency)
    elif load == "constant_rate":
        extra["arrival_interval_ms"] = _positive_float("traffic.arrival_interval_ms",
                                                       traffic.get("arrival_interval_ms"))
        load_unit = 1000.0 / extra["arrival_interval_ms"]
    else:
        extra["request_rate"] = _positive_float("traffic.request_rate", traffic.get("request_rate"))
        extra["arrival_seed"] = _int("traffic.arrival_seed", traffic.get("arrival_seed", 42), 0)
        load_unit = extra["request_rate"]
    count = traffic.get("request_count")
    ratio = traffic.get("num_request_ratio")
    if count is not None:
        count = _int("traffic.request_count", count, 1)
    elif ratio is not None:
        # the reference's per-load-unit count: the ratio times the load (concurrency, or
        # requests per second), rounded half away from zero (Rust's f64::round: 2.5 x 21
        # -> 53, where Python's gives 52)
        count = max(1, math.floor(_positive_float("traffic.num_request_ratio", ratio) * load_unit + 0.5))
    else:
        _fail("traffic.request_count", "required (or num_request_ratio)")
    return SyntheticLoad(load_type=load, request_count=count, isl=isl, osl=osl,
                         cached_prefix_tokens=cached, **extra, **sessions), concurrency


def kv_fraction_concurrency(ratio: float, isl: int, osl: int, pool_kv_tokens: int) -> int:
    """The closed-loop concurrency of a ``kv_capacity_fraction`` load: ``ratio`` of the
    requests the pool's KV holds at once, a request counted at its prompt and half its
    output (``isl + osl // 2`` tokens); at least 1."""
    capacity = pool_kv_tokens // (isl + osl // 2)
    return max(1, math.floor(ratio * capacity))


def check_disaggregated_pair(prefill: RankConfig, decode: RankConfig, path: str) -> None:
    """Both pools must run the same backend (the handoff order is per backend), and
    neither the SGLang host loop (the reference runs it on aggregated ranks only)."""
    for role, rank in (("prefill", prefill), ("decode", decode)):
        if rank.sglang_host_loop:
            _fail(f"{path.rsplit('.', 2)[0]}.{role}.rank.sglang.host_loop", "sglang.host_loop is supported only for "
                  "aggregated ranks (the reference refuses it for prefill and decode ranks)")
    if prefill.backend != decode.backend:
        _fail(f"{path}.backend", f"prefill and decode backends must match; got prefill "
                                 f"{prefill.backend!r} and decode {decode.backend!r}")


KV_EVICTION_POLICIES = ("lru", "belady")  # the reference's spec.engine.kv_eviction_policy
_PAYLOAD_KEYS = {"spec", "traffic", "determinism", "tokenization", "capture_performance_diagnostics"}
DETERMINISM_MODES = ("canonical_v1", "random")
_TOPOLOGY_KEYS = ("kind", "workers", "prefill", "decode", "handoff_latency_ms")
_SPEC_KEYS = {"version", "topology", "engine", "adapters", "max_sim_time_ms", "max_in_flight",
              "record_per_request", "sla", "encoder", "requests"}
# the agentic replay controls (traffic.agentic_*; trace.agentic_graph)
AGENTIC_TRAFFIC_KEYS = ("agentic_lanes", "agentic_snapshot", "agentic_warmup", "agentic_warmup_policy",
                        "agentic_profile")
_TRAFFIC_KEYS = {"source_type", "load_type", "trace_path", "trace_paths", "trace_format",
                 "trace_block_size", "arrival_speedup_ratio", "replay_concurrency", "concurrency",
                 "max_sim_time_ms",
                 # the model the reference's runner names for dynamo / agentic traces; its
                 # standard-trace replay reads it nowhere (no row is filtered by it)
                 "execution_model",
                 # agentic replay (trace.agentic_graph)
                 *AGENTIC_TRAFFIC_KEYS,
                 # weka (trace.weka): nested subagent times; the reference's graph cache, which
                 # changes no result
                 "weka_nested_timestamp_basis", "trace_graph_cache"}


def parse_payload(payload: dict, base_dir: str | Path = ".", trace_override: str | None = None
                  ) -> ReplaySetup:
    """Lower a reference execution payload (``{"spec", "traffic", ...}``) to a setup.

    A relative ``traffic.trace_path`` resolves against ``base_dir`` (the spec file's
    folder); ``trace_override`` replaces it."""
    if not isinstance(payload, dict) or "spec" not in payload:
        _fail("payload", "must be an object with 'spec' and 'traffic'")
    for key in payload:
        if key not in _PAYLOAD_KEYS:
            _fail(key, "unknown field of the payload; allowed: " + ", ".join(sorted(_PAYLOAD_KEYS)))
    # the reference's modes; request ids are the canonical ordinals in both (random
    # would give fresh v4 uuids there: rows still join on session and turn)
    if _choice("determinism", payload.get("determinism", "canonical_v1"), DETERMINISM_MODES) == "random":
        _warn("determinism", "'random' runs as canonical_v1: the same requests and times (the "
                             "reference's replay gives the same rows too; only its request ids differ)")
    capture = _bool("capture_performance_diagnostics", payload.get("capture_performance_diagnostics", False))
    spec = _obj("spec", payload["spec"])
    for key in spec:
        if key not in _SPEC_KEYS:
            _fail(f"spec.{key}", "unknown field; allowed: " + ", ".join(sorted(_SPEC_KEYS)))
    if spec.get("version", 1) != 1:
        _fail("spec.version", f"must be 1, got {spec.get('version')!r}")
    topo = _obj("spec.topology", spec.get("topology"))
    kind = _choice("spec.topology.kind", topo.get("kind"), ("aggregated", "disaggregated"))
    if spec.get("engine") is None:
        _fail("spec.engine", "required (the rank config: {\"rank\": {\"backend\": ...}})")
    engine = dict(_obj("spec.engine", spec.get("engine")))
    # the KV cache's eviction order: the reference's default LRU (what every pool here
    # runs); its Belady oracle is not simulated
    eviction = _choice("spec.engine.kv_eviction_policy", engine.pop("kv_eviction_policy", "lru"),
                       KV_EVICTION_POLICIES)
    if eviction != "lru":
        _fail("spec.engine.kv_eviction_policy", f"{eviction!r} (evicting the block used farthest in the future) "
                                                "is not simulated yet; 'lru' (the default) is")
    for key in engine:
        if key not in _ENGINE_POOL_KEYS + ("prefill", "decode"):
            _fail(f"spec.engine.{key}", "unknown field; allowed: "
                                        + ", ".join(sorted(_ENGINE_POOL_KEYS + ("prefill", "decode", "kv_eviction_policy"))))
    own = ("kind", "workers") if kind == "aggregated" else ("kind", "prefill", "decode", "handoff_latency_ms")
    for key in topo:
        if key in _TOPOLOGY_KEYS and key not in own:
            _fail(f"spec.topology.{key}", f"unknown field for {'an' if kind == 'aggregated' else 'a'} {kind} "
                                          f"topology; allowed: {', '.join(own)}")
        if key not in _TOPOLOGY_KEYS:
            _warn(f"spec.topology.{key}", f"unknown field, ignored (the reference ignores it too); "
                                          f"{kind} topologies take {', '.join(own)}")
    disagg: dict[str, Any] = {}
    if kind == "aggregated":
        for role in ("prefill", "decode"):
            if engine.get(role) is not None:
                _fail(f"spec.engine.{role}", "only for a disaggregated topology (kind: disaggregated)")
        workers = _pool_workers("spec.topology.workers", topo.get("workers"))
        rank, tp, dp = _engine_pool("spec.engine", engine, "aggregated")
    else:
        workers = _pool_workers("spec.topology.decode", topo.get("decode"))
        # a role without its own block runs the engine's top-level pool fields, as the
        # reference does (aggregated_role of the engine config)
        top = {k: v for k, v in engine.items() if k not in ("prefill", "decode")}
        # the prefill pool first: the reference sizes (and refuses) it before the decode pool
        prefill_path, prefill_block = _role_block(engine, top, "prefill")
        prefill_rank, prefill_tp, prefill_dp = _engine_pool(prefill_path, prefill_block, "prefill")
        rank, tp, dp = _engine_pool(*_role_block(engine, top, "decode"), "decode")
        if prefill_rank.kv_transfer_bandwidth is not None and prefill_rank.kv_transfer_bytes_per_token is None:
            # the transfer is timed by the prefill side's model: the reference refuses
            # a bandwidth it could not use (and does not fall back to the latency)
            _fail(f"{prefill_path}.rank.kv_transfer_bandwidth",
                  "kv_transfer_bandwidth requires kv_transfer_bytes_per_token on prefill workers")
        check_disaggregated_pair(prefill_rank, rank, "spec.engine.decode.rank")
        disagg = dict(
            prefill_rank=prefill_rank,
            prefill_workers=_pool_workers("spec.topology.prefill", topo.get("prefill")),
            prefill_tensor_parallel_size=prefill_tp,
            prefill_dp_size=prefill_dp,
            handoff_latency_ms=_float("spec.topology.handoff_latency_ms",
                                      topo.get("handoff_latency_ms", 0.0)),
        )
    adapters = _obj("spec.adapters", spec.get("adapters"))
    placement, placement_seed, router = parse_placement(adapters.get("placement"), "spec.adapters.placement")
    max_sim_time_ms = None
    if spec.get("max_sim_time_ms") is not None:
        max_sim_time_ms = _float("spec.max_sim_time_ms", spec["max_sim_time_ms"])
    if spec.get("encoder") is not None:
        _fail("spec.encoder", "encoder pools (EPD, vision encoders) are not simulated; only null is accepted")
    inline = None
    if spec.get("requests"):
        # the reference's runner sends a workload given as a list of requests inline
        if payload.get("traffic") is not None:
            _fail("spec.requests", "give inline requests or a traffic source, not both")
        if trace_override is not None:
            _fail("spec.requests", "the payload's requests are inline: a trace cannot replace them")
        try:
            inline = parse_inline_requests(spec["requests"], "spec.requests")
        except InlineRequestError as exc:
            raise ConfigError(str(exc)) from None
        arrivals = [r.arrival_ms for r in inline]
        if arrivals != sorted(arrivals):
            _warn("spec.requests", "not in arrival order: request uuids are numbered in arrival order "
                  "here, in list order by the reference (the timelines are the same); run so")
    elif spec.get("requests") is not None and not isinstance(spec["requests"], list):
        _fail("spec.requests", f"must be a list of requests, got {spec['requests']!r}")
    max_in_flight = spec.get("max_in_flight")
    sla = _obj("spec.sla", spec.get("sla"))
    for key, value in sla.items():
        _choice("spec.sla key", key, ("ttft_ms", "itl_ms", "e2e_ms"))
        if value is not None and _float(f"spec.sla.{key}", value) <= 0:
            _fail(f"spec.sla.{key}", "must be > 0")
    if "e2e_ms" in sla and ("ttft_ms" in sla or "itl_ms" in sla):
        _fail("spec.sla", "e2e_ms is mutually exclusive with ttft_ms / itl_ms")

    if inline is not None:
        if max_in_flight is not None:
            _fail("spec.max_in_flight", "a cap on inline requests in flight is not simulated yet")
        tokenization = parse_tokenization(payload.get("tokenization"))
        if tokenization is not None:
            check_tokenization(tokenization, "tokenization", placement=placement)
        return ReplaySetup(rank=rank, workers=workers, trace_path="", requests=inline,
                           sla={k: float(v) for k, v in sla.items() if v is not None},
                           tensor_parallel_size=tp, dp_size=dp, placement=placement,
                           placement_seed=placement_seed, router=router,
                           max_sim_time_ms=max_sim_time_ms, tokenization=tokenization,
                           capture_performance_diagnostics=capture, **disagg)
    traffic = _obj("traffic", payload.get("traffic"))
    tokenization = parse_tokenization(payload.get("tokenization"))
    if tokenization is not None:
        check_tokenization(tokenization, "tokenization", placement=placement)
    if traffic.get("source_type") in ("synthetic", "synthetic-session"):
        load, concurrency = parse_synthetic(
            traffic, rank.num_gpu_blocks * rank.block_size * dp * workers)
        traffic_cap = traffic.get("max_sim_time_ms")
        if traffic_cap is not None and _float("traffic.max_sim_time_ms", traffic_cap) != max_sim_time_ms:
            _fail("traffic.max_sim_time_ms", "a cap on a synthetic load's generation apart from "
                  f"spec.max_sim_time_ms ({max_sim_time_ms}) is not simulated; got {traffic_cap!r}")
        _ignored_in_flight_cap(max_in_flight, concurrency, "the load's concurrency")
        return ReplaySetup(rank=rank, workers=workers, trace_path="", synthetic=load,
                           concurrency=concurrency,
                           sla={k: float(v) for k, v in sla.items() if v is not None},
                           tensor_parallel_size=tp, dp_size=dp, placement=placement,
                           placement_seed=placement_seed, router=router,
                           max_sim_time_ms=max_sim_time_ms, tokenization=tokenization,
                           capture_performance_diagnostics=capture, **disagg)
    for key in traffic:
        if key not in _TRAFFIC_KEYS:
            _fail(f"traffic.{key}", "unknown or unsupported field; allowed: " + ", ".join(sorted(_TRAFFIC_KEYS)))
    _choice("traffic.source_type", traffic.get("source_type", "trace"), ("trace", "synthetic"))
    # the public CSVs (azure, burstgpt) are beyond the reference: ReplaySetup.beyond_reference
    trace_format = _choice("traffic.trace_format", traffic.get("trace_format", "mooncake"), ALL_TRACE_FORMATS)
    load = _choice("traffic.load_type", traffic.get("load_type", "trace_timestamps"),
                   ("trace_timestamps", "concurrency"))
    conc = traffic.get("replay_concurrency", traffic.get("concurrency"))
    concurrency = 0
    if conc is not None:
        concurrency = _int("traffic.replay_concurrency", conc, 1)
    elif load == "concurrency":
        # the reference's core then replays the trace open loop, every session at its
        # start, no cap (measured: an applied_compute_agentic payload without it)
        _warn("traffic.replay_concurrency", "missing with load_type 'concurrency': the reference replays the "
              "trace's own arrivals without a cap then; run so (give replay_concurrency N for a closed loop)")
    _ignored_in_flight_cap(max_in_flight, concurrency, "replay_concurrency")
    # the warm-up and profile keys come first to the reference (before the trace and the
    # snapshot's lanes); a valid one is refused once the snapshot is checked
    warmup_or_profile = _warmup_and_profile(traffic, max_sim_time_ms)
    agentic_lanes = _agentic_traffic(traffic, trace_format, load, concurrency, traffic.get("trace_paths"))
    snapshot_seed = _agentic_snapshot(traffic.get("agentic_snapshot"), agentic_lanes)
    if warmup_or_profile:
        _fail("traffic.agentic_warmup" if traffic.get("agentic_warmup") else "traffic.agentic_profile",
              "agentic warm-up and profiles are not simulated yet; replay the trace without them "
              "(agentic_lanes, agentic_snapshot and plain replay are)")
    prefill_rank = disagg.get("prefill_rank")
    trtllm = "trtllm" in (rank.backend, prefill_rank.backend if prefill_rank is not None else None)
    weka_basis = traffic.get("weka_nested_timestamp_basis")
    if weka_basis is not None and trace_format != "weka":
        _fail("traffic.weka_nested_timestamp_basis", "weka_nested_timestamp_basis requires Weka input")
    weka_basis = _choice("traffic.weka_nested_timestamp_basis", "auto" if weka_basis is None else weka_basis,
                         ("auto", "absolute", "relative"))
    if not isinstance(traffic.get("trace_graph_cache", False), bool):
        _fail("traffic.trace_graph_cache", f"must be true or false, got {traffic['trace_graph_cache']!r}")
    agentic_refusals = ()
    if trace_format in ("agentic_mooncake", "weka") and trtllm:
        agentic_refusals = (("spec.engine.rank.backend", "agentic replay supports only vLLM and SGLang backends"),)
    if trace_format == "dynamo":
        agentic_refusals = tuple(
            (key, reason) for key, reason, refused in (
                ("traffic.execution_model", "agentic execution requires a configured target model",
                 not traffic.get("execution_model")),
                ("traffic.replay_concurrency", "agentic Dynamo trace does not support concurrency load",
                 bool(concurrency) or load == "concurrency"),
                ("traffic.max_sim_time_ms", "agentic Dynamo trace does not support max virtual time",
                 traffic.get("max_sim_time_ms") is not None),
                ("spec.engine.rank.backend", "agentic replay supports only vLLM and SGLang backends", trtllm))
            if refused)
    if traffic.get("max_sim_time_ms") is not None:
        # the reference's CLI writes the cap into traffic and spec both; a trace replay
        # stops at the spec's (traffic's bounds generated load only)
        traffic_cap = _float("traffic.max_sim_time_ms", traffic["max_sim_time_ms"])
        if traffic_cap < 0:
            _fail("traffic.max_sim_time_ms", f"must be >= 0, got {traffic_cap!r}")
        if traffic_cap != max_sim_time_ms:
            _warn("traffic.max_sim_time_ms", "does not stop a trace replay (the reference stops it at "
                  f"spec.max_sim_time_ms, here {max_sim_time_ms}); run so")
    paths = traffic.get("trace_paths")
    if paths is not None:
        # the reference replays trace_paths when given (trace_path is its first entry)
        if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            _fail("traffic.trace_paths", f"must be a list of file paths, got {paths!r}")
        if len(paths) > 1 and trace_format not in MULTI_FILE_FORMATS:
            _fail("traffic.trace_paths", f"trace format {trace_format!r} takes one file, got {len(paths)} "
                                         f"(several: {', '.join(MULTI_FILE_FORMATS)})")
    trace = trace_override or (paths[0] if paths else None) or traffic.get("trace_path")
    if not trace:
        _fail("traffic.trace_path", "required (or pass --trace)")

    def found(name: str) -> str:
        where = Path(name)
        if trace_override is None and not where.is_absolute():
            beside = Path(base_dir) / where
            # the reference opens a relative path from the working directory (where its
            # CLI wrote the payload); next to the spec first, then there
            if beside.exists() or not where.exists():
                where = beside
        return str(where)
    trace_path = Path(trace) if trace_override is not None else Path(found(trace))
    more_paths = tuple(found(p) for p in paths[1:]) if paths and trace_override is None else ()
    # dynamo and weka traces carry their own block size: a payload's must match it (0: none given)
    block_default = 0 if trace_format in ("dynamo", "weka") else 512
    return ReplaySetup(
        rank=rank,
        workers=workers,
        trace_path=str(trace_path),
        trace_block_size=_int("traffic.trace_block_size", traffic.get("trace_block_size", block_default),
                              1 if block_default else 0),
        trace_format=trace_format,
        more_trace_paths=more_paths,
        arrival_speedup_ratio=_positive_float("traffic.arrival_speedup_ratio",
                                              traffic.get("arrival_speedup_ratio", 1.0)),
        concurrency=concurrency,
        sla={k: float(v) for k, v in sla.items() if v is not None},
        tensor_parallel_size=tp,
        dp_size=dp,
        placement=placement,
        placement_seed=placement_seed,
        router=router,
        max_sim_time_ms=max_sim_time_ms,
        tokenization=tokenization,
        capture_performance_diagnostics=capture,
        agentic_lanes=agentic_lanes,
        agentic_snapshot_seed=snapshot_seed,
        weka_basis=weka_basis,
        execution_model=traffic.get("execution_model"),
        trace_named=str(trace),
        agentic_refusals=agentic_refusals,
        **disagg,
    )


def check_agentic_trace(setup: ReplaySetup) -> None:
    """Refuse, in the reference's words, what a setup cannot run now that its trace is
    read and agentic (a Dynamo trace: every request with ``agent_context``)."""
    if setup.agentic_refusals:
        _fail(*setup.agentic_refusals[0])


# agentic_profile's options in the reference's field order: (name, default, zero allowed)
PROFILE_OPTIONS = (("duration_seconds", 3600.0, False), ("response_grace_seconds", 30.0, True),
                   ("cancel_drain_seconds", 10.0, True), ("tree_idle_cap_seconds", 300.0, False),
                   ("global_idle_cap_seconds", 10.0, False))
WARMUP_POLICIES = ("repeated_prefixes", "live_trajectory_v1")


def _warmup_and_profile(traffic: dict, max_sim_time_ms) -> bool:
    """``agentic_warmup``, ``agentic_warmup_policy`` and ``agentic_profile`` checked in
    the reference's order and words (before the trace is read); True when the payload
    asks for a warm-up or a profile."""
    warmup = traffic.get("agentic_warmup", False)
    if not isinstance(warmup, bool):
        _fail("traffic.agentic_warmup", f"must be true or false, got {warmup!r}")
    policy = _choice("traffic.agentic_warmup_policy", traffic.get("agentic_warmup_policy", WARMUP_POLICIES[0]),
                     WARMUP_POLICIES)
    profile = traffic.get("agentic_profile")
    if profile is not None and max_sim_time_ms is not None:
        _fail("spec.max_sim_time_ms", "agentic_profile cannot be combined with ReplaySpec.max_sim_time_ms")
    if policy == "live_trajectory_v1" and (not warmup or profile is None):
        _fail("traffic.agentic_warmup_policy", "live_trajectory_v1 requires agentic_warmup and agentic_profile")
    if profile is not None:
        if isinstance(profile, list):  # the reference also reads the options positionally
            if len(profile) > len(PROFILE_OPTIONS):
                _fail("traffic.agentic_profile", f"takes at most {len(PROFILE_OPTIONS)} values, got {len(profile)}")
            profile = {name: v for (name, _, _), v in zip(PROFILE_OPTIONS, profile)}
        profile = _obj("traffic.agentic_profile", profile)
        names = [name for name, _, _ in PROFILE_OPTIONS]
        for key in profile:
            if key not in names:
                _fail(f"traffic.agentic_profile.{key}", "unknown field; allowed: " + ", ".join(names))
        values = []
        for name, default, zero_ok in PROFILE_OPTIONS:
            value = profile.get(name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(f"traffic.agentic_profile.{name}", f"must be a number of seconds, got {value!r}")
            value = float(value)
            if not math.isfinite(value * 1000.0) or value < 0 or (value == 0 and not zero_ok):
                _fail(f"traffic.agentic_profile.{name}", f"agentic_profile.{name} must be finite and "
                                                          + ("non-negative" if zero_ok else "positive"))
            values.append(value)
        if not math.isfinite((values[0] + values[1] + values[2]) * 1000.0):
            _fail("traffic.agentic_profile", "agentic_profile deadlines overflow")
        if traffic.get("agentic_snapshot") is None:
            _fail("traffic.agentic_profile", "agentic_profile requires agentic_snapshot")
    if warmup and traffic.get("agentic_snapshot") is None:
        _fail("traffic.agentic_warmup", "agentic_warmup requires agentic_snapshot")
    return warmup or profile is not None


def _agentic_traffic(traffic: dict, trace_format: str, load: str, concurrency: int, paths) -> int | None:
    """The agentic keys of a trace payload, checked in the reference's order and words;
    returns ``agentic_lanes`` (None: plays all at once)."""
    lanes = traffic.get("agentic_lanes")
    if lanes is not None and trace_format not in ("agentic_mooncake", "dynamo", "weka"):
        _fail("traffic.agentic_lanes", "agentic_lanes requires weka, agentic_mooncake, or agentic Dynamo input"
              f" (trace_format is {trace_format!r})")
    if trace_format == "dynamo":  # the rest is checked once the trace is read (check_agentic_trace)
        return _lanes(lanes)
    if trace_format not in ("agentic_mooncake", "weka"):
        for key in AGENTIC_TRAFFIC_KEYS[1:]:
            if traffic.get(key) is not None:
                _fail(f"traffic.{key}", "applies to agentic traces (trace_format agentic_mooncake, weka, or dynamo)")
        return None
    weka = trace_format == "weka"
    if not traffic.get("execution_model"):
        _fail("traffic.execution_model", "agentic execution requires a configured target model")
    if load != "trace_timestamps":
        _fail("traffic.load_type", f"{trace_format} requires trace_timestamps load")
    if traffic.get("max_sim_time_ms") is not None:
        _fail("traffic.max_sim_time_ms", ("Weka agentic" if weka else "agentic") + " trace does not support max "
                                         "virtual time")
    if paths is not None and len(paths) != 1:
        _fail("traffic.trace_paths", f"{trace_format} requires exactly one path")
    if concurrency:
        _fail("traffic.replay_concurrency", "Weka agentic trace does not support concurrency load" if weka else
              "agentic_mooncake does not support concurrency load")
    return _lanes(lanes)


def _lanes(lanes) -> int | None:
    """``agentic_lanes`` checked (None: plays all at once)."""
    if lanes is None:
        return None
    lanes = _int("traffic.agentic_lanes", lanes, 0)
    if lanes == 0:
        _fail("traffic.agentic_lanes", "agentic_lanes must be greater than 0")
    return lanes


def _agentic_snapshot(raw, lanes: int | None) -> int | None:
    """``traffic.agentic_snapshot`` (``{seed}``) -> its seed, None when absent."""
    if raw is None:
        return None
    if lanes is None:
        _fail("traffic.agentic_snapshot", "agentic_snapshot requires trace_timestamps agentic input with positive "
                                          "agentic_lanes")
    snapshot = _obj("traffic.agentic_snapshot", raw)
    for key in snapshot:
        if key in ("initial_selections", "corpus_cursor"):
            _fail(f"traffic.agentic_snapshot.{key}", "chosen snapshot cuts (initial_selections, corpus_cursor) are "
                                                     "not simulated yet; a seed alone is")
        if key != "seed":
            _fail(f"traffic.agentic_snapshot.{key}", "unknown field; allowed: seed")
    if "seed" not in snapshot:
        _fail("traffic.agentic_snapshot.seed", "missing (an unsigned integer)")
    seed = snapshot["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        _fail("traffic.agentic_snapshot.seed", f"must be an unsigned 64-bit integer, got {seed!r}")
    return seed


def _ignored_in_flight_cap(max_in_flight, concurrency: int, what: str) -> None:
    """``spec.max_in_flight`` beside a traffic source: the reference's CLI writes it equal
    to the load's concurrency, and its workload driver reads only the traffic's (measured:
    a cap of 3 beside replay_concurrency 6, of 8 beside a synthetic concurrency of 4 and
    of 4 beside 8, and of 3 on an open-loop trace change no request); a different one
    warns and runs so."""
    if max_in_flight is None:
        return
    cap = _int("spec.max_in_flight", max_in_flight, 1)
    if cap != concurrency:
        _warn("spec.max_in_flight", f"{cap} differs from {what} ({concurrency or 'none'}); the reference's "
              "workload driver reads only the traffic's, so it does not cap this run either; run so")


def parse_placement(raw: Any, path: str) -> tuple[str, int, RouterConfig | None]:
    """``{"provider": "round_robin" | "random" | "kv_router", "config": {...}}`` (absent =
    round robin) -> (provider, seed, router knobs of kv_router)."""
    placement = _obj(path, raw)
    for key in placement:
        if key not in ("provider", "config"):
            _fail(f"{path}.{key}", "unknown field; allowed: config, provider")
    provider = _choice(f"{path}.provider", placement.get("provider", "round_robin"), PLACEMENTS)
    config = _obj(f"{path}.config", placement.get("config"))
    allowed = {"random": ("seed",), "kv_router": ROUTER_KEYS}.get(provider, ())
    for key in config:
        if key not in allowed:
            _fail(f"{path}.config.{key}", f"unknown field for placement {provider!r}; allowed: "
                                          + (", ".join(allowed) or "none"))
    seed = check_placement_seed(f"{path}.config.seed", config.get("seed", 0))
    router = None
    if provider == "kv_router":
        router = RouterConfig(
            overlap_score_credit=_float(f"{path}.config.overlap_score_credit",
                                        config.get("overlap_score_credit", 1.0)),
            prefill_load_scale=_float(f"{path}.config.prefill_load_scale",
                                      config.get("prefill_load_scale", 1.0)),
            router_temperature=_float(f"{path}.config.router_temperature",
                                      config.get("router_temperature", 0.0)),
            pin_to_trace_worker=_bool(f"{path}.config.pin_to_trace_worker",
                                      config.get("pin_to_trace_worker", False)))
    return provider, seed, router


def check_placement_seed(path: str, seed: Any) -> int:
    """A placement seed: the generator's (random placement, the router's ties)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 63:
        _fail(path, f"must be an integer >= 0 and below 2**63, got {seed!r}")
    return int(seed)


def check_rank(rank: RankConfig, path: str = "rank") -> None:
    """Validate a RankConfig built in code by the rules ``parse_rank`` applies (the
    one place they are written): raises ConfigError naming the field."""
    if not isinstance(rank, RankConfig):
        _fail(path, f"must be a RankConfig, got {type(rank).__name__}")
    if rank.timing_model == "aic" and rank.aic is None:
        _fail(f"{path}.aic", "timing_model 'aic' needs its config (aisim_fast.aic.timing.parse_config)")
    tp = rank.aic.tp if rank.aic is not None else 1
    parse_rank(rank.payload(), path, tp, rank.aic.attention_dp if rank.aic is not None else 1)


def _pool_workers(path: str, raw: Any) -> int:
    pool = _obj(path, raw)
    # the reference delays only workers its scaler adds (measured: 5 s on two initial
    # workers changes no request); its payloads have no scaler but "none", so the delay
    # is checked and has no effect
    _float(f"{path}.startup_delay_ms", pool.get("startup_delay_ms", 0.0))
    return _int(f"{path}.initial_workers", pool.get("initial_workers", 1), 1)


_ENGINE_POOL_KEYS = ("dp_size", "tensor_parallel_size", "prefill_context_parallel_size",
                     "num_gpu_blocks_is_explicit", "rank")


def _role_block(engine: dict, top: dict, role: str) -> tuple[str, dict]:
    if engine.get(role) is None:
        return "spec.engine", top
    return f"spec.engine.{role}", _obj(f"spec.engine.{role}", engine[role])


def _engine_pool(path: str, engine: dict, worker_type: str) -> tuple[RankConfig, int, int]:
    """One pool's engine block: (rank fields, tensor parallelism, attention-DP ranks per
    worker; more than one in aggregated pools only)."""
    for key in engine:
        if key not in _ENGINE_POOL_KEYS and not (path == "spec.engine" and key in ("prefill", "decode")):
            _fail(f"{path}.{key}", "unknown field; allowed: " + ", ".join(_ENGINE_POOL_KEYS))
    if engine.get("prefill_context_parallel_size", 1) != 1:
        _fail(f"{path}.prefill_context_parallel_size",
              f"only 1 is simulated, got {engine.get('prefill_context_parallel_size')!r}")
    dp = _int(f"{path}.dp_size", engine.get("dp_size", 1), 1)
    tp = _int(f"{path}.tensor_parallel_size", engine.get("tensor_parallel_size", 1), 1)
    raw = dict(_obj(f"{path}.rank", engine.get("rank")))
    declared = raw.get("worker_type", worker_type)
    if declared != worker_type:
        _fail(f"{path}.rank.worker_type", f"must be {worker_type!r} in this pool, got {declared!r}")
    raw["worker_type"] = worker_type
    explicit = _bool(f"{path}.num_gpu_blocks_is_explicit", engine.get("num_gpu_blocks_is_explicit", True))
    if not explicit and raw.get("kv_cache_bytes_per_token") is not None:
        _fail(f"{path}.rank.kv_cache_bytes_per_token", "with a KV pool sized from memory "
              "(num_gpu_blocks_is_explicit: false) is not simulated yet; give num_gpu_blocks")
    timing = raw.get("timing_model")
    if not explicit and isinstance(timing, dict) and timing.get("type") == "external":
        # the reference's CLI writes the blocks it sized beside this flag; its core sizes
        # them again from the memory model, so the number written is not the one run
        raw.pop("num_gpu_blocks", None)
    rank = parse_rank(raw, f"{path}.rank", tp, dp)
    check_attention_dp(rank, dp, f"{path}.rank", worker_type)
    return rank, tp, dp


def check_attention_dp(rank: RankConfig, dp_size: int, path: str = "rank",
                       worker_type: str = "aggregated") -> None:
    """What a rank of an attention-DP group (``dp_size`` > 1) cannot take."""
    if dp_size > 1 and rank.backend == "sglang" and rank.sglang_host_loop:
        _fail(f"{path}.sglang.host_loop", "the SGLang host loop with attention DP (dp_size > 1) is not "
              "simulated yet")
    if dp_size > 1 and rank.backend == "sglang":
        if rank.sglang_chunked_prefill_size // dp_size == 0:
            _fail(f"{path}.sglang.chunked_prefill_size",
                  f"each of the {dp_size} attention-DP ranks takes chunked_prefill_size // dp_size "
                  f"tokens, which is 0 for {rank.sglang_chunked_prefill_size}")


def read_config_text(path: Path, what: str) -> str:
    """A config file's text, every failure one ConfigError naming ``what`` and the file."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None


def read_payload_file(path: Path, what: str = "spec file") -> dict:
    """An execution payload from its file: YAML for .yaml / .yml, else JSON."""
    text = read_config_text(path, what)
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            payload = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    else:
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            hint = " (a YAML payload needs a .yaml or .yml name)" if text.lstrip()[:1] not in "{[" else ""
            raise ConfigError(f"{path}: not valid JSON ({exc}){hint}") from None
    if not isinstance(payload, dict):
        raise ConfigError(f"{path}: must hold an execution payload {{spec: ..., traffic: ...}}")
    return payload


def load_spec(path: str | Path, trace_override: str | None = None) -> ReplaySetup:
    path = Path(path)
    return parse_payload(read_payload_file(path), path.parent, trace_override)


def set_aic_timing(payload: dict, *, model: str | None = None, system: str | None = None,
                   tp: int | None = None, backend_version: str | None = None,
                   where: str = "", role: str | None = None) -> dict:
    """A copy of ``payload`` with every pool timed by AIC for the given model, GPU
    system, tensor parallelism and framework version (``None`` keeps a pool's
    current value; a pool not yet timed by AIC needs model and system). ``tp`` sets
    the engine's ``tensor_parallel_size`` too, which the AIC config must match.
    ``where`` prefixes the names of the values in errors ("--" for flags); ``role``
    ("prefill" or "decode") retimes only that pool of a disaggregated payload."""
    import copy

    out = copy.deepcopy(payload)
    spec = _obj("spec", out.get("spec"))
    engine = _obj("spec.engine", spec.get("engine"))
    kind = _obj("spec.topology", spec.get("topology")).get("kind")
    blocks = ([engine.get("prefill"), engine.get("decode")] if kind == "disaggregated" else [engine])
    if role is not None:
        if kind != "disaggregated":
            _fail(f"{where}{role}_system", "needs a disaggregated topology (prefill and decode pools)")
        blocks = [engine.get(role)]
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        _fail(f"{where}tp", f"must be an integer >= 1, got {tp!r}")
    for block in blocks:
        if not isinstance(block, dict):
            _fail("spec.engine", "every pool needs an engine block with a rank")
        rank = block.setdefault("rank", {})
        timing = rank.get("timing_model") or {}
        config = dict(timing.get("config") or {}) if timing.get("provider") == "aic" else {}
        for key, value in (("model", model), ("system", system), ("backend_version", backend_version)):
            if value is not None:
                config[key] = value
        for key in ("model", "system"):
            if not config.get(key):
                _fail(f"{where}{key}", "required: the pools are not timed by AIC yet")
        config["backend"] = rank.get("backend", "vllm")
        if tp is not None:
            block["tensor_parallel_size"] = tp
        config["tp"] = block.get("tensor_parallel_size", 1)
        config.setdefault("attention_dp", block.get("dp_size", 1))
        if rank.get("block_size") is not None:
            config["kv_block_size"] = rank["block_size"]
        else:
            config.pop("kv_block_size", None)
        rank["timing_model"] = {"type": "external", "provider": "aic", "config": config}
    return out
