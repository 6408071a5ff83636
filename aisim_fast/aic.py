"""Op-level ("AIC") forward-pass timing: a model x GPU x framework perf database.

The reference times a pass with AIC by two calls with integer keys
(spec/aic-timing.md §2): prefill ``(b, mean_isl, mean_prefix)`` and decode
``(b, mean_ctx)``. This module answers them from the pinned ``aiconfigurator-core``
package (optional extra ``aisim-fast[aic]``): it compiles one engine per distinct
timing config, evaluates the per-op latencies at the exact keys (never
interpolated), applies the one known correction of the package against the
reference's engine (the Q/K-norm term of decode attention), memoizes every value
and keeps them on disk, so a sweep pays each key once.

The kernels read values from per-simulation hash tables (``kernels.aic_table``)
filled here before a run; a key not in the table is computed through ``objmode``
by ``fill_miss`` and inserted, so the kernels see exactly what the package says.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aisim_fast.kernels import aic_table
from aisim_fast.kernels import layout as L

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


class AicError(ValueError):
    """An AIC timing config the installed database cannot serve; the message starts
    with the field path."""


def _fail(path: str, message: str):
    raise AicError(f"{path}: {message}")


def _package(path: str = "timing_model"):
    """The imported package, or a one-line error naming the extra to install."""
    try:
        import aiconfigurator_core
        from importlib.metadata import version
    except ImportError:
        _fail(path, f"op-level (AIC) timing needs the optional extra: {EXTRA_HINT}")
    installed = version(PACKAGE)
    if installed != PACKAGE_VERSION:
        _fail(path, f"op-level timing is verified with {PACKAGE}=={PACKAGE_VERSION}, found "
                    f"{installed}: {EXTRA_HINT}")
    return aiconfigurator_core


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
    root = Path(systems_path) if systems_path else _package_dir() / "systems"
    data = root / "data"
    return sorted(p.stem for p in root.glob("*.yaml") if (data / p.stem).is_dir())


def models() -> list[str]:
    """Model ids the installed package has a bundled config for."""
    out = []
    for p in (_package_dir() / "model_configs").glob("*_config.json"):
        name = p.name[:-len("_config.json")]
        if name.endswith("_hf_quant"):
            continue
        out.append(name.replace("--", "/", 1))
    return sorted(out)


def backend_versions(system: str, backend: str, systems_path: str | None = None) -> dict:
    """The database's version slots for (system, backend), e.g. {'current': '0.24.0'}."""
    _package()
    from aiconfigurator_core.sdk import perf_database
    return dict(perf_database.get_version_slots(system, backend, systems_paths=systems_path) or {})


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

    def to_json(self) -> dict:
        return asdict(self)

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
        return out

    def digest(self) -> str:
        text = json.dumps([PACKAGE_VERSION, VALUES_REVISION, self.to_json()], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def _engine_kwargs(self) -> dict:
        kw = dict(tp_size=self.tp, pp_size=self.pp, attention_dp_size=self.attention_dp,
                  moe_tp_size=self.moe_tp_size, moe_ep_size=self.moe_ep_size,
                  systems_path=self.systems_path)
        for ours, theirs in _DTYPE_FIELDS.items():
            kw[theirs] = getattr(self, ours)
        return kw


def parse_config(raw: Any, path: str, *, backend: str, block_size: int, tp: int,
                 dp: int = 1) -> AicConfig:
    """Validate ``timing_model.config`` of an ``external``/``aic`` timing model against
    the rank it times and the installed database (the reference's checks: backend,
    tp, attention_dp and kv_block_size must match the engine's)."""
    if not isinstance(raw, dict):
        _fail(path, f"must be an object with model, backend, system, tp; got {raw!r}")
    cfg: dict[str, Any] = {}
    for key, value in raw.items():
        name = _ALIASES.get(key, key)
        if name not in CONFIG_FIELDS:
            _fail(f"{path}.{key}", "unknown field; allowed: " + ", ".join(CONFIG_FIELDS))
        if name in cfg:
            _fail(f"{path}.{key}", f"duplicate field (alias of {name})")
        cfg[name] = value
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
    if cfg.get("nextn", 0) != 0:
        _fail(f"{path}.nextn", "speculative decoding (MTP) is not simulated; only 0 is accepted")
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
    return AicConfig(
        model=cfg["model"], backend=backend, system=cfg["system"], backend_version=version,
        tp=cfg["tp"], pp=cfg.get("pp", 1), attention_dp=cfg.get("attention_dp", 1),
        moe_tp_size=cfg.get("moe_tp_size"), moe_ep_size=cfg.get("moe_ep_size"),
        **{k: cfg.get(k) for k in _DTYPE_FIELDS}, nextn=0, kv_block_size=cfg.get("kv_block_size"),
        memory_fraction_kind=kind, memory_fraction_value=fraction, systems_path=systems_path)


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


class AicTiming:
    """The exact per-op latencies of one AIC config, memoized, with the disk cache.

    ``prefill(b, isl, prefix)`` and ``decode(b, ctx)`` return ``(total_ms, per_op_ms)``,
    the total summed in op order as the reference sums it."""

    def __init__(self, config: AicConfig):
        self.config = config
        self._lock = threading.Lock()
        self._engine = None
        self._attention_twin = None
        self._qk_norm_ms = 0.0
        self._gen_attention_index = -1
        self._gen_attention_scale = 1.0
        self.prefill_names: tuple[str, ...] = ()
        self.decode_names: tuple[str, ...] = ()
        self.prefill_memo: dict[tuple[int, int, int], tuple[float, tuple]] = {}
        self.decode_memo: dict[tuple[int, int], tuple[float, tuple]] = {}
        self.prefill_sources: dict[str, str] = {}
        self.decode_sources: dict[str, str] = {}
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
            E.apply_nextn(model_config, 0)
            model = E.get_model(c.model, model_config, c.backend)
            version = E._literal_backend_version(c.system, c.backend, c.backend_version,
                                                 c.systems_path, None)
            database = E._maybe_load_database(c.system, c.backend, version, c.systems_path)
            spec = json.loads(E.build_engine_spec_json(
                model, model_path=c.model, system=c.system, backend=c.backend,
                backend_version=version, kv_block_size=c.kv_block_size,
                systems_path=c.systems_path, nextn=0, database=database))
            systems_root = c.systems_path or str(_package_dir() / "systems")
            self._engine = core.AicEngine.from_spec(
                bytes(core.engine_spec_bincode_from_json(json.dumps(spec))), systems_root)
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

            q_num = float(gen["n"] * gen["head_size"])
            k_num = float(gen["n_kv"] * gen["head_size"])
            self._qk_norm_ms = (mem_op(q_num * 2.0) * 2.0 + mem_op(k_num * 2.0) * 2.0) * (2.0 * 1.1)
            self._gen_attention_scale = float(gen["scale_factor"])
            twin = json.loads(json.dumps(spec))
            twin["generation_ops"][i]["GenerationAttention"]["scale_factor"] = 1.0
            self._attention_twin = core.AicEngine.from_spec(
                bytes(core.engine_spec_bincode_from_json(json.dumps(twin))), systems_root)
            self._gen_attention_name = gen["name"]
            return

    def _ensure(self) -> None:
        if self._engine is None:
            self._build()

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
            value = self._fold(ctx, "prefill")
            self.prefill_memo[key] = value
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
                _, gen = self._engine.run_static_per_op(*args, mode="static_gen", stride=32)
                if self._attention_twin is not None:
                    _, twin = self._attention_twin.run_static_per_op(*args, mode="static_gen", stride=32)
            if self._attention_twin is not None:
                gen = list(gen)
                for i, (name, _ms, energy, source) in enumerate(gen):
                    if name == self._gen_attention_name:
                        unscaled = dict((n, ms) for n, ms, _e, _s in twin)[name]
                        # the norm's memory passes are empirical: a silicon table
                        # value plus them is "mixed", as the reference labels it
                        gen[i] = (name, max(unscaled + self._qk_norm_ms, 0.0) * self._gen_attention_scale,
                                  energy, source if source == "empirical" else "mixed")
            value = self._fold(gen, "decode")
            self.decode_memo[key] = value
        return value

    def _fold(self, ops, phase: str) -> tuple[float, tuple]:
        names = tuple(op[0] for op in ops)
        if phase == "prefill":
            if not self.prefill_names:
                self.prefill_names = names
            known, sources = self.prefill_names, self.prefill_sources
        else:
            if not self.decode_names:
                self.decode_names = names
            known, sources = self.decode_names, self.decode_sources
        if names != known:
            raise RuntimeError(f"AIC {phase} ops changed between queries: {known} vs {names}")
        total = 0.0
        for name, ms, _energy, source in ops:
            total += ms
            prev = sources.get(name)
            sources[name] = source if prev in (None, source) else "mixed"
        return total, tuple(float(op[1]) for op in ops)

    def values(self, kind: int, b: int, x: int, y: int) -> float:
        """Total ms of a timing key (kind 0 prefill (b, isl, prefix), 1 decode (b, ctx))."""
        return (self.prefill(b, x, y) if kind == 0 else self.decode(b, x))[0]

    # -- disk cache -------------------------------------------------------------
    def _cache_path(self) -> Path:
        return cache_dir() / f"{self.config.digest()}.json"

    def _load_cache(self) -> None:
        path = self._cache_path()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if data.get("config") != self.config.to_json():
            return
        self.prefill_names = tuple(data["prefill_names"])
        self.decode_names = tuple(data["decode_names"])
        self.prefill_sources = dict(data.get("prefill_sources", {}))
        self.decode_sources = dict(data.get("decode_sources", {}))
        for row in data["prefill"]:
            self.prefill_memo[(row[0], row[1], row[2])] = (row[3], tuple(row[4]))
        for row in data["decode"]:
            self.decode_memo[(row[0], row[1])] = (row[2], tuple(row[3]))
        self._saved = (len(self.prefill_memo), len(self.decode_memo))

    def save(self) -> None:
        """Write the memo to the disk cache if it grew (atomically: a temporary file
        renamed over the old one; an unwritable cache folder is skipped)."""
        with self._lock:
            sizes = (len(self.prefill_memo), len(self.decode_memo))
            if sizes == self._saved:
                return
            data = {
                "package": f"{PACKAGE}=={PACKAGE_VERSION}", "config": self.config.to_json(),
                "prefill_names": list(self.prefill_names), "decode_names": list(self.decode_names),
                "prefill_sources": self.prefill_sources, "decode_sources": self.decode_sources,
                # floats as repr: json round-trips f64 exactly
                "prefill": [[*k, v[0], list(v[1])] for k, v in self.prefill_memo.items()],
                "decode": [[*k, v[0], list(v[1])] for k, v in self.decode_memo.items()],
            }
            path = self._cache_path()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(data))
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


def estimate_num_gpu_blocks(config: AicConfig, block_size: int, max_num_batched_tokens: int) -> int:
    """KV capacity of one rank from model + GPU memory, as the reference asks the
    package for it (max_batch_size 1, the backend's memory fraction)."""
    key = (config, block_size, max_num_batched_tokens)
    blocks = _BLOCKS.get(key)
    if blocks is None:
        _package()
        from aiconfigurator_core.sdk import memory
        kw = config._engine_kwargs()
        with _quiet_stderr():
            blocks = int(memory.estimate_num_gpu_blocks(
                config.model, config.system, config.backend, backend_version=config.backend_version,
                scheduler_block_size=block_size, max_num_tokens=max_num_batched_tokens,
                max_batch_size=1, memory_fraction_kind=config.memory_fraction_kind,
                memory_fraction_value=config.memory_fraction_value, **kw))
        if blocks <= 0:
            raise AicError(f"timing_model.config: the database estimates no KV-cache blocks for "
                           f"{config.model} on {config.system} (tp {config.tp}); give num_gpu_blocks")
        _BLOCKS[key] = blocks
    return blocks


# ---------------------------------------------------------------------------------
# Kernel tables
# ---------------------------------------------------------------------------------
LOCAL_TABLE_SLOTS = 4096  # per simulation and config: keys met in the run


def _provide(timing_id: int, kind: int, b: int, x: int, y: int) -> float:
    return _TIMINGS[timing_id].values(kind, b, x, y)


aic_table.set_provider(_provide)


def _known_keys(t: AicTiming) -> tuple[np.ndarray, np.ndarray]:
    """Packed keys and totals of everything the memo holds (cached per memo size)."""
    sizes = (len(t.prefill_memo), len(t.decode_memo))
    cached = getattr(t, "_packed", None)
    if cached is not None and cached[0] == sizes:
        return cached[1], cached[2]
    keys = [aic_table.pack_key_py(aic_table.KIND_PREFILL, *k) for k in t.prefill_memo]
    keys += [aic_table.pack_key_py(aic_table.KIND_DECODE, k[0], k[1], 0) for k in t.decode_memo]
    vals = [v[0] for v in t.prefill_memo.values()] + [v[0] for v in t.decode_memo.values()]
    packed = (np.array(keys, np.int64), np.array(vals, np.float64))
    t._packed = (sizes, *packed)
    return packed


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
def op_latency_evidence(setup, passes) -> dict | None:
    """Per-op latency totals of a replay timed by AIC, from its pass log: each pass's
    timing keys (the ``timed_*`` / prefill columns) looked up op by op and summed in
    pass order, per phase over every worker (the reference's ``power_diagnostics``
    latencies; no energy: the database gives none for these ops). None when no pool
    is timed by AIC."""
    pools = [(setup.rank, "decode" if setup.disaggregated else "aggregated")]
    if setup.disaggregated:
        pools.append((setup.prefill_rank, "prefill"))
    if all(rank.aic is None for rank, _ in pools):
        return None
    cols = {c: passes[c].to_numpy(np.int64) for c in (
        "worker", "num_prefill_requests", "sum_prefill_kv_tokens", "sum_prefill_prompt_tokens",
        "timed_decode_requests", "timed_decode_kv_tokens")}
    order = np.argsort(passes["start_ms"].to_numpy(np.float64), kind="stable")
    totals = {"prefill": {}, "decode": {}}
    sources = {"prefill": {}, "decode": {}}
    for i in order:
        w = cols["worker"][i]
        rank, role = pools[1] if setup.disaggregated and w < setup.prefill_workers else pools[0]
        if rank.aic is None:
            continue
        t = timing(rank.aic)
        b = cols["num_prefill_requests"][i]
        if role != "decode" and b > 0:
            prefix = cols["sum_prefill_kv_tokens"][i]
            isl = prefix + cols["sum_prefill_prompt_tokens"][i]
            if isl // b > prefix // b:
                _, ops = t.prefill(b, isl // b, prefix // b)
                _add(totals["prefill"], t.prefill_names, ops)
                sources["prefill"].update(t.prefill_sources)
        b = cols["timed_decode_requests"][i]
        if role != "prefill" and b > 0:
            _, ops = t.decode(b, cols["timed_decode_kv_tokens"][i] // b)
            _add(totals["decode"], t.decode_names, ops)
            sources["decode"].update(t.decode_sources)
    phases = []
    for name in ("prefill", "decode"):
        ops = [{"name": op, "latency_ms": ms, "source": sources[name].get(op, "")}
               for op, ms in sorted(totals[name].items())]
        phases.append({"name": name, "latency_ms": sum(totals[name].values()), "operations": ops})
    configs = {role: rank.aic for rank, role in pools if rank.aic is not None}
    return {
        "latency_unit": "ms",
        "latency_ms": sum(p["latency_ms"] for p in phases),
        "phases": phases,
        "provider": f"{PACKAGE}=={PACKAGE_VERSION}",
        "configs": {role: c.to_json() for role, c in configs.items()},
    }


def _add(acc: dict, names, values) -> None:
    for name, value in zip(names, values):
        acc[name] = acc.get(name, 0.0) + value
