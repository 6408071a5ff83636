"""Optional kernel features compile only for the batches that use them
(``kernels.features``).

* a plain aggregated vLLM round-robin replay, compiled from an empty cache, caches no
  entry point of the KV router, attention DP, TRT-LLM's capacity policy, AIC timing,
  the tokenization pool, the SGLang host loop and frontend, or speculative decoding;
* ``features_of`` derives each feature from the configuration that reaches it, and
  ``build_state`` puts exactly those on the batch;
* a gate compiles its function only where the feature is on, and a kernel that
  reaches a gate whose feature is off raises instead of running a stub.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from numba import njit

from aisim_fast.config.payload import RankConfig, TokenizationConfig
from aisim_fast.engine.build import build_state
from aisim_fast.engine.simulation import Simulation
from aisim_fast.kernels.features import ON, features_of, gate, union
from aisim_fast.kernels.schema import layout as L
from aisim_fast.trace.workload import load_mooncake
from support.paths import DATA_DIR

TINY_TRACE = DATA_DIR / "cli" / "mooncake_tiny20.jsonl"
# the modules whose functions only a feature's batches reach
FEATURE_MODULES = {"routing/kv_router", "dp/attention_dp", "trtllm/policy", "timing/aic_table",
                   "loop/tokenization", "sglang/host_loop", "sglang/frontend", "spec/vllm_burst",
                   "spec/sampler", "agentic/release"}


def _cached_modules(cache_dir: Path) -> set[str]:
    """Kernel modules (``room/module``) with at least one function in the Numba cache
    folder: an index file ``<module>.<function>-<line>.py311.nbi`` per cached function,
    in a folder named after the module's room (``<room>_<digest of its path>`` under a
    ``NUMBA_CACHE_DIR``)."""
    return {f"{re.sub(r'_[0-9a-f]{40}$', '', p.parent.name)}/{p.name.split('.')[0]}"
            for p in cache_dir.rglob("*.nbi")}


def test_plain_run_compiles_no_optional_feature(tmp_path):
    cache = tmp_path / "cache"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, "-m", "aisim_fast", "replay", str(TINY_TRACE),
                           "--backend", "vllm", "--workers", "2", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    cached = _cached_modules(cache)
    assert {"loop/event_loop", "vllm/core", "kv/block_pool"} <= cached, cached  # it did compile
    assert not cached & FEATURE_MODULES, sorted(cached & FEATURE_MODULES)

    # a second process loads every kernel from the cache and compiles nothing: no new
    # machine code is saved (a kernel whose cache key changed from process to process,
    # e.g. a closure over a dispatcher, would compile and save a new version every run)
    saved = sorted(p.name for p in cache.rglob("*.nbc"))
    again = subprocess.run([sys.executable, "-m", "aisim_fast", "replay", str(TINY_TRACE),
                            "--backend", "vllm", "--workers", "2", "--out", str(tmp_path / "again")],
                           env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in cache.rglob("*.nbc")) == saved
    assert "compiling kernels" not in again.stderr


def _state_features(**sim_fields):
    workload = load_mooncake(TINY_TRACE)
    sim = Simulation(workload=workload, **sim_fields)
    return build_state([sim], 0)[0].features


def test_features_follow_the_configuration():
    assert _state_features(rank=RankConfig(), workers=2) == L.Features()
    assert _state_features(rank=RankConfig(backend="trtllm"), workers=2) == L.Features(trtllm=ON)
    assert _state_features(rank=RankConfig(), workers=2, placement="kv_router") == L.Features(kv_router=ON)
    assert _state_features(rank=RankConfig(), workers=1, dp_size=2) == L.Features(attention_dp=ON)
    assert _state_features(rank=RankConfig(), workers=2, tokenization=TokenizationConfig(2, 1.0, 0.01)) \
        == L.Features(tokenization=ON)
    assert _state_features(rank=RankConfig(aic_nextn=2), workers=2) == L.Features(speculation=ON)
    # the rows decide, whatever the batch: a plain row beside a TRT-LLM one
    cfg_i = np.zeros((2, L.CFG_I_FIELDS), np.int64)
    cfg_i[:, L.CFG_DP_SIZE] = 1
    cfg_i[1, L.CFG_POLICY] = L.POLICY_TRTLLM
    cfg_i[0, L.CFG_TIMING] = L.TIMING_AIC
    assert features_of(cfg_i, L.SIMULATION.new(1)) == L.Features(trtllm=ON, aic=ON)
    assert union(L.Features(kv_router=ON), L.Features(aic=ON)) == L.Features(kv_router=ON, aic=ON)


@njit(_nrt=False)
def _double(x):
    return 2 * x


_double_if_routed = gate("kv_router", _double, np.int64(0))


@njit(_nrt=False)
def _maybe_double(features, x, reach):
    if reach:
        return _double_if_routed(features, x)
    return x


def test_gate_compiles_the_feature_only_where_it_is_on():
    plain, routed = L.Features(), L.Features(kv_router=ON)
    assert _maybe_double(plain, np.int64(3), False) == 3
    assert len(_double.signatures) == 0  # typed behind the gate's stub only
    assert _maybe_double(routed, np.int64(3), True) == 6
    assert len(_double.signatures) == 1
    # one machine code per feature set, both returning the function's type
    sigs = _maybe_double.nopython_signatures
    assert len(sigs) == 2 and all(s.return_type == numba.int64 for s in sigs)


def test_a_feature_set_is_a_kernel_set_of_its_own(tmp_path, capsys, monkeypatch):
    """Its own name (and compile notice): a plain run's set being cached says nothing
    about the same topology with TRT-LLM."""
    from aisim_fast.kernels import jit
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_ANNOUNCED", set())
    plain, trt = L.Features(), L.Features(trtllm=ON, kv_router=ON)
    assert jit.kernel_part("aggregated", plain) == "aggregated"
    assert jit.kernel_part("aggregated", trt) == "aggregated+kv_router+trtllm"
    jit.mark_compiled("aggregated")
    jit.compile_notice(["aggregated", jit.kernel_part("aggregated", trt)])
    err = capsys.readouterr().err
    assert "compiling kernels for aggregated replay with the KV router and TRT-LLM" in err
    assert err.count("aggregated replay") == 1


@njit(_nrt=False)
def _triple(x):
    return 3 * x


_triple_if_routed = gate("kv_router", _triple, np.int64(0))


@njit(_nrt=False)
def _both(features, x, reach):
    if reach:
        return _double_if_routed(features, x) + _triple_if_routed(features, x)
    return x


def test_gates_of_one_shape_compile_under_names_of_their_own():
    """Numba names machine code after the function's qualified name, a per-process
    counter and the argument types: two gates' stubs of one shape, compiled in two
    processes into one cache, once shared a symbol, and a process that loaded both ran
    one for the other (attention-DP replays went wrong after another run's compile)."""
    for features in (L.Features(), L.Features(kv_router=ON)):
        _both(features, np.int64(1), False)
        ir = _both.inspect_llvm(_both.nopython_signatures[-1].args)
        kind = "stub" if features.kv_router is None else "call"
        assert f"test_features_double_if_kv_router_{kind}" in ir.replace("__", "_")
        assert f"test_features_triple_if_kv_router_{kind}" in ir.replace("__", "_")


def test_reaching_a_feature_left_out_raises():
    with pytest.raises(RuntimeError, match="without the kv_router feature"):
        _maybe_double(L.Features(), np.int64(3), True)
