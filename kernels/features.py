"""Optional kernel features, compiled only for the batches that use them.

A batch's ``RankConfig.features`` (a ``schema.layout.Features``) says, by the *type* of each field,
which optional code its kernels carry: ``None`` leaves the feature's code out, ``ON``
puts it in. Numba compiles a kernel once per argument types, so a plain batch (every
field None) and a batch with, say, the KV router get separate machine code, and the
plain one never types, compiles or loads the router's functions.

A call into a feature goes through its gate (``gate(name, fn, default)``): the gate
takes the ``Features`` value first, then ``fn``'s own arguments. Where the feature
is on, it is a plain call of ``fn``; where it is off, it compiles to a stub that
raises (a batch whose features leave out code its configuration reaches is a driver
bug, never a silent wrong result) and otherwise has ``default``'s type, so the
caller types the same either way.

``features_of`` derives a batch's features from its configuration arrays: the one
place that decides them (the driver calls it where it lowers a batch).
"""

import numpy as np
from numba import types
from numba.extending import overload

from aisim_fast.kernels.schema.layout import (CFG_DP_SIZE, CFG_POLICY, CFG_SG_HOST_LOOP, CFG_SPEC_NEXTN,
                                               CFG_TIMING, CFG_TOK_SERVERS,
                                               PLACE_KV_ROUTER, POLICY_TRTLLM, SM_AGENTIC, SM_FRONTEND, SM_PLACEMENT,
                                               TIMING_AIC,
                                               Features)

ON = True  # the value of a feature that is compiled in

FEATURE_NAMES = Features._fields


def features_of(cfg_i64: np.ndarray, sims_i64: np.ndarray) -> Features:
    """The features a batch with these worker (``cfg.i64``) and simulation
    (``sims.i64``) rows reaches."""
    def on(flag) -> object:
        return ON if bool(flag) else None
    return Features(
        kv_router=on(len(sims_i64) > 0 and np.any(sims_i64[:, SM_PLACEMENT] == PLACE_KV_ROUTER)),
        attention_dp=on(len(cfg_i64) > 0 and np.any(cfg_i64[:, CFG_DP_SIZE] > 1)),
        trtllm=on(len(cfg_i64) > 0 and np.any(cfg_i64[:, CFG_POLICY] == POLICY_TRTLLM)),
        aic=on(len(cfg_i64) > 0 and np.any(cfg_i64[:, CFG_TIMING] == TIMING_AIC)),
        tokenization=on(len(cfg_i64) > 0 and np.any(cfg_i64[:, CFG_TOK_SERVERS] > 0)),
        sglang_host_loop=on(len(cfg_i64) > 0 and np.any(cfg_i64[:, CFG_SG_HOST_LOOP] != 0)),
        sglang_frontend=on(len(sims_i64) > 0 and np.any(sims_i64[:, SM_FRONTEND] != 0)),
        speculation=on(len(cfg_i64) > 0 and np.any(cfg_i64[:, CFG_SPEC_NEXTN] > 0)),
        agentic=on(len(sims_i64) > 0 and np.any(sims_i64[:, SM_AGENTIC] != 0)),
    )


def union(a: Features, b: Features) -> Features:
    """Features with every feature either has."""
    return Features(*(ON if x is not None or y is not None else None for x, y in zip(a, b)))


# The stubs' condition: a value Numba's untyped passes cannot fold (they would drop the
# return after an unconditional raise, and the stub would type as returning nothing)
_TRAP = np.ones(1, np.int8)


def _is_on(ft_type, name: str) -> bool:
    field = ft_type.types[ft_type.fields.index(name)]
    return not isinstance(field, (types.NoneType, types.Omitted))


def _named(function, name: str):
    """``function`` under a name of its own: Numba names machine code after a
    function's module and qualified name plus a per-process counter and the argument
    types, so two gates' stubs of one shape compiled in different processes would share
    a symbol, and a process loading both from the cache would run one for the other."""
    function.__name__ = function.__qualname__ = name
    function.__module__ = __name__
    return function


def _forwarder(fn, n_args: int, name: str):
    """``call(features, *args) -> fn(*args)``, the arguments spelled out: Numba cannot
    call an ``inline="always"`` function with ``*args``."""
    spelled = ", ".join(f"args[{i}]" for i in range(n_args))
    scope = {"fn": fn}
    exec(f"def call(features, *args):\n    return fn({spelled})\n", scope)
    return _named(scope["call"], name)


def gate(name: str, fn, default=None):
    """``fn`` behind the feature ``name``: call the result as ``g(features, *args)``.
    ``default`` (a value of ``fn``'s return type; None for a function returning
    nothing) types the stub of a batch without the feature."""
    assert name in FEATURE_NAMES, name
    message = f"kernel compiled without the {name} feature reached it (features_of)"
    # unique per gate (see _named): the function's module (its room and file: two rooms
    # may hold files of one name), its name, and the feature
    module = fn.__module__.removeprefix(__package__ + ".").replace(".", "_")
    tag = f"{module}_{fn.__name__}_if_{name}"

    def gated(features, *args):
        raise NotImplementedError("a kernel-only function")

    gated.__name__ = gated.__qualname__ = tag

    @overload(gated, jit_options={"_nrt": False})
    def _typed(features, *args):
        if _is_on(features, name):
            return _forwarder(fn, len(args), f"{tag}_call{len(args)}")
        if default is None:
            def stub_none(features, *args):
                if _TRAP[0]:
                    raise RuntimeError(message)
            return _named(stub_none, f"{tag}_stub")

        def stub(features, *args):
            if _TRAP[0]:
                raise RuntimeError(message)
            return default
        return _named(stub, f"{tag}_stub")

    return gated
