"""Speculative decoding as the command line gives it: ``KIND:N`` drafts per verify pass
with their acceptance, lowered to the rank fields the reference's payload carries
(``aic_nextn``, ``aic_nextn_accept_rates``, ``aic_mtp_seed``; checked by
``config.payload.parse_speculation``). One spelling for ``replay --speculation`` and
``size --speculation`` choices:

* ``none``: no speculation;
* ``KIND:N``: N drafts (1..5) at the reference's default rates (0.85, 0.3, 0, ...);
* ``KIND:N@X``: X accepted drafts expected per pass, lowered as the reference lowers
  ``nextn_accepted`` (1 per whole draft, the fraction next, then 0);
* ``KIND:N@R1/R2/..``: the conditional acceptance rate of each draft.

KIND (ngram, mtp, eagle) names the scheme; under polynomial or fixed timing the engine
simulates each the same way (the reference prices drafts only through AIC timing).
"""

from __future__ import annotations

import math

from aisim_fast.config.payload import ConfigError

KINDS = ("ngram", "mtp", "eagle")


def rates_for_expected(nextn: int, accepted: float, where: str = "accepted") -> str:
    """The conditional rates the reference lowers an expected accepted-draft count to
    (``nextn_accepted``, ``expected_accepted_tokens``): 1 for each whole draft, the
    fraction for the next, 0 after; as its comma list (``.17g``)."""
    if isinstance(accepted, bool) or not isinstance(accepted, (int, float)) or not math.isfinite(accepted) \
            or not 0 <= accepted <= nextn:
        raise ConfigError(f"{where}: must be a number in [0, {nextn}] (accepted drafts of {nextn}), "
                          f"got {accepted!r}")
    whole = int(accepted)
    rates = [1.0] * whole
    if len(rates) < nextn:
        rates.append(accepted - whole)
    rates += [0.0] * (nextn - len(rates))
    return ",".join(format(rate, ".17g") for rate in rates)


def rank_fields(choice: str, where: str = "--speculation") -> dict:
    """The rank fields of one ``none`` / ``KIND:N[@X | @R1/R2/..]`` choice."""
    if choice == "none":
        return {}
    head, _, acceptance = choice.partition("@")
    kind, _, count = head.partition(":")
    if kind not in KINDS or not count.isdigit() or not 1 <= int(count) <= 5:
        raise ConfigError(f"{where}: must be none or KIND:N[@X|@R1/R2/..] with KIND one of "
                          f"{', '.join(KINDS)} and N in 1..5, got {choice!r}")
    fields = {"aic_nextn": int(count)}
    if "/" in acceptance:
        fields["aic_nextn_accept_rates"] = acceptance.replace("/", ",")
    elif acceptance:
        try:
            accepted = float(acceptance)
        except ValueError:
            raise ConfigError(f"{where}: {acceptance!r} after @ is neither an accepted-draft count nor "
                              "rates R1/R2/..") from None
        fields["aic_nextn_accept_rates"] = rates_for_expected(int(count), accepted, where)
    return fields
