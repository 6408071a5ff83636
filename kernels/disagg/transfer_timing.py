"""The KV transfer delay of a prefill -> decode handoff: the one definition of the
formula, used by the kernels' handoff (``disagg.handoff``) and, on numpy arrays, by
the driver's coordinator (``aisim_fast.protocol.handoff.coordinator``)::

    delay_ms = (tokens * kv_bytes_per_token + state_bytes) / (bandwidth_gb_s * 1e9) * 1000

in float64 and in the reference's operation order (bytes, then divided by bytes
per second, then scaled to ms), so both sides are bit-equal; not quantized. Where the
model is incomplete (``transfer_is_modeled``: bytes per token unknown, bandwidth
unknown, not finite or not above 0) the topology's fixed ``handoff_latency_ms``
applies instead, on both sides by this one rule.
"""

import numpy as np
from numba import njit


def kv_transfer_ms(tokens, kv_bytes_per_token, state_bytes, bandwidth_gb_s):
    """The delay in ms for float64 ``tokens`` (scalars or numpy arrays alike)."""
    return (tokens * kv_bytes_per_token + state_bytes) / (bandwidth_gb_s * 1e9) * 1000.0


def transfer_is_modeled(kv_bytes_per_token, bandwidth_gb_s):
    """Whether the delay formula applies (else the fixed latency): bytes per token known
    (not NaN) and a finite bandwidth above 0 (NaN = unknown). Scalars or numpy arrays."""
    return np.logical_and(np.logical_and(np.logical_not(np.isnan(kv_bytes_per_token)),
                                         np.isfinite(bandwidth_gb_s)), bandwidth_gb_s > 0.0)


# the same functions compiled for the kernels
kv_transfer_ms_kernel = njit(cache=True, _nrt=False, inline="always")(kv_transfer_ms)
transfer_is_modeled_kernel = njit(cache=True, _nrt=False, inline="always")(transfer_is_modeled)
