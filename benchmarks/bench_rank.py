"""Cost of the rank protocol API (``aisim_fast.protocol.rank``) per command and per pass, for
one rank driven by hand and for a group of ranks stepped together.

    python benchmarks/bench_rank.py [--requests 200] [--ranks 1000] [--rounds 3]

* single rank: ``--requests`` Submits (one request each, 512-token prompts, 64
  outputs), then passes (start + complete) until every request finished, then a
  CancelRequest of an unknown id (the cheapest command) - microseconds per Submit,
  per pass and per Cancel;
* decode rank: ``--requests`` ReserveDestination (reserved at once) then as many
  ActivateDestination - microseconds per command;
* long-lived rank (``--long N``, 0 = skip): the cost of a Submit once N requests
  were submitted before (a rank's state grows with every request it took);
* group: ``--ranks`` ranks in one ``RankGroup``; one Submit per rank in one batched
  call, then batched passes until all finished - microseconds per rank-pass and per
  rank-submit.

The rounds alternate single and group (the machine is shared); best of the rounds.
Kernels are compiled before timing.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _requests(n: int, prompt: int, out: int, seed: int = 0):
    from aisim_fast.protocol.types import Request
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50_000, prompt // 2).tolist()  # half of each prompt is a shared prefix
    return [Request(f"r{i}", shared + rng.integers(0, 50_000, prompt - len(shared)).tolist(), out)
            for i in range(n)]


CONFIG = {"backend": "vllm", "block_size": 16, "num_gpu_blocks": 65536, "max_num_seqs": 256,
          "max_num_batched_tokens": 8192}


def single_rank(n_requests: int) -> dict:
    from aisim_fast.protocol.rank import Rank
    from aisim_fast.protocol.types import CancelRequest, Submit
    rank = Rank(CONFIG)
    reqs = _requests(n_requests, 512, 64)
    t0 = time.perf_counter()
    for req in reqs:
        rank.apply(Submit(req), 0.0)
    t_submit = time.perf_counter() - t0
    now, passes = 0.0, 0
    t0 = time.perf_counter()
    while rank.has_work:
        start = rank.start_pass(now)
        rank.complete_pass()
        now = start.end_ms
        passes += 1
    t_pass = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(200):
        rank.apply(CancelRequest("unknown"), now)
    t_cancel = (time.perf_counter() - t0) / 200
    return {"submit_us": 1e6 * t_submit / n_requests, "pass_us": 1e6 * t_pass / passes,
            "cancel_us": 1e6 * t_cancel, "passes": passes}


def decode_rank(n_requests: int) -> dict:
    from aisim_fast.protocol.rank import Rank
    from aisim_fast.protocol.types import ActivateDestination, ReserveDestination
    rank = Rank({**CONFIG, "worker_type": "decode"})
    reqs = _requests(n_requests, 512, 64, seed=1)
    t0 = time.perf_counter()
    for req in reqs:
        rank.apply(ReserveDestination(req.request_id, req), 0.0)
    t_reserve = time.perf_counter() - t0
    t0 = time.perf_counter()
    for req in reqs:
        rank.apply(ActivateDestination(req.request_id), 1.0)
    t_activate = time.perf_counter() - t0
    return {"reserve_us": 1e6 * t_reserve / n_requests, "activate_us": 1e6 * t_activate / n_requests}


def long_lived(n_before: int, n_timed: int = 200) -> dict:
    from aisim_fast.protocol.rank import Rank
    from aisim_fast.protocol.types import Submit
    rank = Rank(CONFIG)
    for req in _requests(n_before, 512, 64, seed=2):
        rank.apply(Submit(req), 0.0)
    reqs = [r.__class__(f"late{i}", r.tokens, r.max_output_tokens) for i, r in enumerate(_requests(n_timed, 512, 64, 3))]
    t0 = time.perf_counter()
    for req in reqs:
        rank.apply(Submit(req), 0.0)
    return {"submit_us_after": 1e6 * (time.perf_counter() - t0) / n_timed}


def group(n_ranks: int) -> dict:
    from aisim_fast.protocol.rank import RankGroup
    g = RankGroup([CONFIG] * n_ranks)
    reqs = _requests(n_ranks, 512, 64)
    ranks = list(range(n_ranks))
    t0 = time.perf_counter()
    g.submit(ranks, reqs, 0.0)
    t_submit = time.perf_counter() - t0
    now = np.zeros(n_ranks)
    rank_passes = 0
    t0 = time.perf_counter()
    live = ranks
    while live:
        starts = g.start_passes(live, now[live])
        g.complete_passes([r for r, s in zip(live, starts) if s is not None])
        for r, s in zip(live, starts):
            if s is not None:
                now[r] = s.end_ms
        rank_passes += sum(s is not None for s in starts)
        live = [r for r in live if g.has_work(r)]
    t_pass = time.perf_counter() - t0
    return {"submit_us_per_rank": 1e6 * t_submit / n_ranks, "pass_us_per_rank_pass": 1e6 * t_pass / rank_passes,
            "rank_passes": rank_passes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--ranks", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--long", type=int, default=0, help="also time a Submit after this many (0: skip)")
    args = p.parse_args(argv)
    single_rank(4)
    decode_rank(4)
    group(4)  # compile / load the kernels
    best_single, best_decode, best_group = None, None, None
    for k in range(args.rounds):
        s = single_rank(args.requests)
        d = decode_rank(args.requests)
        g = group(args.ranks)
        print(f"round {k + 1}: single {s}; decode {d}; group {g}", flush=True)
        best_single = s if best_single is None else {key: min(best_single[key], s[key]) for key in s}
        best_decode = d if best_decode is None else {key: min(best_decode[key], d[key]) for key in d}
        best_group = g if best_group is None else {key: min(best_group[key], g[key]) for key in g}
    print(f"\nsingle rank, {args.requests} requests: Submit {best_single['submit_us']:.0f} us, "
          f"pass (start + complete) {best_single['pass_us']:.0f} us over {best_single['passes']} passes, "
          f"CancelRequest (Noop) {best_single['cancel_us']:.0f} us")
    if args.long:
        best_long = min(long_lived(args.long)["submit_us_after"] for _ in range(args.rounds))
        print(f"one rank after {args.long} Submits: Submit {best_long:.0f} us")
    print(f"decode rank, {args.requests} destinations: ReserveDestination {best_decode['reserve_us']:.0f} us, "
          f"ActivateDestination {best_decode['activate_us']:.0f} us")
    print(f"group of {args.ranks} ranks: Submit {best_group['submit_us_per_rank']:.0f} us per rank "
          f"(one batched call), pass {best_group['pass_us_per_rank_pass']:.1f} us per rank-pass "
          f"over {best_group['rank_passes']} rank-passes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
