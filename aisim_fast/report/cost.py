"""What a deployment costs: a price per GPU-hour for each GPU system, and a run's cost
per hour and per million input / output tokens.

Beyond the reference (it reports no cost): the columns exist only where asked for or
where a sweep or sizing adds them, are named ``cost_*_usd``, and change nothing else.

A pool's GPU system is its op-level (AIC) timing's ``system``; a pool timed otherwise has
none and is priced at the table's ``default`` entry when the table has one (else its
cost is unknown: NaN). The built-in table holds on-demand prices of the specialty GPU
clouds, not hyperscalers' (which run 1.5-2x higher) and not reserved capacity (30-50 %
lower); give your own with a price file (YAML or JSON ``{system: usd_per_gpu_hour}``,
merged over the defaults).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from aisim_fast.config.payload import ConfigError, read_config_text

# USD per GPU-hour, on demand. Sources: the Mercatus GPU pricing guide (May 2026,
# "specialty" provider tier: A100 80GB $1.10-1.50, H100 SXM5 $2.50-3.50, H200 SXM5
# $3.50-4.50; the midpoints) and packet.ai's B200 SXM bare-metal list price ($5.60/h, 2026).
DEFAULT_PRICES_USD_PER_GPU_HOUR = {
    "a100_sxm": 1.30,
    "h100_sxm": 3.00,
    "h200_sxm": 4.00,
    "b200_sxm": 5.60,
}
PRICE_SOURCE = ("on-demand, specialty GPU clouds: Mercatus GPU pricing guide (May 2026) tier "
                "midpoints for A100 80GB / H100 SXM5 / H200 SXM5, packet.ai B200 SXM bare metal")
COST_COLUMNS = ("cost_per_hour_usd", "cost_per_million_input_tokens_usd",
                "cost_per_million_output_tokens_usd")
S_PER_HOUR = 3600.0


def load_prices(source: str | Path | dict | None = None) -> dict:
    """The price table: the defaults, with a file's or a mapping's entries over them."""
    prices = dict(DEFAULT_PRICES_USD_PER_GPU_HOUR)
    if source is None:
        return prices
    where = "prices"
    if isinstance(source, (str, Path)):
        path = Path(source)
        where = str(path)
        text = read_config_text(path, "price file")
        try:
            if path.suffix.lower() in (".yaml", ".yml"):
                import yaml

                given = yaml.safe_load(text)
            else:
                given = json.loads(text)
        except Exception as exc:  # noqa: BLE001 - yaml and json raise their own types
            raise ConfigError(f"{path}: not a valid price file ({exc})") from None
    else:
        given = source
    if not isinstance(given, dict):
        raise ConfigError(f"{where}: must map GPU system names to USD per GPU-hour")
    for system, price in given.items():
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not math.isfinite(price) \
                or price < 0:
            raise ConfigError(f"{where}.{system}: must be a price >= 0 in USD per GPU-hour, got {price!r}")
        prices[str(system)] = float(price)
    return prices


def pool_system(rank) -> str | None:
    """The GPU system of a pool's rank (its AIC timing's), None when not timed by AIC."""
    return rank.aic.system if getattr(rank, "aic", None) is not None else None


def price_of(system: str | None, prices: dict) -> float:
    if system is not None and system in prices:
        return prices[system]
    return prices.get("default", math.nan)


def hourly_cost_usd(setup, prices: dict) -> float:
    """USD per hour of a deployment: every pool's GPUs at its system's price."""
    cost = setup.workers * setup.gpus_per_worker * price_of(pool_system(setup.rank), prices)
    if setup.disaggregated:
        cost += (setup.prefill_workers * setup.prefill_gpus_per_worker
                 * price_of(pool_system(setup.prefill_rank), prices))
    return cost


def run_cost(setup, summary: dict, prices: dict) -> dict:
    """The ``cost_*_usd`` columns of one run (NaN where a pool's price or the run's
    throughput is unknown)."""
    per_hour = hourly_cost_usd(setup, prices)

    def per_million(tokens_per_s: float) -> float:
        return per_hour / (tokens_per_s * S_PER_HOUR) * 1e6 if tokens_per_s > 0 else math.nan

    return {"cost_per_hour_usd": per_hour,
            "cost_per_million_input_tokens_usd": per_million(summary.get("input_throughput_tok_s", 0.0)),
            "cost_per_million_output_tokens_usd": per_million(summary.get("output_throughput_tok_s", 0.0))}
