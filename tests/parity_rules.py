"""The per-request comparison rules of the reference's parity tool
(``reference/parity.py``), shared by the parity tests of the kernels and of the
oracle: how a cell reads as a number, how a row is keyed, what "within" means."""

import math

RTOL = ATOL = 1e-6


def as_number(value):
    """Float of a cell; None for empty / null / NaN."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.strip()
        if value == "" or value.lower() in ("nan", "none", "null"):
            return None
        return float(value)
    out = float(value)
    return None if math.isnan(out) else out


def as_key_part(value):
    """A turn index as a join key: "3", "3.0" and 3 name the same turn."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else (str(int(value)) if value.is_integer() else repr(value))
    text = str(value).strip()
    try:
        num = float(text)
        if num.is_integer():
            return str(int(num))
    except ValueError:
        pass
    return text


def within(gold, cand, rtol=RTOL, atol=ATOL):
    """(within tolerance, abs error, rel error), parity.py's definition; two missing
    values agree, a missing and a present one do not."""
    if gold is None and cand is None:
        return True, 0.0, 0.0
    if gold is None or cand is None:
        return False, math.inf, math.inf
    err = abs(cand - gold)
    rel = err / abs(gold) if gold != 0 else (0.0 if err == 0 else math.inf)
    return (err <= atol or err <= rtol * abs(gold)), err, rel
