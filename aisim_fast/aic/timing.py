"""Op-level ("AIC") forward-pass timing: a model x GPU x framework perf database.

The reference times a pass with AIC by two calls with integer keys
(spec/aic-timing.md §2): prefill ``(b, mean_isl, mean_prefix)`` and decode
``(b, mean_ctx)``. This module answers them from the pinned ``aiconfigurator-core``
package (optional extra ``aisim-fast[aic]``): it compiles one engine per distinct
timing config, evaluates the per-op latencies at the exact keys (never
interpolated), applies the one known correction of the package against the
reference's engine (the Q/K-norm term of decode attention), memoizes every value
and keeps them on disk, so a sweep pays each key once.

The kernels read values from per-simulation hash tables (``kernels.timing.aic_table``)
filled here before a run; a key not in the table is computed through ``objmode``
by ``fill_miss`` and inserted, so the kernels see exactly what the package says.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.timing import aic_table

PACKAGE = "aiconfigurator-core"
PACKAGE_VERSION = "0.12.0"
EXTRA_HINT = f"pip install 'aisim-fast[aic]' ({PACKAGE}=={PACKAGE_VERSION})"
# bump when the values this module derives from the package change (the disk cache key)
VALUES_REVISION = 1

# the reference's defaults when the config leaves them out (memory fraction by backend)
_MEMORY_FRACTION = {"vllm": ("of_total", "gpu_memory_utilization", 0.9),
                    "sglang": ("of_total", "mem_fraction_static", 0.88),
                    "trtllm": ("of_free", "free_gpu_memory_fraction", 0.9)}
_DTYPE_FIELDS = {"gemm_dtype": "gemm_quant_mode", "moe_dtype": "moe_quant_mode",
                 "fmha_dtype": "fmha_quant_mode", "kv_cache_dtype": "kvcache_quant_mode",
                 "comm_dtype": "comm_quant_mode"}
CONFIG_FIELDS = ("model", "backend", "system", "tp", "backend_version", "pp", "attention_dp",
                 "moe_tp_size", "moe_ep_size", *_DTYPE_FIELDS, "nextn", "kv_block_size",
                 "gpu_memory_utilization", "mem_fraction_static", "free_gpu_memory_fraction",
                 "systems_path")
_ALIASES = {"tp_size": "tp", **{v: k for k, v in _DTYPE_FIELDS.items()}}

# The rest of what the reference's CLI writes into this config (its canonical
# forward-pass config): key -> (the values simulated, why another value is refused).
# The values simulated are the ones the CLI writes unless its config asks for the
# feature; they name provenance only and are carried into the run's summary.
_CLI_FIELDS = {
    "worker_type": (("aggregated", "prefill", "decode"), "must be aggregated, prefill or decode"),
    "fpm_profile": ((None,), "forward-pass-measurement (FPM) profile timing is not simulated"),
    "fpm_fmha_quant_mode": ((None,), "FPM attention quantization is not simulated"),
    "dcp": ((None, 1), "decode context parallelism is not simulated"),
    "cp_size": ((None, 1), "prefill context parallelism is not simulated"),
    "speculation": ((None,), "speculation schemes priced by draft op tables (ngram's sequence-basis "
                             "verify, EAGLE-3, draft models) are not simulated; MTP is (config "
                             "nextn with the rank's aic_nextn)"),
    "decoder_replay": ((False,), "decoder replay is not simulated"),
    "estimation_mode": (("op_level",), "only op-level estimation is simulated"),
    "database_mode": (("SILICON",), "only the measured (SILICON) database mode is simulated"),
    "fallback_policy": (("deny",), "only 'deny' is simulated (a failed lookup stops the run)"),
    "attention_backend": ((None,), "a non-default attention kernel backend is not simulated"),
    "moe_kernel_source": ((None,), "a non-default MoE kernel source is not simulated"),
    "moe_backend": ((None,), "a non-default MoE backend is not simulated"),
    "enable_eplb": ((False,), "expert-parallel load balancing is not simulated"),
    "wideep_num_slots": ((None,), "wide expert parallelism is not simulated"),
    "enable_shared_layer": ((None, False), "shared-layer models are not simulated"),
    "strict_provenance": ((False,), "strict provenance checking is not simulated"),
    "encoder_parallel": ((None,), "vision encoders are not simulated"),
}
# the CLI's transfer policy: every kind of transfer between database entries allowed
_TRANSFER_POLICY = ("xop", "xprofile", "xquant", "xshape")
# estimator_config blocks that tune the FPM estimators (correction, regression,
# interpolation) from measured passes; a replay feeds none, so only op_level matters
_ESTIMATOR_BLOCKS = ("features", "op_level", "fpm_interpolation", "fpm_regression", "correction")
_MAX_RESERVED_BYTES = 2 ** 53  # the reference's largest exact byte count


def _is_value(value: Any, allowed: tuple) -> bool:
    """``value`` is one of ``allowed`` (None and booleans by identity: 0 is not False)."""
    return any(value is a if a is None or isinstance(a, bool) else
               (not isinstance(value, bool) and value == a) for a in allowed)


def _cli_field(path: str, key: str, value: Any) -> Any:
    """One key of the reference CLI's canonical config, checked: its value (normalized
    as the reference normalizes it) or an error naming the field and the reason."""
    if key == "database_mode" and isinstance(value, str):
        value = value.upper()
    if key == "transfer_policy":
        kinds = [value] if isinstance(value, str) else value
        if value is not None and (not isinstance(kinds, list) or sorted(kinds) != list(_TRANSFER_POLICY)):
            _fail(f"{path}.{key}", f"only the default policy {list(_TRANSFER_POLICY)} (or null) is "
                                   f"simulated, got {value!r}")
        return value
    if key == "estimator_config":
        if value is None:
            return value
        if not isinstance(value, dict):
            _fail(f"{path}.{key}", f"must be an object, got {value!r}")
        for block in value:
            if block not in _ESTIMATOR_BLOCKS:
                _fail(f"{path}.{key}.{block}", "unknown block; allowed: " + ", ".join(_ESTIMATOR_BLOCKS))
        if value.get("op_level") not in (None, {}):
            _fail(f"{path}.{key}.op_level", "op-level estimator options are not simulated; only {} is accepted")
        return value
    if key == "systems_paths":
        if value is None or value == []:
            return None
        if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], str):
            _fail(f"{path}.{key}", f"one systems folder is simulated (a list of one path), got {value!r}")
        return value[0]
    if key == "cuda_graph_reserved_bytes":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_RESERVED_BYTES:
            _fail(f"{path}.{key}", f"must be an integer in [0, 2**53], got {value!r}")
        return value
    if key == "speculation" and value is not None:
        return _mtp_depth(path, value)
    allowed, why = _CLI_FIELDS[key]
    if not _is_value(value, allowed):
        _fail(f"{path}.{key}", f"{why}; accepted: {', '.join(map(repr, allowed))}; got {value!r}")
    return value


CLI_ONLY_FIELDS = (*_CLI_FIELDS, "transfer_policy", "estimator_config", "systems_paths")


def _mtp_depth(path: str, value: Any) -> dict:
    """A ``speculation`` scheme the timing prices as MTP (the reference desugars
    ``nextn`` to ``{kind: mtp, params: {depth: n}}``, and the one to the other):
    returned as given; any other scheme is refused with the reason."""
    if not isinstance(value, dict) or value.get("kind") != "mtp":
        kind = value.get("kind") if isinstance(value, dict) else value
        _fail(f"{path}.speculation", f"{kind!r} speculation is priced by draft op tables aisim_fast does "
              "not build (ngram's sequence-basis verify, EAGLE-3, draft models); MTP is simulated "
              "({kind: mtp, params: {depth: N}}, or nextn)")
    params = value.get("params") or {}
    depth = params.get("depth") if isinstance(params, dict) else None
    if set(value) - {"kind", "params"} or not isinstance(params, dict) or set(params) - {"depth"} \
            or isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 5:
        _fail(f"{path}.speculation", f"an MTP scheme is {{kind: mtp, params: {{depth: 1..5}}}}, got {value!r}")
    return value


class AicError(ValueError):
    """An AIC timing config the installed database cannot serve; the message starts
    with the field path."""


def _fail(path: str, message: str):
    raise AicError(f"{path}: {message}")


def _package(path: str = "timing_model"):
    """The imported package, or a one-line error naming the extra to install."""
    try:
        import aiconfigurator_core
    except ImportError:
        _fail(path, f"op-level (AIC) timing needs the optional extra: {EXTRA_HINT}")
    installed = _installed_version()
    if installed != PACKAGE_VERSION:
        _fail(path, f"op-level timing is verified with {PACKAGE}=={PACKAGE_VERSION}, found "
                    f"{installed}: {EXTRA_HINT}")
    return aiconfigurator_core


@functools.lru_cache(maxsize=None)
def _installed_version() -> str:
    from importlib.metadata import version
    return version(PACKAGE)


def available() -> bool:
    """Whether the pinned package is installed."""
    try:
        _package()
    except AicError:
        return False
    return True


def _package_dir(path: str = "timing_model") -> Path:
    return Path(_package(path).__file__).parent


def systems(systems_path: str | None = None) -> list[str]:
    """GPU systems of the installed database (those with perf data)."""
    return list(_systems(systems_path))


@functools.lru_cache(maxsize=None)
def _systems(systems_path: str | None) -> tuple[str, ...]:
    root = Path(systems_path) if systems_path else _package_dir() / "systems"
    data = root / "data"
    return tuple(sorted(p.stem for p in root.glob("*.yaml") if (data / p.stem).is_dir()))


def models() -> list[str]:
    """Model ids the installed package has a bundled config for."""
    return list(_models())


@functools.lru_cache(maxsize=None)
def _models() -> tuple[str, ...]:
    out = []
    for p in (_package_dir() / "model_configs").glob("*_config.json"):
        name = p.name[:-len("_config.json")]
        if name.endswith("_hf_quant"):
            continue
        out.append(name.replace("--", "/", 1))
    return tuple(sorted(out))


def backend_versions(system: str, backend: str, systems_path: str | None = None) -> dict:
    """The database's version slots for (system, backend), e.g. {'current': '0.24.0'}."""
    return dict(_backend_versions(system, backend, systems_path))


@functools.lru_cache(maxsize=None)
def _backend_versions(system: str, backend: str, systems_path: str | None) -> tuple:
    _package()
    from aiconfigurator_core.sdk import perf_database
    return tuple((perf_database.get_version_slots(system, backend, systems_paths=systems_path)
                  or {}).items())


def _closest(value: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(value, choices, n=5, cutoff=0.3)
    rest = [c for c in choices if c not in near]
    shown = near + rest[:max(0, 8 - len(near))]
    more = len(choices) - len(shown)
    return ", ".join(shown) + (f" (and {more} more)" if more > 0 else "")


@dataclass(frozen=True)
class AicConfig:
    """One resolved AIC timing config (the reference's ``AicTimingConfig``, versions
    resolved to a literal, the memory fraction resolved to kind and value)."""
    model: str
    backend: str
    system: str
    backend_version: str
    tp: int = 1
    pp: int = 1
    attention_dp: int = 1
    moe_tp_size: int | None = None
    moe_ep_size: int | None = None
    gemm_dtype: str | None = None
    moe_dtype: str | None = None
    fmha_dtype: str | None = None
    kv_cache_dtype: str | None = None
    comm_dtype: str | None = None
    nextn: int = 0
    kv_block_size: int | None = None
    memory_fraction_kind: str = "of_total"
    memory_fraction_value: float = 0.9
    systems_path: str | None = None
    # bytes the rank keeps for CUDA graphs, out of the KV budget (num_gpu_blocks only)
    cuda_graph_reserved_bytes: int = 0
    # the reference CLI's provenance keys as given ((key, value as JSON) pairs): carried
    # into the summary, no part of the timing (equal configs share one engine)
    cli_fields: tuple = field(default=(), compare=False)

    def to_json(self) -> dict:
        out = self.values_json()
        if self.cuda_graph_reserved_bytes:
            out["cuda_graph_reserved_bytes"] = self.cuda_graph_reserved_bytes
        if self.cli_fields:
            out["cli_fields"] = {key: json.loads(text) for key, text in self.cli_fields}
        return out

    def values_json(self) -> dict:
        """What the per-op latencies depend on (the disk cache's identity)."""
        return {k: v for k, v in asdict(self).items()
                if k not in ("cuda_graph_reserved_bytes", "cli_fields")}

    def spec_json(self) -> dict:
        """The config as a spec payload's ``timing_model.config``."""
        out = {"model": self.model, "backend": self.backend, "system": self.system,
               "tp": self.tp, "backend_version": self.backend_version}
        for key in ("pp", "attention_dp", "nextn"):
            if getattr(self, key) != 1 - (key == "nextn"):
                out[key] = getattr(self, key)
        for key in ("moe_tp_size", "moe_ep_size", *_DTYPE_FIELDS, "kv_block_size", "systems_path"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        fraction_field = _MEMORY_FRACTION[self.backend][1]
        out[fraction_field] = self.memory_fraction_value
        if self.cuda_graph_reserved_bytes:
            out["cuda_graph_reserved_bytes"] = self.cuda_graph_reserved_bytes
        for key, text in self.cli_fields:
            out[key] = json.loads(text)
        return out

    def digest(self) -> str:
        text = json.dumps([PACKAGE_VERSION, VALUES_REVISION, self.values_json()], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def _engine_kwargs(self) -> dict:
        kw = dict(tp_size=self.tp, pp_size=self.pp, attention_dp_size=self.attention_dp,
                  moe_tp_size=self.moe_tp_size, moe_ep_size=self.moe_ep_size,
                  systems_path=self.systems_path)
        for ours, theirs in _DTYPE_FIELDS.items():
            kw[theirs] = getattr(self, ours)
        return kw


def parse_config(raw: Any, path: str, *, backend: str, block_size: int, tp: int,
                 dp: int = 1, check_buildable: bool = True) -> AicConfig:
    """Validate ``timing_model.config`` of an ``external``/``aic`` timing model against
    the rank it times and the installed database (the reference's checks: backend,
    tp, attention_dp and kv_block_size must match the engine's)."""
    if not isinstance(raw, dict):
        _fail(path, f"must be an object with model, backend, system, tp; got {raw!r}")
    cfg: dict[str, Any] = {}
    cli: list[tuple[str, str]] = []
    reserved = 0
    for key, value in raw.items():
        if key in CLI_ONLY_FIELDS or key == "cuda_graph_reserved_bytes":
            checked = _cli_field(path, key, value)
            if key == "cuda_graph_reserved_bytes":
                reserved = checked
            elif key == "systems_paths":
                if checked is not None:
                    if cfg.get("systems_path") not in (None, checked):
                        _fail(f"{path}.{key}", "names another folder than systems_path")
                    cfg["systems_path"] = checked
            else:
                cli.append((key, json.dumps(checked, sort_keys=True)))
            continue
        name = _ALIASES.get(key, key)
        if name not in CONFIG_FIELDS:
            _fail(f"{path}.{key}", "unknown field; allowed: "
                  + ", ".join((*CONFIG_FIELDS, *CLI_ONLY_FIELDS, "cuda_graph_reserved_bytes")))
        if name in cfg:
            _fail(f"{path}.{key}", f"duplicate field (alias of {name})")
        cfg[name] = value
    spec_text = dict(cli).get("speculation")
    if spec_text is not None and json.loads(spec_text) is not None:
        depth = json.loads(spec_text)["params"]["depth"]
        if cfg.get("nextn", 0) not in (0, None, depth):
            _fail(f"{path}.speculation", "cannot be combined with another nextn (canonical nextn conflicts "
                  "with the resolved speculative depth)")
        cfg["nextn"] = depth
    for key in ("model", "backend", "system", "tp"):
        if key not in cfg:
            _fail(f"{path}.{key}", "required for the aic timing provider")
    for key in ("model", "backend", "system"):
        if not isinstance(cfg[key], str) or not cfg[key].strip():
            _fail(f"{path}.{key}", f"must be a non-empty string, got {cfg[key]!r}")
    ints = {"tp": 1, "pp": 1, "attention_dp": 1, "moe_tp_size": None, "moe_ep_size": None,
            "nextn": 0, "kv_block_size": None}
    for key, default in ints.items():
        value = cfg.get(key, default)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "nextn" else 1):
            _fail(f"{path}.{key}", f"must be an integer >= {0 if key == 'nextn' else 1}, got {value!r}")
        cfg[key] = value
    if cfg["backend"] != backend:
        _fail(f"{path}.backend", f"must match the engine's backend {backend!r}, got {cfg['backend']!r}")
    if cfg["tp"] != tp:
        _fail(f"{path}.tp", f"must match the engine's tensor_parallel_size {tp}, got {cfg['tp']}")
    if cfg.get("attention_dp", 1) != dp:
        _fail(f"{path}.attention_dp", f"must match the engine's dp_size {dp}, got {cfg['attention_dp']}")
    if cfg.get("kv_block_size") is not None and cfg["kv_block_size"] != block_size:
        _fail(f"{path}.kv_block_size", f"must match the engine's block_size {block_size}, "
                                       f"got {cfg['kv_block_size']}")
    if cfg.get("nextn", 0) > 5:
        _fail(f"{path}.nextn", f"AIC nextn must be in 0..=5, got {cfg['nextn']}")
    if (cfg.get("moe_tp_size") is None) != (cfg.get("moe_ep_size") is None):
        _fail(f"{path}.moe_tp_size", "moe_tp_size and moe_ep_size must be given together")
    if cfg.get("moe_tp_size") is not None and cfg["tp"] * cfg.get("attention_dp", 1) != \
            cfg["moe_tp_size"] * cfg["moe_ep_size"]:
        _fail(f"{path}.moe_tp_size", "tp * attention_dp must equal moe_tp_size * moe_ep_size")
    for key in _DTYPE_FIELDS:
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            _fail(f"{path}.{key}", f"must be a string, got {cfg[key]!r}")
    kind, fraction_field, default_fraction = _MEMORY_FRACTION[backend]
    for key in ("gpu_memory_utilization", "mem_fraction_static", "free_gpu_memory_fraction"):
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or not 0.0 <= value <= 1.0:
            _fail(f"{path}.{key}", f"must be a number in [0, 1], got {value!r}")
    fraction = float(cfg.get(fraction_field) if cfg.get(fraction_field) is not None else default_fraction)

    systems_path = cfg.get("systems_path")
    _package(path)
    known_systems = systems(systems_path)
    if cfg["system"] not in known_systems:
        _fail(f"{path}.system", f"unknown system {cfg['system']!r}; the database has: "
                                + _closest(cfg["system"], known_systems))
    known_models = models()
    if cfg["model"] not in known_models:
        _fail(f"{path}.model", f"unknown model {cfg['model']!r}; the database has: "
                               + _closest(cfg["model"], known_models))
    slots = backend_versions(cfg["system"], backend, systems_path)
    if not slots:
        _fail(f"{path}.system", f"the database has no {backend} data for {cfg['system']!r}")
    requested = cfg.get("backend_version")
    if requested is None:
        version = slots.get("current") or sorted(slots.values())[-1]
    elif requested in slots:
        version = slots[requested]
    elif requested in slots.values():
        version = requested
    else:
        listed = ", ".join(f"{v} ({k})" for k, v in slots.items())
        _fail(f"{path}.backend_version", f"{requested!r} is not in the database for "
                                         f"{cfg['system']}/{backend}; it has: {listed}")
    config = AicConfig(
        model=cfg["model"], backend=backend, system=cfg["system"], backend_version=version,
        tp=cfg["tp"], pp=cfg.get("pp", 1), attention_dp=cfg.get("attention_dp", 1),
        moe_tp_size=cfg.get("moe_tp_size"), moe_ep_size=cfg.get("moe_ep_size"),
        **{k: cfg.get(k) for k in _DTYPE_FIELDS}, nextn=cfg.get("nextn", 0),
        kv_block_size=cfg.get("kv_block_size"),
        memory_fraction_kind=kind, memory_fraction_value=fraction, systems_path=systems_path,
        cuda_graph_reserved_bytes=reserved, cli_fields=tuple(cli))
    if check_buildable:  # off when the config only sizes a KV pool (no per-op timing)
        timing(config).check_buildable(path)
    return config


# ---------------------------------------------------------------------------------
# Engines and values
# ---------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where computed values are kept between runs: ``AISIM_FAST_CACHE_DIR`` or the
    user cache folder."""
    root = os.environ.get("AISIM_FAST_CACHE_DIR")
    if root:
        return Path(root) / "aic"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aisim_fast" / "aic"


def _quiet_stderr():
    """The package prints data-fallback notices on stderr while it loads tables;
    they say nothing about this run's numbers, so they are held back."""
    import contextlib
    import io
    return contextlib.redirect_stderr(io.StringIO())


class _Memo:
    """Values of one phase: key -> row, and per row the key, the total and the per-op
    latencies (plain lists: appended one by one in a run, turned into arrays for the
    kernel tables, the evidence and the disk cache)."""

    def __init__(self, key_width: int):
        self.key_width = key_width
        self.index: dict[tuple, int] = {}
        self.keys: list[tuple] = []
        self.totals: list[float] = []
        self.ops: list[tuple] = []
        self.names: tuple[str, ...] = ()
        self.sources: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def get(self, key: tuple):
        row = self.index.get(key)
        return None if row is None else (self.totals[row], self.ops[row])

    def add(self, key: tuple, total: float, ops: tuple) -> None:
        self.index[key] = len(self.keys)
        self.keys.append(key)
        self.totals.append(total)
        self.ops.append(ops)

    def clear(self) -> None:
        self.index.clear()
        self.keys.clear()
        self.totals.clear()
        self.ops.clear()

    def arrays(self, prefix: str) -> dict:
        n = len(self.keys)
        return {f"{prefix}_keys": np.array(self.keys, np.int64).reshape(n, self.key_width),
                f"{prefix}_totals": np.array(self.totals, np.float64),
                f"{prefix}_ops": np.array(self.ops, np.float64).reshape(n, len(self.names))}

    def load(self, data, prefix: str, names, sources) -> None:
        keys = data[f"{prefix}_keys"]
        self.names = tuple(str(n) for n in names)
        self.sources = dict(sources)
        self.keys = [tuple(k) for k in keys.tolist()]
        self.index = dict(zip(self.keys, range(len(self.keys))))
        self.totals = data[f"{prefix}_totals"].tolist()
        self.ops = [tuple(r) for r in data[f"{prefix}_ops"].tolist()]


class AicTiming:
    """The exact per-op latencies of one AIC config, memoized, with the disk cache.

    ``prefill(b, isl, prefix)`` and ``decode(b, ctx)`` return ``(total_ms, per_op_ms)``,
    the total summed in op order as the reference sums it."""

    def __init__(self, config: AicConfig):
        self.config = config
        self._lock = threading.Lock()
        self._engine = None
        self._attention_twin = None   # decode attention alone, unscaled (Q/K-norm models)
        self._rest_engine = None      # the other decode ops
        self._qk_norm_ms = 0.0
        self._gen_attention_index = -1
        self._gen_attention_scale = 1.0
        self.prefill_memo = _Memo(3)   # (b, mean_isl, mean_prefix)
        self.decode_memo = _Memo(2)    # (b, mean_ctx)
        self._ops_json = ("[]", "[]")  # the compiled (context, generation) op lists
        self._twin_ops_json = ""
        self._qk_norm_sol_ms = 0.0
        # speed-of-light (sol, math, memory) ms per op of a key, in memo.names order;
        # only a run that captures performance diagnostics asks (not kept on disk)
        self._sol: dict[tuple, tuple] = {}
        self._saved = (0, 0)
        self._load_cache()

    # -- the package's engine -------------------------------------------------
    def _build(self) -> None:
        """Compile the engine (1-6 s; announced), and, for models whose decode
        attention the package prices without the Q/K RMSNorm the reference adds
        (``use_qk_norm`` on the context attention op but not on the generation op:
        the Qwen3 family), a twin engine that returns that op unscaled."""
        core = _package()
        from aiconfigurator_core.sdk import engine as E
        c = self.config
        print(f"aisim-fast: compiling the AIC timing engine for {c.model} on {c.system} "
              f"({c.backend} {c.backend_version}, tp {c.tp})", file=sys.stderr, flush=True)
        kw = c._engine_kwargs()
        with _quiet_stderr():
            model_config = E.build_model_config(
                tp_size=kw["tp_size"], pp_size=kw["pp_size"], attention_dp_size=kw["attention_dp_size"],
                moe_tp_size=kw["moe_tp_size"] or 1, moe_ep_size=kw["moe_ep_size"] or 1,
                gemm_quant_mode=kw["gemm_quant_mode"], kvcache_quant_mode=kw["kvcache_quant_mode"],
                fmha_quant_mode=kw["fmha_quant_mode"], moe_quant_mode=kw["moe_quant_mode"],
                comm_quant_mode=kw["comm_quant_mode"], forward_model=None, attention_backend=None)
            # MTP: the package scales the generation ops by (layers + nextn) / layers and
            # prices a decode step over batch x (nextn + 1) tokens
            E.apply_nextn(model_config, c.nextn)
            model = E.get_model(c.model, model_config, c.backend)
            version = E._literal_backend_version(c.system, c.backend, c.backend_version,
                                                 c.systems_path, None)
            database = E._maybe_load_database(c.system, c.backend, version, c.systems_path)
            spec = json.loads(E.build_engine_spec_json(
                model, model_path=c.model, system=c.system, backend=c.backend,
                backend_version=version, kv_block_size=c.kv_block_size,
                systems_path=c.systems_path, nextn=c.nextn, database=database))
            systems_root = c.systems_path or str(_package_dir() / "systems")
            self._engine = core.AicEngine.from_spec(
                bytes(core.engine_spec_bincode_from_json(json.dumps(spec))), systems_root)
            self._ops_json = (json.dumps(spec["context_ops"]), json.dumps(spec["generation_ops"]))
            self._prepare_qk_norm(core, spec, systems_root)

    def _prepare_qk_norm(self, core, spec: dict, systems_root: str) -> None:
        """The reference's decode attention adds, per layer, the Q/K RMSNorm memory
        passes ``(mem_op(2*n*hs)*2 + mem_op(2*n_kv*hs)*2) * 2.2`` to the table value
        before the layer scale (spec/aic-timing.md §3); the package leaves it out."""
        ctx_norm = any(op.get("ContextAttention", {}).get("use_qk_norm") for op in spec["context_ops"])
        for i, op in enumerate(spec["generation_ops"]):
            gen = op.get("GenerationAttention")
            if gen is None:
                continue
            if not ctx_norm or gen.get("use_qk_norm") is not None:
                return
            from aiconfigurator_core.sdk import perf_database
            gpu = perf_database.load_system_spec(self.config.system,
                                                 systems_paths=self.config.systems_path)["gpu"]
            mem_bw = max(float(gpu["mem_bw"]), 1.0)
            scaling = max(float(gpu["mem_bw_empirical_scaling_factor"]), 1e-9)
            constant = float(gpu["mem_empirical_constant_latency"])

            def mem_op(n_bytes: float) -> float:
                return (n_bytes / (mem_bw * scaling) + constant) * 1000.0

            def mem_sol(n_bytes: float) -> float:  # the same bytes at the roofline
                return n_bytes / mem_bw * 1000.0

            q_num = float(gen["n"] * gen["head_size"])
            k_num = float(gen["n_kv"] * gen["head_size"])
            self._qk_norm_ms = (mem_op(q_num * 2.0) * 2.0 + mem_op(k_num * 2.0) * 2.0) * (2.0 * 1.1)
            self._qk_norm_sol_ms = (mem_sol(q_num * 2.0) * 2.0 + mem_sol(k_num * 2.0) * 2.0) * (2.0 * 1.1)
            self._gen_attention_scale = float(gen["scale_factor"])
            # decode then runs two engines that split the generation ops: the others
            # (cheap) and attention alone, unscaled (most of a query's cost); the
            # corrected attention goes back at its place in the op order
            twin = json.loads(json.dumps(spec))
            twin["generation_ops"] = [twin["generation_ops"][i]]
            twin["generation_ops"][0]["GenerationAttention"]["scale_factor"] = 1.0
            self._attention_twin = core.AicEngine.from_spec(
                bytes(core.engine_spec_bincode_from_json(json.dumps(twin))), systems_root)
            self._twin_ops_json = json.dumps(twin["generation_ops"])
            rest = json.loads(json.dumps(spec))
            del rest["generation_ops"][i]
            self._rest_engine = core.AicEngine.from_spec(
                bytes(core.engine_spec_bincode_from_json(json.dumps(rest))), systems_root)
            with _quiet_stderr():
                _, probe = self._engine.run_static_per_op(1, 1, 1, 2, 0, 1.0, 1.0,
                                                          mode="static_gen", stride=32)
            self._gen_attention_index = [op[0] for op in probe].index(gen["name"])
            return

    def _ensure(self) -> None:
        if self._engine is None:
            self._build()

    def check_buildable(self, path: str) -> None:
        """Fail now, naming the combination, if the package cannot build this config's
        engine (a model the backend does not support, say), rather than in the run.
        A config with values on disk was built before: nothing to do."""
        if self._engine is not None or len(self.prefill_memo) or len(self.decode_memo):
            return
        try:
            with self._lock:
                self._ensure()
        except AicError:
            raise
        except Exception as exc:  # the package's own errors are of many kinds
            c = self.config
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _fail(path, f"the database cannot time {c.model} on {c.system} with {c.backend} "
                        f"{c.backend_version} (tp {c.tp}): {first}")

    # -- values ----------------------------------------------------------------
    def prefill(self, b: int, isl: int, prefix: int) -> tuple[float, tuple]:
        key = (int(b), int(isl), int(prefix))
        hit = self.prefill_memo.get(key)
        if hit is not None:
            return hit
        with self._lock:
            self._ensure()
            with _quiet_stderr():
                ctx, _ = self._engine.run_static_per_op(key[0], 1, key[1], 1, key[2], 1.0, 1.0,
                                                        mode="static_ctx", stride=32)
            value = self._fold(ctx, self.prefill_memo)
            if self.prefill_memo.get(key) is None:
                self.prefill_memo.add(key, *value)
        return value

    def decode(self, b: int, ctx_len: int) -> tuple[float, tuple]:
        key = (int(b), int(ctx_len))
        hit = self.decode_memo.get(key)
        if hit is not None:
            return hit
        with self._lock:
            self._ensure()
            # the past KV is the context minus the token being decoded (osl 2: one step)
            args = (key[0], 1, key[1] - 1, 2, 0, 1.0, 1.0)
            with _quiet_stderr():
                if self._attention_twin is None:
                    _, gen = self._engine.run_static_per_op(*args, mode="static_gen", stride=32)
                else:
                    _, rest = self._rest_engine.run_static_per_op(*args, mode="static_gen", stride=32)
                    _, twin = self._attention_twin.run_static_per_op(*args, mode="static_gen", stride=32)
            if self._attention_twin is not None:
                (name, unscaled, energy, source), = twin
                # the norm's memory passes are empirical: a silicon table value plus
                # them is "mixed", as the reference labels it
                corrected = (name, max(unscaled + self._qk_norm_ms, 0.0) * self._gen_attention_scale,
                             energy, source if source == "empirical" else "mixed")
                i = self._gen_attention_index
                gen = [*rest[:i], corrected, *rest[i:]]
            value = self._fold(gen, self.decode_memo)
            if self.decode_memo.get(key) is None:
                self.decode_memo.add(key, *value)
        return value

    def sol(self, phase: str, key: tuple) -> tuple:
        """Speed of light of every op of a timing key (``phase`` prefill: ``(b, isl,
        prefix)``, decode: ``(b, ctx)``): ``((sol_ms, math_ms, memory_ms), ...)`` in
        the memo's op order, the package's roofline view of the same op shapes the
        latencies come from (a prefill pass computes ``isl - prefix`` tokens per
        request over its prefix; a decode step reads ``ctx``). Decode attention of a
        Q/K-norm model adds the norm's memory passes at the roofline, before the layer
        scale, as its latency adds them at the empirical bandwidth."""
        full = (phase, *(int(k) for k in key))
        hit = self._sol.get(full)
        if hit is not None:
            return hit
        with self._lock:
            self._ensure()
            b = full[1]
            with _quiet_stderr():
                if phase == "prefill":
                    isl, prefix = full[2], full[3]
                    rows = self._engine.evaluate_ops_sol_json(self._ops_json[0], True, b, isl - prefix, prefix)
                    names = self.prefill_memo.names
                else:
                    rows = self._engine.evaluate_ops_sol_json(self._ops_json[1], False, b, full[2], 0)
                    names = self.decode_memo.names
                    if self._twin_ops_json:
                        (name, _sol, _math, mem), = self._attention_twin.evaluate_ops_sol_json(
                            self._twin_ops_json, False, b, full[2], 0)
                        i = [r[0] for r in rows].index(name)
                        math_ms = rows[i][2]
                        mem_ms = (mem + self._qk_norm_sol_ms) * self._gen_attention_scale
                        rows = [*rows[:i], (name, max(math_ms, mem_ms), math_ms, mem_ms), *rows[i + 1:]]
            by_name = {r[0]: (float(r[1]), float(r[2]), float(r[3])) for r in rows}
            value = tuple(by_name.get(n, (0.0, 0.0, 0.0)) for n in names)
            self._sol[full] = value
        return value

    @staticmethod
    def _fold(ops, memo: _Memo) -> tuple[float, tuple]:
        names = tuple(op[0] for op in ops)
        if not memo.names:
            memo.names = names
        if names != memo.names:
            raise RuntimeError(f"AIC ops changed between queries: {memo.names} vs {names}")
        total = 0.0
        for name, ms, _energy, source in ops:
            total += ms
            prev = memo.sources.get(name)
            memo.sources[name] = source if prev in (None, source) else "mixed"
        return total, tuple(float(op[1]) for op in ops)

    @property
    def prefill_names(self) -> tuple[str, ...]:
        return self.prefill_memo.names

    @property
    def decode_names(self) -> tuple[str, ...]:
        return self.decode_memo.names

    def values(self, kind: int, b: int, x: int, y: int) -> float:
        """Total ms of a timing key (kind 0 prefill (b, isl, prefix), 1 decode (b, ctx))."""
        return (self.prefill(b, x, y) if kind == 0 else self.decode(b, x))[0]

    # -- disk cache -------------------------------------------------------------
    def _cache_path(self) -> Path:
        return cache_dir() / f"{self.config.digest()}.npz"

    def _load_cache(self) -> None:
        try:
            with np.load(self._cache_path(), allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                if meta.get("config") != self.config.values_json():
                    return
                self.prefill_memo.load(data, "prefill", meta["prefill_names"], meta["prefill_sources"])
                self.decode_memo.load(data, "decode", meta["decode_names"], meta["decode_sources"])
        except (OSError, ValueError, KeyError):
            self.prefill_memo.clear()
            self.decode_memo.clear()
            return
        self._saved = (len(self.prefill_memo), len(self.decode_memo))

    def save(self) -> None:
        """Write the memo to the disk cache if it grew (atomically: a temporary file
        renamed over the old one; an unwritable cache folder is skipped)."""
        with self._lock:
            sizes = (len(self.prefill_memo), len(self.decode_memo))
            if sizes == self._saved:
                return
            meta = {"package": f"{PACKAGE}=={PACKAGE_VERSION}", "config": self.config.values_json(),
                    "prefill_names": list(self.prefill_memo.names),
                    "decode_names": list(self.decode_memo.names),
                    "prefill_sources": self.prefill_memo.sources,
                    "decode_sources": self.decode_memo.sources}
            path = self._cache_path()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.npz")
                np.savez(tmp, meta=np.array(json.dumps(meta)), **self.prefill_memo.arrays("prefill"),
                         **self.decode_memo.arrays("decode"))
                os.replace(tmp, path)
            except OSError:
                return
            self._saved = sizes


_TIMINGS: list[AicTiming] = []
_BY_CONFIG: dict[AicConfig, int] = {}


def timing_id(config: AicConfig) -> int:
    """The process-wide id of the timing of ``config`` (one per distinct config)."""
    tid = _BY_CONFIG.get(config)
    if tid is None:
        tid = _BY_CONFIG[config] = len(_TIMINGS)
        _TIMINGS.append(AicTiming(config))
    return tid


def timing(config: AicConfig) -> AicTiming:
    return _TIMINGS[timing_id(config)]


def save_all() -> None:
    for t in _TIMINGS:
        t.save()


_BLOCKS: dict[tuple, int] = {}


def estimate_num_gpu_blocks(config: AicConfig, block_size: int, max_num_batched_tokens: int,
                            path: str = "timing_model.config", max_batch_size: int = 1) -> int:
    """KV capacity of one rank from model + GPU memory, as the reference computes it:
    the package's non-KV memory breakdown (activations for ``max_num_batched_tokens``;
    ``max_batch_size`` sequences: 1 where the run re-sizes a pool, the rank's
    ``max_num_seqs`` where the reference's CLI sizes it, which SGLang's estimate uses), the CUDA-graph reserve added to the non-KV bytes, the
    backend's memory fraction of total (vLLM, SGLang) or of free memory (TRT-LLM), and
    the model's KV bytes-to-tokens inverse, in whole blocks."""
    reserved = config.cuda_graph_reserved_bytes
    key = (config, block_size, max_num_batched_tokens, reserved, max_batch_size)
    blocks = _BLOCKS.get(key)
    tag = (f"-cg{reserved}" if reserved else "") + (f"-bs{max_batch_size}" if max_batch_size != 1 else "")
    stored = cache_dir() / f"blocks-{config.digest()}-{block_size}-{max_num_batched_tokens}{tag}.json"
    if blocks is None:
        try:
            blocks = int(json.loads(stored.read_text())["num_gpu_blocks"])
        except (OSError, ValueError, KeyError, TypeError):
            blocks = None
    if blocks is None:
        blocks = _kv_tokens(config, max_num_batched_tokens, path, max_batch_size) // block_size
        if blocks <= 0:
            raise AicError(f"{path}: the database estimates no KV-cache blocks for "
                           f"{config.model} on {config.system} (tp {config.tp}); give num_gpu_blocks")
        try:
            stored.parent.mkdir(parents=True, exist_ok=True)
            tmp = stored.with_name(f".{stored.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps({"num_gpu_blocks": blocks, "config": config.to_json()}))
            os.replace(tmp, stored)
        except OSError:
            pass
    _BLOCKS[key] = blocks
    return blocks


def _kv_tokens(config: AicConfig, max_num_batched_tokens: int, path: str, max_batch_size: int = 1) -> int:
    """Tokens of KV cache one rank holds (the package's ``estimate_kv_cache`` budget
    with the reference's CUDA-graph reserve, which the package does not take)."""
    _package()
    from aiconfigurator_core.sdk import memory
    kw = config._engine_kwargs()
    with _quiet_stderr():
        try:
            native = memory.KVCacheEstimator.from_request(
                config.model, config.system, config.backend, config.backend_version,
                max_num_tokens=int(max_num_batched_tokens), max_batch_size=int(max_batch_size), nextn=0,
                **kw)
        except Exception as exc:  # the package's own errors are of many kinds
            raise AicError(f"{path}: the database cannot size the KV cache of "
                           f"{config.model} on {config.system} with {config.backend}: {exc}") from None
    breakdown = native.breakdown
    capacity = float(breakdown["gpu_memory_capacity_bytes"])
    non_kv = float(breakdown["non_kv_bytes"]) + float(config.cuda_graph_reserved_bytes)
    budget = memory.kv_cache_budget_bytes(
        capacity=capacity, non_kv=non_kv, fraction=float(config.memory_fraction_value),
        of_free=config.memory_fraction_kind == "of_free")
    if budget <= 0.0:
        # the reference's words (it stops the run with them)
        raise AicError(f"{path}: {config.model} on {config.system}, memory fraction "
                       f"{config.memory_fraction_value}, {config.cuda_graph_reserved_bytes} bytes of "
                       f"CUDA graphs: no KV budget: non-KV memory ({int(max(non_kv, 0.0))} bytes) "
                       f"meets/exceeds the KV-cache memory limit (capacity={int(max(capacity, 0.0))} "
                       f"bytes); lower the reserve, raise the fraction or give num_gpu_blocks")
    to_tokens = breakdown.get("tokens_from_kv_bytes") or memory._linear_tokens_from_bytes(
        float(breakdown["kv_size_per_token_bytes"]))
    return int(to_tokens(budget))


# ---------------------------------------------------------------------------------
# Kernel tables
# ---------------------------------------------------------------------------------
LOCAL_TABLE_SLOTS = 4096  # per simulation and config: keys met in the run


_FAILURES: dict[int, str] = {}  # timing id -> the first error a run's query met


def _provide(timing_id: int, kind: int, b: int, x: int, y: int) -> float:
    """A value for the kernels (in objmode). An exception cannot cross back into
    compiled code: it is recorded (``take_failures``) and the pass gets 0 ms; the
    driver then fails the simulations of that timing."""
    try:
        return _TIMINGS[timing_id].values(kind, b, x, y)
    except Exception as exc:
        phase = "prefill" if kind == aic_table.KIND_PREFILL else "decode"
        key = (b, x, y) if kind == aic_table.KIND_PREFILL else (b, x)
        _FAILURES.setdefault(timing_id, f"the AIC {phase} query {key} failed: "
                                        f"{type(exc).__name__}: {exc}".splitlines()[0])
        return 0.0


def take_failures(configs) -> dict:
    """{config: error} for the given configs whose queries failed since the last call."""
    out = {}
    for c in configs:
        tid = _BY_CONFIG.get(c)
        if tid is not None and tid in _FAILURES:
            out[c] = _FAILURES.pop(tid)
    return out


aic_table.set_provider(_provide)


def _known_keys(t: AicTiming) -> tuple[np.ndarray, np.ndarray]:
    """Packed keys and totals of everything the memo holds (cached per memo size)."""
    sizes = (len(t.prefill_memo), len(t.decode_memo))
    cached = getattr(t, "_packed", None)
    if cached is not None and cached[0] == sizes:
        return cached[1], cached[2]
    pf = np.array(t.prefill_memo.keys, np.int64).reshape(-1, 3)
    dc = np.array(t.decode_memo.keys, np.int64).reshape(-1, 2)
    keys = np.concatenate([
        aic_table.pack_keys_np(aic_table.KIND_PREFILL, pf[:, 0], pf[:, 1], pf[:, 2]),
        aic_table.pack_keys_np(aic_table.KIND_DECODE, dc[:, 0], dc[:, 1], np.zeros(len(dc), np.int64))])
    vals = np.array(t.prefill_memo.totals + t.decode_memo.totals, np.float64)
    t._packed = (sizes, keys, vals)
    return keys, vals


def batch_tables(sim_configs: list[tuple[AicConfig, ...]]):
    """The AIC tables of a batch: ``sim_configs[s]`` are the configs simulation s
    uses. Returns ``(keys, vals, meta, slots)`` with ``slots[(s, config)] = (shared
    table, local table)``."""
    distinct = list(dict.fromkeys(c for configs in sim_configs for c in configs))
    if not distinct:
        return None
    known = {c: _known_keys(timing(c)) for c in distinct}
    sizes = [max(64, int(len(known[c][0]) / aic_table.MAX_LOAD) + 1) for c in distinct]
    local_of = [(s, c) for s, configs in enumerate(sim_configs) for c in configs]
    sizes += [LOCAL_TABLE_SLOTS] * len(local_of)
    keys, vals, meta = aic_table.new_tables(sizes)
    slots = {}
    for t, c in enumerate(distinct):
        meta[t, L.AICM_TIMING] = timing_id(c)
        aic_table.insert_many(keys, vals, meta, t, *known[c])
    for i, (s, c) in enumerate(local_of):
        t = len(distinct) + i
        meta[t, L.AICM_TIMING] = timing_id(c)
        slots[(s, c)] = (distinct.index(c), t)
    return keys, vals, meta, slots


# ---------------------------------------------------------------------------------
# Evidence for the summary
# ---------------------------------------------------------------------------------
def _memo_rows(memo: _Memo, query, phase: str, keys: np.ndarray) -> np.ndarray:
    """Memo row of every key (rows of ``keys``), computing the ones it lacks."""
    kind = aic_table.KIND_PREFILL if phase == "prefill" else aic_table.KIND_DECODE

    def packed(k):
        k = np.asarray(k, np.int64).reshape(-1, memo.key_width)
        y = k[:, 2] if memo.key_width == 3 else np.zeros(len(k), np.int64)
        return aic_table.pack_keys_np(kind, k[:, 0], k[:, 1], y)

    want = packed(keys)
    if np.any(want == L.AIC_EMPTY):  # a key past the packed range: look each one up
        for key in {tuple(k) for k in keys.tolist()} - memo.index.keys():
            query(*key)
        return np.array([memo.index[tuple(k)] for k in keys.tolist()], np.int64)
    for attempt in range(2):
        have = packed(memo.keys)
        by_key = np.argsort(have, kind="stable")
        at = np.searchsorted(have[by_key], want)
        found = (at < len(have)) & (have[by_key][np.minimum(at, max(len(have) - 1, 0))] == want) \
            if len(have) else np.zeros(len(want), bool)
        if found.all() or attempt == 1:
            return by_key[at]
        for key in {tuple(k) for k in keys[~found].tolist()}:
            query(*key)  # not met in the run (its pass log outlived the memo): compute it


def _phase_passes(setup, passes):
    """Per phase (prefill, decode), the passes an AIC pool timed, in the order the
    reference adds them (pass start; ties as logged): ``(phase, parts, names,
    sources, n)`` with ``parts`` one ``(positions, timing, memo, memo rows, keys)`` per
    AIC pool, ``names`` the ops in first-seen order and ``n`` the passes in all.
    A pass times a prefill key when it computed prompt tokens, a decode key when it
    decoded; a pool timed otherwise (polynomial, fixed) has no part."""
    pools = [(rank, role) for role, rank in setup.pools]
    order = np.argsort(passes["start_ms"].to_numpy(np.float64), kind="stable")
    col = {c: passes[c].to_numpy(np.int64)[order] for c in (
        "worker", "num_prefill_requests", "sum_prefill_kv_tokens", "sum_prefill_prompt_tokens",
        "timed_decode_requests", "timed_decode_kv_tokens")}
    in_prefill_pool = (col["worker"] < setup.prefill_workers) if setup.disaggregated else None
    for phase in ("prefill", "decode"):
        names: list[str] = []
        parts = []
        sources: dict[str, str] = {}
        for rank, role in pools:
            if rank.aic is None:
                continue
            t = timing(rank.aic)
            mine = np.ones(len(order), bool) if in_prefill_pool is None else \
                (in_prefill_pool if role == "prefill" else ~in_prefill_pool)
            if phase == "prefill":
                b = col["num_prefill_requests"]
                prefix = col["sum_prefill_kv_tokens"]
                isl = prefix + col["sum_prefill_prompt_tokens"]
                safe = np.maximum(b, 1)
                use = mine & (role != "decode") & (b > 0) & (isl // safe > prefix // safe)
                keys = np.stack([b, isl // safe, prefix // safe], axis=1)[use]
                memo, query = t.prefill_memo, t.prefill
            else:
                b = col["timed_decode_requests"]
                use = mine & (role != "prefill") & (b > 0)
                keys = np.stack([b, col["timed_decode_kv_tokens"] // np.maximum(b, 1)], axis=1)[use]
                memo, query = t.decode_memo, t.decode
            rows = _memo_rows(memo, query, phase, keys)
            parts.append((np.flatnonzero(use), t, memo, rows, keys))
            names += [n for n in memo.names if n not in names]
            sources.update(memo.sources)
        yield phase, parts, names, sources, len(order)


def _sequential_sum(n: int, parts, values) -> float:
    """The sum over the passes in order of one op's value (``values(part)``: one value
    per pass of that part, 0 where the part lacks the op)."""
    column = np.zeros(n)
    for part in parts:
        where = part[0]
        if len(where):
            column[where] = values(part)
    return float(np.cumsum(column)[-1]) if n else 0.0


def _op_latencies(n: int, parts, names) -> dict[str, float]:
    tables = [np.asarray(memo.ops, np.float64).reshape(len(memo), len(memo.names))
              for _, _, memo, _, _ in parts]
    by_part = {id(part): table for part, table in zip(parts, tables)}

    def latencies(name):
        def of(part):
            _, _, memo, rows, _ = part
            if name not in memo.names or not len(rows):
                return 0.0
            return by_part[id(part)][rows, memo.names.index(name)]
        return of
    return {name: _sequential_sum(n, parts, latencies(name)) for name in names}


def op_latency_evidence(setup, passes) -> dict | None:
    """Per-op latency totals of a replay timed by AIC, from its pass log: each pass's
    timing keys (the ``timed_*`` / prefill columns) looked up op by op and summed in
    pass order (a sequential sum, as the reference adds them), per phase over every
    worker: the reference's ``power_diagnostics`` latencies, without energy (the
    database has none for these ops). None when no pool is timed by AIC."""
    pools = [(rank, role) for role, rank in setup.pools]
    if all(rank.aic is None for rank, _ in pools):
        return None
    phases = []
    for phase, parts, names, sources, n in _phase_passes(setup, passes):
        per_op = _op_latencies(n, parts, names)
        ops = [{"name": n, "latency_ms": per_op[n], "source": sources.get(n, "")} for n in sorted(per_op)]
        phases.append({"name": phase, "latency_ms": sum(per_op.values()), "operations": ops})
    return {
        "latency_unit": "ms",
        "latency_ms": sum(p["latency_ms"] for p in phases),
        "phases": phases,
        "provider": f"{PACKAGE}=={PACKAGE_VERSION}",
        "configs": {role: rank.aic.to_json() for rank, role in pools if rank.aic is not None},
    }


# the reference's words for a phase without SOL evidence and for its scope
NO_SOL_REASON = "one or more operations lack SOL evidence, or this phase was not observed"
DIAGNOSTICS_SCOPE = "accumulated_active_forward_pass_per_gpu"


def performance_diagnostics(setup, passes) -> dict:
    """The reference's ``performance_diagnostics`` report key (a payload's
    ``capture_performance_diagnostics: true``): per phase, per op (by name), the
    op's latency summed over every pass that ran the phase, in pass order, its speed
    of light (``sol``: roofline time, math and memory parts, summed the same way), the
    ratio of the two, the table's provenance (``source``) and the fallbacks taken
    (none: the lookup policy is ``deny``). A phase no AIC pool ran (polynomial or
    fixed timing, or no pass of the kind) has no operations and no SOL, with the
    reference's reason; the status is ``available`` when a phase has SOL (a polynomial
    prefill pool beside an op-level decode pool too), else ``not_observed``."""
    phases = []
    for phase, parts, names, sources, n in _phase_passes(setup, passes):
        observed = any(len(part[0]) for part in parts)
        if not observed:
            phases.append({"latency_ms": 0.0, "name": phase, "operations": [], "sol": None,
                           "sol_unavailable_reason": NO_SOL_REASON})
            continue
        latency = _op_latencies(n, parts, names)
        sol_rows = {}
        for part in parts:
            _, t, memo, rows, keys = part
            sol_rows[id(part)] = np.array([t.sol(phase, tuple(k)) for k in keys.tolist()],
                                          np.float64).reshape(len(keys), len(memo.names), 3)

        def sols(name, j):
            def of(part):
                memo = part[2]
                if name not in memo.names:
                    return 0.0
                return sol_rows[id(part)][:, memo.names.index(name), j]
            return of
        ops = []
        phase_sol = [0.0, 0.0, 0.0]
        # op by op in first-seen order (the phase totals add them so), listed by name
        for name in names:
            sol_ms, math_ms, memory_ms = (_sequential_sum(n, parts, sols(name, j)) for j in range(3))
            ops.append({"fallbacks": [], "latency_ms": latency[name],
                        "latency_to_sol_ratio": latency[name] / sol_ms if sol_ms > 0 else None,
                        "name": name,
                        "sol": {"latency_ms": sol_ms, "math_ms": math_ms, "memory_ms": memory_ms},
                        "sol_unavailable_reason": None, "source": sources.get(name, "")})
            phase_sol = [phase_sol[0] + sol_ms, phase_sol[1] + math_ms, phase_sol[2] + memory_ms]
        ops.sort(key=lambda o: o["name"])
        phases.append({"latency_ms": sum(latency.values()), "name": phase, "operations": ops,
                       "sol": {"latency_ms": phase_sol[0], "math_ms": phase_sol[1],
                               "memory_ms": phase_sol[2]},
                       "sol_unavailable_reason": None})
    status = "available" if any(p["sol"] is not None for p in phases) else "not_observed"
    return {"latency_unit": "ms", "phases": phases, "scope": DIAGNOSTICS_SCOPE, "status": status}
