"""The KV transfer delay of a prefill -> decode handoff: the one definition of the
formula, used by the kernels' handoff (``disagg.handoff``) and, on numpy arrays, by
the driver's coordinator (``aisim_fast.protocol.handoff.coordinator``)::

    delay_ms = (tokens * kv_bytes_per_token + state_bytes) / (bandwidth_gb_s * 1e9) * 1000

in float64 and in the reference's operation order (bytes, then divided by bytes
per second, then scaled to ms), so both sides are bit-equal; not quantized.
"""

from numba import njit


def kv_transfer_ms(tokens, kv_bytes_per_token, state_bytes, bandwidth_gb_s):
    """The delay in ms for float64 ``tokens`` (scalars or numpy arrays alike)."""
    return (tokens * kv_bytes_per_token + state_bytes) / (bandwidth_gb_s * 1e9) * 1000.0


# the same function compiled for the kernels
kv_transfer_ms_kernel = njit(cache=True, _nrt=False, inline="always")(kv_transfer_ms)
