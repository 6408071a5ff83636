"""The command line's words: the argument parser of every command, exit codes, flag defaults."""

from __future__ import annotations

import argparse

from aisim_fast.config.payload import ALL_TRACE_FORMATS, PLACEMENTS, SIMULATED_BACKENDS, SYNTHETIC_LOAD_TYPES
from aisim_fast.version import __version__

PROG = "aisim-fast"
EXIT_OK = 0
EXIT_USER_ERROR = 2
EXIT_NO_ANSWER = 3  # size: nothing fits some rate; sweep: no point ran
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
DEFAULT_TRACE_BLOCK_SIZE = 512
DEFAULT_ARRIVAL_SPEEDUP_RATIO = 1.0


class UsageError(Exception):
    """A command-line mistake; reported as one line like every other user error."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and exits; one line keeps every error alike
    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Batch LLM-inference cluster simulator.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    replay = commands.add_parser(
        "replay", help="replay a Mooncake trace on vLLM / TRT-LLM workers (aggregated or "
                       "disaggregated prefill/decode)",
        description="Replay a Mooncake JSONL trace. Either --spec SPEC.json (a reference "
                    "execution payload), --predict-config CONFIG.yaml (a reference predict config) "
                    "or --backend with --workers (aggregated) or "
                    "--prefill-workers and --decode-workers (disaggregated).")
    replay.add_argument("trace", nargs="?", metavar="TRACE",
                        help="Mooncake JSONL trace (without --spec; default: the bundled trace)")
    replay.add_argument("--spec", metavar="SPEC.json",
                        help="reference execution payload {\"spec\": ..., \"traffic\": ...}")
    replay.add_argument("--predict-config", metavar="CONFIG.yaml",
                        help="a reference `aisimulate predict` config (YAML), lowered to the payload "
                             "the reference's CLI writes for it and run as --spec runs a payload")
    replay.add_argument("--trace", dest="trace_flag", metavar="PATH",
                        help="trace file; with --spec or --predict-config it replaces the config's trace")
    replay.add_argument("--backend", choices=SIMULATED_BACKENDS,
                        help="rank scheduler (sglang: its num_gpu_blocks counts pages of block_size "
                             "tokens, default 1, so it is a token count; disaggregated sglang reserves "
                             "the decode slot before the prefill)")
    replay.add_argument("--workers", type=int, metavar="N", help="aggregated workers")
    replay.add_argument("--dp-size", type=int, metavar="N",
                        help="attention-DP ranks per aggregated worker, behind one pass barrier "
                             "(default 1; spec: engine.dp_size)")
    replay.add_argument("--engine-args", metavar="JSON",
                        help="JSON object of reference rank fields, merged over {\"backend\": ...}; "
                             "SGLang knobs in its \"sglang\" block (schedule_policy, max_prefill_tokens, "
                             "chunked_prefill_size, clip_max_new_tokens, schedule_conservativeness)")
    spec_group = replay.add_argument_group(
        "speculative decoding (every decode-capable rank; polynomial or fixed timing)")
    spec_group.add_argument("--speculation", metavar="KIND:N",
                            help="KIND (ngram, mtp, eagle) with N drafts per verify pass, 1..5 "
                                 "(rank aic_nextn); the kind names the scheme, the engine simulates "
                                 "each the same way")
    spec_group.add_argument("--acceptance", metavar="R1,R2,..",
                            help="conditional acceptance rate of each draft (aic_nextn_accept_rates; "
                                 "default the reference's 0.85,0.3,0,...)")
    spec_group.add_argument("--accepted", type=float, metavar="X",
                            help="instead of --acceptance: the expected accepted drafts per pass, "
                                 "lowered to rates as the reference's nextn_accepted is")
    spec_group.add_argument("--speculation-seed", type=int, metavar="N",
                            help="base seed of the ranks' acceptance draws (aic_mtp_seed, default 42)")
    disagg = replay.add_argument_group(
        "disaggregated prefill/decode (instead of --workers / --engine-args)")
    disagg.add_argument("--prefill-workers", type=int, metavar="P", help="prefill pool size")
    disagg.add_argument("--decode-workers", type=int, metavar="D", help="decode pool size")
    disagg.add_argument("--prefill-engine-args", metavar="JSON", help="rank fields of the prefill pool")
    disagg.add_argument("--decode-engine-args", metavar="JSON", help="rank fields of the decode pool")
    disagg.add_argument("--prefill-dp-size", type=int, metavar="N",
                        help="attention-DP ranks per prefill worker (default 1; spec: "
                             "engine.prefill.dp_size)")
    disagg.add_argument("--decode-dp-size", type=int, metavar="N",
                        help="attention-DP ranks per decode worker (default 1; spec: engine.decode.dp_size)")
    disagg.add_argument("--kv-transfer-bandwidth", type=float, metavar="GBPS",
                        help="KV transfer bandwidth, decimal GB/s (0 or unset: --handoff-latency-ms)")
    disagg.add_argument("--kv-bytes-per-token", type=int, metavar="N",
                        help="KV bytes per prompt token moved from prefill to decode")
    disagg.add_argument("--handoff-latency-ms", type=float, metavar="MS",
                        help="transfer delay when bandwidth or bytes per token is unset (default 0)")
    replay.add_argument("--concurrency", type=int, metavar="N",
                        help="closed loop: at most N sessions in flight (default: trace timestamps)")
    replay.add_argument("--trace-format", choices=ALL_TRACE_FORMATS,
                        help="mooncake (default: rows of whole prompts), mooncake-delta (a later "
                             "turn's row carries only its new input; its prompt is the session's history), "
                             "applied_compute_agentic, dynamo, agentic_mooncake (dependency graphs of "
                             "requests), or, beyond the reference, azure (Azure LLM inference CSVs, 2023/2024) "
                             "and burstgpt (BurstGPT CSVs): arrivals and lengths, no shared prefixes")
    replay.add_argument("--agentic-lanes", type=int, metavar="N",
                        help="agentic_mooncake: run N plays at a time, a freed lane taking the next "
                             "(default: every play at its own start)")
    load = replay.add_argument_group(
        "synthetic load (instead of a trace: the reference's generator)",
        "--isl/--osl/--requests with --load; --turns N > 1 makes sessions (then --requests and "
        "--rate count sessions)")
    load.add_argument("--load", choices=SYNTHETIC_LOAD_TYPES,
                      help="concurrency (closed loop of --concurrency), poisson or constant_rate "
                           "(--rate per second), kv_capacity_fraction (--kv-fraction of the requests "
                           "the KV pool holds at once)")
    load.add_argument("--isl", type=int, metavar="TOKENS", help="prompt (new input) tokens per request (turn)")
    load.add_argument("--osl", type=int, metavar="TOKENS", help="output tokens per request (turn)")
    load.add_argument("--requests", type=int, metavar="N", help="requests (sessions with --turns) to send")
    load.add_argument("--rate", type=float, metavar="PER_S", help="arrivals per second (poisson, constant_rate)")
    load.add_argument("--arrival-seed", type=int, metavar="N", help="seed of poisson arrivals (default 42)")
    load.add_argument("--kv-fraction", type=float, metavar="X",
                      help="kv_capacity_fraction: the fraction of the KV pool's requests kept in flight")
    load.add_argument("--cached-prefix", type=int, metavar="TOKENS",
                      help="tokens at the start of every prompt shared by all requests")
    load.add_argument("--turns", type=int, metavar="N", help="turns per session (synthetic sessions)")
    load.add_argument("--shared-prefix-ratio", type=float, metavar="X",
                      help="sessions: the share of each turn's blocks common to its prefix group")
    load.add_argument("--prefix-groups", type=int, metavar="G", help="sessions: prefix groups drawn from")
    load.add_argument("--think-ms", type=float, metavar="MS",
                      help="sessions: delay between a turn's end and the next turn")
    replay.add_argument("--trace-block-size", type=int, metavar="TOKENS",
                        help=f"tokens per trace hash id (default {DEFAULT_TRACE_BLOCK_SIZE})")
    replay.add_argument("--arrival-speedup-ratio", type=float, metavar="RATIO",
                        help="divide trace timestamps and think times by RATIO (default 1.0)")
    replay.add_argument("--max-sim-time-ms", type=float, metavar="MS",
                        help="stop the simulation after its last instant at or before MS of "
                             "simulated time: requests unfinished by then get no row and "
                             "count only as arrivals (spec: max_sim_time_ms)")
    replay.add_argument("--placement", choices=PLACEMENTS,
                        help="worker placement (default round_robin, the reference's; random: "
                             "uniform from a seeded generator)")
    replay.add_argument("--placement-seed", type=int, metavar="N",
                        help="seed of --placement random or kv_router (ties, sampling; default 0)")
    replay.add_argument("--router-json", metavar="JSON",
                        help="kv_router knobs: overlap_score_credit, prefill_load_scale, "
                             "router_temperature, pin_to_trace_worker (Dynamo's names)")
    _add_aic_flags(replay)
    replay.add_argument("--sla", metavar="TERM=VALUE,..",
                        help="judge the run: SLA terms as size takes them (ttft_ms, itl_ms, e2e_ms per "
                             "request, replacing the spec's sla: goodput keys; <metric>_<stat>_ms "
                             "bounds; goodput, min_goodput_rps, strict); summary.json's sla_verdict")
    replay.add_argument("--out", required=True, metavar="DIR", help="output folder")
    replay.add_argument("--overwrite", action="store_true",
                        help="replace an existing output folder of an earlier run")
    replay.add_argument("--no-passes", action="store_true",
                        help="do not record forward passes (no passes.parquet)")
    replay.add_argument("--performance-diagnostics", action="store_true",
                        help="summary.json's performance_diagnostics: per op, its latency and speed of "
                             "light summed over the passes (op-level timing; the payload's "
                             "capture_performance_diagnostics)")
    replay.add_argument("--events", action="store_true",
                        help="also write kv_events.parquet (KV Stored / Removed facts), "
                             "engine_events.parquet (admissions, preemptions, finishes) and "
                             "pressure_events.parquet")
    replay.add_argument("--kv-events", action="store_true",
                        help="also write kv_events.parquet: the KV events each worker emits "
                             "(Stored / Removed, one row per block: event id, visibility time, "
                             "block, parent and tokens hashes; the reference's event stream; "
                             "SGLang: its radix cache's pages); emit_kv_events: true in a spec's "
                             "rank does the same")
    replay.add_argument("--pressure-events", action="store_true",
                        help="also write pressure_events.parquet: one row per vLLM preemption "
                             "or SGLang retraction (worker, request, running / waiting requests "
                             "and active blocks before and after; any backend)")
    replay.add_argument("--quiet", action="store_true",
                        help="no progress line (shown on stderr for runs longer than a few seconds)")
    replay.add_argument("--output-events", action="store_true",
                        help="also write output_events.parquet: one row per output token "
                             "(request, worker, pass end time, token index)")
    models = commands.add_parser(
        "models", help="models the installed AIC perf database covers (extra aisim-fast[aic])",
        description="List the model ids --model and timing_model.config.model accept.")
    models.add_argument("--grep", metavar="TEXT", help="only ids containing TEXT (case-insensitive)")
    systems = commands.add_parser(
        "systems", help="GPU systems of the installed AIC perf database, with framework versions",
        description="List the GPU systems --system accepts and, per framework, the versions "
                    "of its perf data (current first).")
    systems.add_argument("--backend", choices=("vllm", "trtllm", "sglang"),
                         help="only this framework's versions")
    warmup = commands.add_parser(
        "warmup", help="compile the kernels into the on-disk cache (for images and CI)",
        description="Compile (or load from the cache) the kernels a replay uses, by running "
                    "a few requests of the bundled trace on every backend, so that later runs "
                    "start at once.")
    warmup.add_argument("--topology", choices=("aggregated", "disaggregated", "sglang", "sglang_disaggregated", "rank", "all"), default="all",
                        help="which kernels: a replay topology, rank (the rank protocol API), or all (every replay topology; default)")
    sweep = commands.add_parser(
        "sweep", help="run many configurations of one base payload (grid, zip, random axes)",
        description="Run a sweep spec (YAML or JSON; see aisim_fast/studies/sweeps.py and the README): "
                    "points.parquet (one row per point), requests/point=<id>/part-0.parquet, "
                    "manifest.json. An interrupted sweep keeps its finished points; --resume "
                    "runs the rest.")
    sweep.add_argument("sweep_spec", metavar="SPEC", help="sweep spec file (.yaml / .yml / .json)")
    sweep.add_argument("--out", required=True, metavar="DIR", help="output folder")
    sweep.add_argument("--jobs", type=int, default=1, metavar="N",
                       help="local worker processes (default 1: this process)")
    sweep.add_argument("--scheduler", metavar="ADDRESS",
                       help="run the batches on this Dask distributed scheduler")
    sweep.add_argument("--batch-size", type=int, metavar="N",
                       help="points per kernel batch (default: the spec's batch_size, else 64)")
    sweep.add_argument("--resume", action="store_true", help="run only the points DIR lacks")
    sweep.add_argument("--retry-failed", action="store_true",
                       help="with --resume: also rerun the points that failed (a trace since fixed, ...)")
    sweep.add_argument("--overwrite", action="store_true", help="replace an earlier sweep in DIR")
    sweep.add_argument("--no-requests", action="store_true",
                       help="do not write the per-request dataset")
    sweep.add_argument("--quiet", action="store_true", help="no progress output")
    sweep.add_argument("--gpu-prices", metavar="FILE",
                       help="USD per GPU-hour by GPU system (YAML / JSON) for the cost_*_usd columns "
                            "(the spec's prices: key; default: the built-in table)")
    _add_aic_flags(sweep)
    size = commands.add_parser(
        "size", help="find the fewest GPUs that meet an SLA at a trace's load",
        description="Size a deployment: the cheapest candidate (workers or prefill/decode split, "
                    "and the --backend / --tp / --max-num-seqs / --max-num-batched-tokens choices) "
                    "whose replay meets the SLA, by batched sweeps: every candidate when the space "
                    "is small, else a coarse grid then every cheaper candidate near its best point. "
                    "The base is --spec (JSON or YAML payload), --predict-config, or the replay "
                    "flags. Exit 0: an answer for every rate; 3: nothing fits some rate (the "
                    "closest candidate and the failed SLA terms are printed); 2: bad input.")
    size.add_argument("trace", nargs="?", metavar="TRACE",
                      help="Mooncake JSONL trace (without --spec; default: the bundled trace)")
    size.add_argument("--spec", metavar="SPEC", help="base execution payload (.json, .yaml)")
    size.add_argument("--predict-config", metavar="CONFIG.yaml", help="base as a reference predict config")
    size.add_argument("--trace", dest="trace_flag", metavar="PATH", help="replace the base's trace")
    size.add_argument("--backend", metavar="NAME[,NAME..]",
                      help=f"rank scheduler(s) to choose from ({', '.join(SIMULATED_BACKENDS)}); "
                           "without --spec the first is the base's")
    size.add_argument("--engine-args", metavar="JSON", help="reference rank fields of the base (as replay)")
    size.add_argument("--disaggregated", action="store_true",
                      help="without --spec: size prefill / decode pools (--prefill-engine-args, "
                           "--decode-engine-args and the transfer flags as replay)")
    size.add_argument("--prefill-engine-args", metavar="JSON", help="rank fields of the prefill pool")
    size.add_argument("--decode-engine-args", metavar="JSON", help="rank fields of the decode pool")
    size.add_argument("--kv-transfer-bandwidth", type=float, metavar="GBPS", help="as replay")
    size.add_argument("--kv-bytes-per-token", type=int, metavar="N", help="as replay")
    size.add_argument("--handoff-latency-ms", type=float, metavar="MS", help="as replay")
    size.add_argument("--concurrency", type=int, metavar="N", help="closed loop, as replay")
    size.add_argument("--trace-block-size", type=int, metavar="TOKENS", help="as replay")
    size.add_argument("--placement", choices=PLACEMENTS, help="as replay")
    size.add_argument("--placement-seed", type=int, metavar="N", help="as replay")
    size.add_argument("--router-json", metavar="JSON", help="as replay")
    size.add_argument("--max-sim-time-ms", type=float, metavar="MS", help="as replay")
    size.add_argument("--sla", required=True, metavar="TERM=VALUE,..",
                      help="SLA terms: ttft_ms, itl_ms, e2e_ms (per request, judged by --goodput), "
                           "<ttft|tpot|itl|e2e>_<mean|p50|p75|p90|p95|p99|max>_ms, goodput, "
                           "min_goodput_rps, strict (see the README's SLA section)")
    size.add_argument("--goodput", type=float, metavar="F",
                      help="fraction of requests that must meet the per-request bounds (default 0.99)")
    size.add_argument("--max-workers", type=int, default=64, metavar="N",
                      help="largest worker count (both pools together) to consider (default 64)")
    size.add_argument("--max-gpus", type=int, metavar="N", help="largest GPU count to consider")
    size.add_argument("--max-num-seqs", metavar="N[,N..]", help="max_num_seqs choices")
    size.add_argument("--prefill-system", metavar="GPU[,GPU..]",
                      help="GPU system choices of the prefill pool (disaggregated, op-level timing)")
    size.add_argument("--decode-system", metavar="GPU[,GPU..]",
                      help="GPU system choices of the decode pool (disaggregated, op-level timing)")
    size.add_argument("--objective", choices=("gpus", "cost"), default="gpus",
                      help="fewest GPUs (default) or the cheapest fleet per hour at --gpu-prices")
    size.add_argument("--gpu-prices", metavar="FILE",
                      help="USD per GPU-hour by GPU system (YAML / JSON), over the built-in table")
    size.add_argument("--max-num-batched-tokens", metavar="N[,N..]", help="max_num_batched_tokens choices")
    size.add_argument("--speculation", dest="speculation_choices", metavar="CHOICE[,CHOICE..]",
                      help="speculative decoding choices (beyond the reference): none, KIND:N, KIND:N@X "
                           "(X accepted drafts expected), KIND:N@R1/R2/.. (per-draft rates); KIND ngram, "
                           "mtp or eagle, N 1..5 drafts")
    size.add_argument("--rates", metavar="R1,R2,..",
                      help="size for these offered loads, one answer each: multiples of the base's (a "
                           "trace's arrivals sped up; a synthetic poisson or constant-rate load's rate)")
    size.add_argument("--confidence", type=float, metavar="F",
                      help="judge each candidate over --runs seeded variants; it fits when at least "
                           "the fraction F of them meet the SLA")
    size.add_argument("--runs", type=int, default=8, metavar="N", help="variants per candidate (default 8)")
    size.add_argument("--timing-perturbation-pct", type=float, default=0.0, metavar="K",
                      help="with --confidence: scale each variant's pass times by one factor drawn "
                           "in [1-K%%, 1+K%%] (default 0)")
    size.add_argument("--seed", type=int, default=0, metavar="S",
                      help="with --confidence: the first variant's seed (placement, perturbation)")
    size.add_argument("--window-s", type=float, metavar="S",
                      help="size each window of S simulated seconds of the trace on its own: GPUs "
                           "over time (replicas.parquet, replicas.png), peak, mean, autoscaled "
                           "GPU-hours")
    size.add_argument("--search", choices=("auto", "exhaustive", "pruned"), default="auto",
                      help="every candidate, or the coarse-then-fine search (default auto: every "
                           "candidate when there are at most 48)")
    size.add_argument("--jobs", type=int, default=1, metavar="N", help="local worker processes")
    size.add_argument("--out", metavar="DIR", help="write sizing.parquet (every candidate, its verdict) "
                                                  "and answer.json")
    size.add_argument("--overwrite", action="store_true", help="replace an earlier sizing in DIR")
    size.add_argument("--quiet", action="store_true", help="no progress output")
    _add_aic_flags(size, tp_choices=True)
    plot = commands.add_parser(
        "plot", help="PNG plots of a sweep, sizing or replay folder (DIR/plots/; DIR/report.html)",
        description="A sweep folder: Pareto fronts of throughput per GPU against throughput per "
                    "user and against TTFT p90 (over the SLA-feasible points, with the SLA's TTFT "
                    "bound), and DIR/report.html. A sizing folder (size --out): every candidate "
                    "against the SLA, and DIR/report.html. A replay folder: TTFT/TPOT CDFs and "
                    "throughput, queue depth and KV use over time, a panel per prefill / decode pool.")
    plot.add_argument("folder", metavar="DIR", help="output folder of aisim-fast sweep, size or replay")
    plot.add_argument("--color-by", metavar="COLUMN",
                      help="colour a sweep's points by this column of points.parquet (default: the "
                           "first varied one)")
    return parser


def _add_aic_flags(parser, tp_choices: bool = False) -> None:
    aic_flags = parser.add_argument_group(
        "op-level timing (AIC)", "time passes for a model on a GPU system from the perf database "
        "of the optional extra aisim-fast[aic] (with --spec: replaces every pool's timing)")
    aic_flags.add_argument("--model", metavar="ID", help="model, e.g. Qwen/Qwen3-32B ('aisim-fast models')")
    aic_flags.add_argument("--system", metavar="GPU", help="GPU system, e.g. h200_sxm ('aisim-fast systems')")
    if tp_choices:
        aic_flags.add_argument("--tp", metavar="N[,N..]", help="tensor parallel size choices (GPUs per worker)")
    else:
        aic_flags.add_argument("--tp", type=int, metavar="N", help="tensor parallel size (GPUs per worker)")
    aic_flags.add_argument("--backend-version", metavar="V",
                           help="framework version of the perf data (default: the database's current)")


def aic_flags(args) -> dict:
    """The given --model / --system / --tp / --backend-version, by set_aic_timing name."""
    return {k: getattr(args, k) for k in ("model", "system", "tp", "backend_version")
            if getattr(args, k, None) is not None}


def int_choices(text: str | None, flag: str) -> tuple[int, ...]:
    """``1,2,4`` -> (1, 2, 4); every value an integer >= 1."""
    if text is None:
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag}: integers separated by commas, got {text!r}") from None
    bad = [v for v in values if v < 1]
    if bad:
        raise UsageError(f"{flag}: every value must be >= 1, got {bad[0]}")
    return values
