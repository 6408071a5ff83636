"""The bounds-checked CI lane (marker ``bounds``): the tests ``.ci/run`` runs a second
time with every array index of the kernels checked (``NUMBA_BOUNDSCHECK=1``, in a kernel
cache of its own so no unchecked machine code is reused).

It covers aggregated and disaggregated replays of vLLM, TRT-LLM and SGLang on small
cases, every simulation status, placement, stepping, growth between steps, KV event
logs and a rank driven by hand: whole test functions carry ``@pytest.mark.bounds``,
and parametrized ones mark the cases named here through ``lane``."""

import pytest

BOUNDS = pytest.mark.bounds

# golden and reference-artifact cases small enough to run bounds-checked
BOUNDS_CASES = frozenset({
    "tiny20_vllm_agg1", "sess200_vllm_agg2", "sess200_vllm_agg2_conc6",  # vLLM goldens
    "trt_tiny", "trt_tiny2", "dm1",                                     # TRT-LLM, disaggregated
    "tiny20", "kvp16", "sess32",                                        # per-token artifacts
})
SGLANG_REFERENCE_PREFIX = "sx-"  # every SGLang reference run (tests/data/golden_sglang/sx-*)


def _case_id(param) -> str:
    if isinstance(param, type(pytest.param(None))):
        return param.id if param.id is not None else str(param.values[0])
    if isinstance(param, tuple):
        return str(param[0])
    return str(param)


def lane(cases):
    """``cases`` (a parametrize list) with the bounds-checked lane's cases marked."""
    out = []
    for case in cases:
        name = _case_id(case)
        if name in BOUNDS_CASES or name.startswith(SGLANG_REFERENCE_PREFIX):
            if isinstance(case, type(pytest.param(None))):
                case = pytest.param(*case.values, id=case.id, marks=[*case.marks, BOUNDS])
            else:
                case = pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=BOUNDS)
        out.append(case)
    return out
