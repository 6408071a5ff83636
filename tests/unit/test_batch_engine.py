"""The batch engine's outer contract: a status per simulation, reruns of only what
outgrew its sizing, placement policies, and stepping to a horizon.

* A batch reports ``ok`` / ``dead_end`` / ``rejected_config`` / ``capacity`` per
  simulation; the good simulations' results are those of their solo runs.
* Random placement (seeded) matches the plain-Python oracle request by request and
  pass by pass, and a queue it overflows is either rerun transparently or reported
  as ``capacity`` - never silently corrupted.
* Advancing a batch to random horizons, one call after another, ends in exactly the
  state of one call to completion.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numba
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from aisim_fast.config.payload import RankConfig, parse_payload
from aisim_fast.engine import batch, batch_run, build, event_frames, memory, split, templates
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.batch_run import BatchRun
from aisim_fast.engine.build import build_state
from aisim_fast.engine.grow import KernelState
from aisim_fast.engine.simulation import (STATUS_CAPACITY, STATUS_DEAD_END, STATUS_OK, STATUS_REJECTED_CONFIG,
                                          SimulationError, simulation_from_setup)
from aisim_fast.kernels.loop.event_loop import replay_batch
from aisim_fast.kernels.schema import layout as L
from aisim_fast.trace.workload import select_rows
from support import oracle
from support.paths import DATA_DIR
from support.random_cases import (SETTINGS, Case, cases, check_case_against_oracle, examples, frames_of,
                                  make_spec, record_differences, write_trace)


def _simulation(rows, rank, tmp, name="t", **spec_kw):
    """A Simulation of ``rows`` with the rank dict ``rank`` (trace written under tmp)."""
    folder = os.path.join(tmp, name)
    os.makedirs(folder, exist_ok=True)
    case = Case(rows, make_spec(rank, **spec_kw))
    return simulation_from_setup(parse_payload(case.spec, trace_override=write_trace(rows, folder)))


ROWS = [{"timestamp": 10 * i, "input_length": 100 + 37 * i, "output_length": 5 + i,
         "hash_ids": [i % 3, 100 + i]} for i in range(24)]
DEAD_END_ROWS = [{"timestamp": 0, "input_length": 300, "output_length": 200, "hash_ids": [1]}]


@pytest.mark.bounds
def test_each_status_in_one_batch():
    """ok, dead_end, rejected_config and capacity side by side: each failure is
    reported with its reason, and the good simulation's results are its solo run's."""
    with tempfile.TemporaryDirectory() as tmp:
        good = _simulation(ROWS, {"backend": "vllm", "num_gpu_blocks": 64, "block_size": 16}, tmp,
                           "good", workers=2)
        # the prompt fits, the output outgrows the pool: admitted, preempted, never again
        dead = _simulation(DEAD_END_ROWS, {"backend": "vllm", "num_gpu_blocks": 6}, tmp, "dead")
        bad = dataclasses.replace(good, rank=dataclasses.replace(good.rank, max_num_seqs=0))
        tight = dataclasses.replace(good, placement="random", placement_seed=3, queue_slots=2)
        res = run_batch([dead, good, bad, tight])
        solo = run_batch([good])
    assert list(res.status) == [STATUS_DEAD_END, STATUS_OK, STATUS_REJECTED_CONFIG, STATUS_CAPACITY]
    assert "dead end at t=" in res.error[0] and "1 in-flight" in res.error[0]
    assert res.error[1] == ""
    assert "rank.max_num_seqs" in res.error[2]
    assert "overflowed its 2 slots" in res.error[3]
    pd.testing.assert_frame_equal(res.requests[1], solo.requests[0], check_exact=True)
    pd.testing.assert_frame_equal(res.passes[1], solo.passes[0], check_exact=True)
    np.testing.assert_array_equal(res.token_stat[1], solo.token_stat[0])
    np.testing.assert_array_equal(res.token_hist[1], solo.token_hist[0])
    for s in (0, 2, 3):
        with pytest.raises(SimulationError, match=f"simulation {s}: "):
            res.requests[s]
    with pytest.raises(SimulationError, match="simulation 0: dead end"):
        res.check()
    assert solo.check() is solo


def test_rejected_config_names_the_field():
    with tempfile.TemporaryDirectory() as tmp:
        good = _simulation(ROWS[:3], {"backend": "vllm"}, tmp)
    bad = [
        (dataclasses.replace(good, workers=0), "workers"),
        (dataclasses.replace(good, rank=RankConfig(backend="tensorrt")), "rank.backend"),
        (dataclasses.replace(good, rank=RankConfig(backend="sglang", block_size=16,
                                                   sglang_chunked_prefill_size=100)),
         "rank.sglang.chunked_prefill_size"),
        (dataclasses.replace(good, rank=dataclasses.replace(good.rank, preemption_mode="x")),
         "rank.preemption_mode"),
        (dataclasses.replace(good, placement="least_loaded"), "placement"),
        (dataclasses.replace(good, queue_slots=0), "queue_slots"),
    ]
    res = run_batch([sim for sim, _ in bad] + [good])
    assert list(res.status) == [STATUS_REJECTED_CONFIG] * len(bad) + [STATUS_OK]
    for s, (_, field) in enumerate(bad):
        assert f"invalid config: {field}:" in res.error[s], res.error[s]


@pytest.mark.bounds
def test_only_the_simulation_that_outgrew_its_arena_reruns(monkeypatch):
    """An arena too small for one simulation reruns that one alone with the full pool;
    the others keep their first run (and every result is the normal one)."""
    with tempfile.TemporaryDirectory() as tmp:
        a = _simulation(ROWS, {"backend": "vllm", "num_gpu_blocks": 64, "block_size": 16}, tmp, "a")
        b = _simulation(ROWS[::-1], {"backend": "trtllm", "num_gpu_blocks": 80, "block_size": 16},
                        tmp, "b", workers=2, concurrency=3)
        want = [run_batch([a]), run_batch([b])]
        reruns = []
        real = batch._run_units

        def counting(units, *args, **kwargs):
            reruns.append(len(units))
            return real(units, *args, **kwargs)

        monkeypatch.setattr(batch, "_run_units", counting)
        got = run_batch([a, dataclasses.replace(b, arena_blocks=1)])
    assert reruns == [2, 1]
    assert list(got.status) == [STATUS_OK, STATUS_OK]
    for s in range(2):
        pd.testing.assert_frame_equal(got.requests[s], want[s].requests[0], check_exact=True)
        pd.testing.assert_frame_equal(got.passes[s], want[s].passes[0], check_exact=True)


@pytest.mark.bounds
def test_random_placement_past_the_round_robin_queue_size(monkeypatch):
    """Random placement on queues sized as round robin's ceil(n / N) + 1 overflows: with
    the default sizing the driver reruns with room for every request and the result
    equals the roomy run and the oracle's; with fixed queue_slots it is ``capacity``."""
    rows = [{"timestamp": 0, "input_length": 64, "output_length": 40, "hash_ids": [i]}
            for i in range(30)]
    rank = {"backend": "vllm", "num_gpu_blocks": 400, "block_size": 16, "max_num_seqs": 64}
    with tempfile.TemporaryDirectory() as tmp:
        sim = dataclasses.replace(_simulation(rows, rank, tmp, workers=3), placement="random",
                                  placement_seed=11)
        roomy = run_batch([dataclasses.replace(sim, queue_slots=len(rows) + 1)])
        records, _ = oracle.run(_with_placement(make_spec(rank, workers=3), 11),
                                write_trace(rows, tmp))
        monkeypatch.setattr(templates, "_default_queue_slots", lambda n, w, placement: -(-n // w) + 1)
        rerun = run_batch([sim])
        fixed = run_batch([dataclasses.replace(sim, queue_slots=-(-len(rows) // 3) + 1)])
    workers = roomy.requests[0]["worker"].to_numpy()
    assert np.bincount(workers).max() > -(-len(rows) // 3)  # past round robin's share
    pd.testing.assert_frame_equal(rerun.requests[0], roomy.requests[0], check_exact=True)
    pd.testing.assert_frame_equal(rerun.passes[0], roomy.passes[0], check_exact=True)
    assert rerun.kernel_calls == 2
    assert not record_differences(records, roomy.requests[0])
    assert fixed.status[0] == STATUS_CAPACITY


def _with_placement(spec, seed):
    spec = dict(spec)
    spec["spec"] = dict(spec["spec"], adapters={"placement": {"provider": "random",
                                                               "config": {"seed": seed}}})
    return spec


@pytest.mark.bounds
@settings(max_examples=examples(150), **SETTINGS)
@given(cases(), st.integers(0, 2 ** 63 - 1))
def test_random_placement_matches_oracle(case, seed):
    """Seeded random placement: the kernels and the oracle draw the same workers and
    produce the same records and passes."""
    check_case_against_oracle(Case(case.rows, _with_placement(case.spec, seed)))


def _advance_in_steps(sims, horizons_ms):
    """Run ``sims`` to completion through one call per horizon (then to the end)."""
    cfg, pool, rq, wl, wk, st_, max_lease, max_bs = state = build_state(sims, 0)
    ids = np.arange(len(sims), dtype=np.int64)
    reached_ms = 0.0
    for horizon_ms in horizons_ms:
        replay_batch(cfg, pool, rq, wl, wk, st_, ids, max_lease, max_bs, horizon_ms=horizon_ms)
        status = st_.i64[:, L.SM_STATUS]
        assert np.all(np.isin(status, (L.SIM_PAUSED, L.SIM_DONE, L.SIM_DEAD_END, L.SIM_ARENA_FULL)))
        # a paused simulation stopped at its last instant before the horizon (a past
        # horizon leaves it where it was)
        reached_ms = max(reached_ms, horizon_ms)
        assert np.all(st_.now_ms[status == L.SIM_PAUSED] <= reached_ms)
    replay_batch(cfg, pool, rq, wl, wk, st_, ids, max_lease, max_bs)
    return state


@pytest.mark.bounds
@settings(max_examples=examples(60), **SETTINGS)
@given(st.lists(cases(max_rows=20), min_size=1, max_size=3),
       st.lists(st.floats(0.0, 4000.0), min_size=1, max_size=6))
def test_stepping_to_horizons_equals_one_run(batch, horizons):
    """Advancing a random batch to random horizons (sorted; repeats and past ones
    included) gives exactly the requests, token statistics and clocks of one call
    to completion."""
    with tempfile.TemporaryDirectory() as tmp:
        sims = [simulation_from_setup(parse_payload(
            case.spec, trace_override=write_trace(case.rows, _mkdir(tmp, i))))
            for i, case in enumerate(batch)]
        # a generous arena: an arena-full stop is not a horizon stop
        sims = [dataclasses.replace(sim, arena_blocks=sim.rank.num_gpu_blocks) for sim in sims]
        whole = _advance_in_steps(sims, [])
        stepped = _advance_in_steps(sims, sorted(horizons) + [horizons[0]])
    st_whole, st_stepped = whole[5], stepped[5]
    np.testing.assert_array_equal(st_stepped.i64[:, L.SM_STATUS], st_whole.i64[:, L.SM_STATUS])
    np.testing.assert_array_equal(st_stepped.now_ms, st_whole.now_ms)
    np.testing.assert_array_equal(st_stepped.token_stat, st_whole.token_stat)
    np.testing.assert_array_equal(st_stepped.token_hist, st_whole.token_hist)
    for a, b in zip(frames_of(sims, stepped), frames_of(sims, whole)):
        pd.testing.assert_frame_equal(a, b, check_exact=True)


def _sessions_starting_in(wl, lo_ms, hi_ms):
    """Rows of the sessions whose first turn starts in (lo_ms, hi_ms], in trace order."""
    first_start = np.full(int(wl.session.max()) + 1, np.nan)
    first_start[wl.session[wl.order]] = wl.start_ms[wl.order]
    start = first_start[wl.session]
    return np.flatnonzero((start > lo_ms) & (start <= hi_ms))


@pytest.mark.bounds
@settings(max_examples=examples(60), **SETTINGS)
@given(st.lists(cases(max_rows=24), min_size=1, max_size=3), st.data())
def test_requests_added_between_steps_equal_one_run(batch, data):
    """One simulation of a random batch starts with the sessions that begin before a
    first horizon and is given the next ones at each later horizon (the batch grows
    around the others): its requests, passes, KV, engine and output events, and every
    other simulation's records, equal one run of the whole traces."""
    grown = data.draw(st.integers(0, len(batch) - 1))
    topology = data.draw(st.sampled_from(["aggregated", "disaggregated", "random placement"]))
    with tempfile.TemporaryDirectory() as tmp:
        sims = [simulation_from_setup(parse_payload(
            case.spec, trace_override=write_trace(case.rows, _mkdir(tmp, i))))
            for i, case in enumerate(batch)]
    sim = dataclasses.replace(sims[grown], concurrency=0)  # open loop: starts are times
    if topology == "disaggregated":
        sim = dataclasses.replace(sim, prefill_workers=1, prefill_rank=sim.rank)
    elif topology == "random placement":
        sim = dataclasses.replace(sim, placement="random", placement_seed=data.draw(st.integers(0, 99)))
    sims[grown] = sim
    wl = sim.workload
    starts = wl.start_ms[wl.order]
    cuts = sorted(data.draw(st.lists(st.sampled_from(list(starts) + [starts[-1] + 1.5]), min_size=1,
                                     max_size=4)))
    cuts = [c for i, c in enumerate(cuts) if i == 0 or c > cuts[i - 1]]
    whole = BatchRun(sims, event_rows=4096, log_outputs=True, growable=True)
    whole.advance()
    first = [dataclasses.replace(x, workload=select_rows(x.workload, _sessions_starting_in(
        x.workload, -1.0, cuts[0]))) if s == grown else x for s, x in enumerate(sims)]
    stepped = BatchRun(first, event_rows=4096, log_outputs=True, growable=True)
    for lo, hi in zip(cuts, cuts[1:] + [np.inf]):
        stepped.advance(lo)
        if stepped.status[grown] == "dead_end":
            # stuck with what it has: new arrivals would only queue behind
            assert whole.status[grown] == "dead_end"
            return
        assert stepped.now_ms(grown) <= lo
        stepped.add_requests(grown, select_rows(wl, _sessions_starting_in(wl, lo, hi)))
    stepped.advance()
    assert stepped.status == whole.status
    for s in range(len(sims)):
        if whole.status[s] != "done":
            continue
        key = ["request_id", "turn_index"]
        pd.testing.assert_frame_equal(
            stepped.requests(s).sort_values(key, ignore_index=True),
            whole.requests(s).sort_values(key, ignore_index=True), check_exact=True)
        for table in ("passes", "kv_events", "engine_events", "output_events"):
            pd.testing.assert_frame_equal(getattr(stepped, table)(s), getattr(whole, table)(s),
                                          check_exact=True)
    np.testing.assert_array_equal(stepped.state.st.token_stat, whole.state.st.token_stat)


@pytest.mark.bounds
@pytest.mark.parametrize("prefill_workers", [0, 1])
def test_a_simulation_that_starts_empty(prefill_workers):
    """A simulation with no requests at first, between two others, given its trace in
    two parts (before its first step and at a horizon), ends as one run of the trace."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = _simulation(ROWS, {"backend": "vllm", "num_gpu_blocks": 64, "block_size": 16}, tmp,
                          workers=2)
    if prefill_workers:
        sim = dataclasses.replace(sim, prefill_workers=1, prefill_rank=sim.rank)
    whole = run_batch([sim]).check()
    wl = sim.workload
    run = BatchRun([sim, dataclasses.replace(sim, workload=select_rows(wl, [])), sim], growable=True)
    run.add_requests(1, select_rows(wl, range(10)))
    run.advance(float(wl.start_ms[10]) - 0.5)
    run.add_requests(1, select_rows(wl, range(10, len(ROWS))))
    assert run.advance() == ["done"] * 3
    for s in range(3):
        pd.testing.assert_frame_equal(run.requests(s), whole.requests[0], check_exact=True)
        pd.testing.assert_frame_equal(run.passes(s), whole.passes[0], check_exact=True)


def test_add_requests_refuses_what_it_cannot_take():
    """Requests starting at or before the clock, a run not made growable, and a failed
    simulation are refused with the reason; the state is unchanged."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = _simulation(ROWS, {"backend": "vllm", "num_gpu_blocks": 64, "block_size": 16}, tmp)
        dead = _simulation(DEAD_END_ROWS, {"backend": "vllm", "num_gpu_blocks": 6}, tmp, "dead")
    early, late = select_rows(sim.workload, range(12)), select_rows(sim.workload, range(12, 24))
    with pytest.raises(ValueError, match="growable=True"):
        BatchRun([dataclasses.replace(sim, workload=early)]).add_requests(0, late)
    run = BatchRun([dataclasses.replace(sim, workload=early), dead], growable=True)
    run.advance()
    assert run.status == ["done", "dead_end"]
    assert run.now_ms(0) >= early.start_ms[-1]
    with pytest.raises(ValueError, match="not after the simulation's clock"):
        run.add_requests(0, select_rows(early, [11]))
    assert run.sims[0].workload.num_requests == 12 and run.state.st.i64[0, L.SM_Q_LEN] == 12
    with pytest.raises(SimulationError, match="dead_end"):
        run.add_requests(1, late)
    with pytest.raises(ValueError, match="whole sessions"):
        select_rows(_simulation([dict(r, session_id="a") for r in ROWS[:3]],
                                {"backend": "vllm", "num_gpu_blocks": 64, "block_size": 16},
                                tempfile.mkdtemp()).workload, [1, 2])


def _assert_output_events_are_the_request_records(sim):
    res = run_batch([sim], record_outputs=True).check()
    out, req = res.output_events[0], res.requests[0].set_index(["request_id", "turn_index"])
    assert len(out) == req["output_tokens"].sum()
    g = out.groupby(["request_id", "turn_index"])
    np.testing.assert_array_equal(g.size().reindex(req.index, fill_value=0).to_numpy(),
                                  req["output_tokens"])
    req = req[req["output_tokens"] > 0]
    assert (g["token_index"].apply(lambda t: list(t) == list(range(1, len(t) + 1)))).all()
    assert (g["last"].apply(lambda f: f.iloc[-1] and not f.iloc[:-1].any())).all()
    firsts = out[out["token_index"] == 1].set_index(["request_id", "turn_index"])["time_ms"]
    lasts = out[out["last"]].set_index(["request_id", "turn_index"])["time_ms"]
    np.testing.assert_array_equal(firsts.reindex(req.index), req["first_token_ms"])
    np.testing.assert_array_equal(lasts.reindex(req.index), req["last_token_ms"])
    # logging every token turns decode runs off and changes nothing else
    plain = run_batch([sim]).check()
    pd.testing.assert_frame_equal(plain.requests[0], res.requests[0], check_exact=True)
    pd.testing.assert_frame_equal(plain.passes[0], res.passes[0], check_exact=True)
    return res


def test_output_events_are_the_request_records():
    """One output event per emitted token, numbered from 1 per request, the last one
    marked, at the times the request records give (first, second, last token)."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = _simulation(ROWS, {"backend": "vllm", "num_gpu_blocks": 40, "block_size": 16}, tmp,
                          workers=2)
    res = _assert_output_events_are_the_request_records(sim)
    assert (res.requests[0]["terminal_status"] == "rejected").any()  # a few: no tokens


def test_sglang_output_events_are_the_request_records():
    """The same on an SGLang reference run with retractions (sx-r1): its tokens are
    logged by the same emitter."""
    folder = DATA_DIR / "golden_sglang" / "sx-r1"
    setup = parse_payload(json.loads((folder / "spec.json").read_text()), folder,
                          trace_override=str(folder / "trace.jsonl"))
    res = _assert_output_events_are_the_request_records(simulation_from_setup(setup))
    assert res.requests[0]["preemptions"].sum() > 0


def _mkdir(tmp, i):
    path = os.path.join(tmp, str(i))
    os.makedirs(path, exist_ok=True)
    return path


# ------------------------------------------------------------------------------------------------
# KV events
# ------------------------------------------------------------------------------------------------
def _visible_after(events):
    """Per worker, the hashes the events leave visible; asserts every Stored hash was
    not visible before and every Removed one was."""
    visible = {}
    for worker, kind, h in zip(events["worker"], events["kind"], events["block_hash"]):
        seen = visible.setdefault(int(worker), set())
        if kind == "stored":
            assert h not in seen, f"worker {worker}: Stored {h:#x} while visible"
            seen.add(h)
        else:
            assert kind == "removed"
            assert h in seen, f"worker {worker}: Removed {h:#x} while not visible"
            seen.remove(h)
    return visible


def _table_hashes(state, s):
    """Per worker of simulation s, the hashes its prefix table holds."""
    pool, sims = state[1], state[5]
    out = {}
    w0 = int(sims.i64[s, L.SM_W_OFF])
    for w in range(w0, w0 + int(sims.i64[s, L.SM_W_LEN])):
        off, mask = pool.w64[w, L.PW_TAB_OFF], pool.w64[w, L.PW_TAB_MASK]
        slots = pool.tab[off:off + mask + 1]
        out[w - w0] = {int(pool.blk_hash[b]) for b in slots[slots != L.NO_BLOCK]}
    return out


def _kv_run(sims, n_event_rows):
    """Run to completion with a KV event log; (state, per-simulation event frames)."""
    state = build_state(sims, 0, event_rows=n_event_rows)
    cfg, pool, rq, wl, wk, st_, max_lease, max_bs = state
    kernel_state = KernelState(*state)
    ids = np.arange(len(sims), dtype=np.int64)
    chunks = [[] for _ in sims]
    while True:
        replay_batch(cfg, pool, rq, wl, wk, st_, ids, max_lease, max_bs)
        for s in range(len(sims)):
            n = pool.event_log[s, 0, L.EVH_LEN]
            if 0 < n <= n_event_rows:
                chunks[s].append(event_frames.drained_event_rows(kernel_state, s, n))
                pool.event_log[s, 0, L.EVH_LEN] = 0
        if not np.any(st_.i64[:, L.SM_STATUS] == L.SIM_NEED_FLUSH):
            break
    frames = [event_frames.kv_event_frame(sims[s], event_frames.event_rows(chunks[s]),
                                            int(st_.i64[s, L.SM_W_OFF]))
              for s in range(len(sims))]
    return state, frames


@settings(max_examples=examples(60), **SETTINGS)
@given(cases(max_rows=25))
def test_kv_events_account_for_every_visible_hash(case):
    """Replaying a run's KV events (Stored only for a hash not visible, Removed only
    for a visible one) leaves exactly the hashes each worker's prefix table holds at
    the end; recording them changes no result."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = simulation_from_setup(parse_payload(case.spec, trace_override=write_trace(case.rows, tmp)))
        sim = dataclasses.replace(sim, arena_blocks=sim.rank.num_gpu_blocks)
        plain = run_batch([sim])
        state, frames = _kv_run([sim], 4096)
    status = state[5].i64[0, L.SM_STATUS]
    assert status in (L.SIM_DONE, L.SIM_DEAD_END)
    if status == L.SIM_DONE:
        pd.testing.assert_frame_equal(frames_of([sim], state)[0], plain.requests[0], check_exact=True)
    visible = _visible_after(frames[0])
    table = _table_hashes(state, 0)
    for w, hashes in table.items():
        assert visible.get(w, set()) == hashes, f"worker {w}"
    events = frames[0]
    for _, mine in events.groupby("worker"):
        # a worker's events are visible in event order, numbered from 0, blocks by position
        assert np.all(np.diff(mine["at_ms"].to_numpy()) >= 0)
        ids = mine["event_id"].to_numpy()
        assert ids[0] == 0 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
        np.testing.assert_array_equal(mine["position"].to_numpy(),
                                      mine.groupby("event_id").cumcount().to_numpy())
    stored = events[events["kind"] == "stored"]
    # every Stored block carries its tokens-only hash (filled when the log is drained)
    assert (stored["tokens_hash"].notna()).all()


def test_kv_events_through_run_batch(monkeypatch):
    """run_batch's KV events: never split into worker units (generated-block hashes
    depend on the request numbering of the whole run), the same whether the log is
    drained often or rarely and after an overflow rerun (a 4-row log overflows within
    one instant); disaggregated runs log both pools."""
    rows = [{"timestamp": 5 * i, "input_length": 300 + 40 * (i % 4), "output_length": 20 + i,
             "hash_ids": [i % 3, 10 + i % 2, 100 + i]} for i in range(16)]
    rank = {"backend": "vllm", "num_gpu_blocks": 60, "block_size": 16}
    with tempfile.TemporaryDirectory() as tmp:
        sim = _simulation(rows, rank, tmp, workers=2)
        want = run_batch([sim], record_events=True).kv_events[0]
        state, frames = _kv_run([sim], 1 << 14)
        whole = frames[0]
        monkeypatch.setattr(batch, "DEFAULT_EVENT_ROWS", 4)
        small = run_batch([sim], record_events=True)
        disagg = simulation_from_setup(parse_payload(json.loads(
            (DATA_DIR / "golden_disagg" / "dm1.spec.json").read_text()),
            base_dir=DATA_DIR / "golden_disagg"))
        pd_events = run_batch([disagg], record_events=True).check().kv_events[0]
    assert len(want) > 20 and set(want["kind"]) == {"stored", "removed"}
    pd.testing.assert_frame_equal(whole, want)
    pd.testing.assert_frame_equal(small.kv_events[0], want)
    assert small.kernel_calls > 3
    assert set(pd_events["worker"]) == set(range(disagg.prefill_workers + disagg.workers))
    _visible_after(pd_events)


@settings(max_examples=examples(60), **SETTINGS)
@given(cases(max_rows=25))
def test_engine_events_match_the_request_records(case):
    """Every admission, preemption and finish is one engine event: per request the
    counts equal its record's admissions and preemptions, its one finish carries its
    terminal status and output tokens, and the first admission its cached tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = simulation_from_setup(parse_payload(case.spec, trace_override=write_trace(case.rows, tmp)))
        res = run_batch([sim], record_events=True)
    if res.status[0] != STATUS_OK:
        return
    req = res.requests[0].set_index(["request_id", "turn_index"])
    ev = res.engine_events[0]
    for kind, column in (("admitted", "admission_count"), ("preempted", "preemptions")):
        counts = ev[ev["kind"] == kind].groupby(["request_id", "turn_index"]).size()
        np.testing.assert_array_equal(counts.reindex(req.index, fill_value=0).to_numpy(),
                                      req[column].to_numpy())
    fin = ev[ev["kind"] == "finished"].set_index(["request_id", "turn_index"])
    assert fin.index.is_unique and len(fin) == len(req)
    fin = fin.reindex(req.index)
    assert list(fin["terminal_status"]) == list(req["terminal_status"])
    np.testing.assert_array_equal(fin["output_tokens"].to_numpy(np.int64), req["output_tokens"].to_numpy())
    first = ev[ev["kind"] == "admitted"].groupby(["request_id", "turn_index"])["cached_tokens"].first()
    admitted = req["admission_count"] > 0
    np.testing.assert_array_equal(first.reindex(req.index[admitted]).to_numpy(np.int64),
                                  req.loc[admitted, "first_admission_cached_tokens"].to_numpy())
    assert np.all(np.diff(ev["time_ms"].to_numpy()) >= 0) or len(ev) < 2


def test_progress_slices_change_nothing(monkeypatch):
    """run_batch with a progress callback advances in wall-time slices (many kernel
    calls, tiny slices here) and ends with exactly the results of one call; the
    callback sees requests finish, never fewer than before."""
    with tempfile.TemporaryDirectory() as tmp:
        sims = [_simulation(ROWS, {"backend": "vllm", "num_gpu_blocks": 64, "block_size": 16}, tmp,
                            "a", workers=2),
                _simulation(ROWS, {"backend": "trtllm", "num_gpu_blocks": 64, "block_size": 16}, tmp,
                            "b", workers=1)]
    sims.append(dataclasses.replace(sims[0], prefill_workers=1, prefill_rank=sims[0].rank))
    monkeypatch.setattr(batch_run, "PROGRESS_SLICE_S", 1e-6)
    seen = []
    stepped = run_batch(sims, progress=lambda t, done, total: seen.append((t, done, total))).check()
    whole = run_batch(sims).check()
    assert len(seen) > 5 and seen[-1][1] == seen[-1][2] == 3 * len(ROWS)
    assert all(b[1] >= a[1] for a, b in zip(seen, seen[1:]))
    for s in range(len(sims)):
        pd.testing.assert_frame_equal(stepped.requests[s], whole.requests[s], check_exact=True)
        pd.testing.assert_frame_equal(stepped.passes[s], whole.passes[s], check_exact=True)
    np.testing.assert_array_equal(stepped.token_stat, whole.token_stat)
    np.testing.assert_array_equal(stepped.end_ms, whole.end_ms)


def test_a_batch_shares_one_pass_log_budget(monkeypatch):
    """Many simulations split one pass-log budget (each drained when full): the passes
    are those of roomy logs, with more kernel calls."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = _simulation(ROWS * 40, {"backend": "vllm", "num_gpu_blocks": 256, "block_size": 16}, tmp,
                          workers=1)
    roomy = run_batch([sim] * 4).check()
    monkeypatch.setattr(batch_run, "PASS_LOG_BUDGET_ROWS", 4)
    monkeypatch.setattr(batch_run, "MIN_PASS_LOG_ROWS", 16)
    tight = run_batch([sim] * 4).check()
    assert len(roomy.passes[0]) > 4 * 16
    assert tight.kernel_calls > roomy.kernel_calls
    for s in range(4):
        pd.testing.assert_frame_equal(tight.passes[s], roomy.passes[s], check_exact=True)
        pd.testing.assert_frame_equal(tight.requests[s], roomy.requests[s], check_exact=True)


def _golden_sim(case, **changes):
    golden = DATA_DIR / "golden"
    setup = parse_payload(json.loads((golden / f"{case}.spec.json").read_text()), golden,
                          str(DATA_DIR / "traces" / "mooncake_1k.jsonl"))
    return dataclasses.replace(simulation_from_setup(setup), **changes)


def test_state_estimate_matches_what_build_state_allocates(monkeypatch):
    """The size check before allocation estimates the arrays build_state then makes
    (aggregated and disaggregated), within a fifth."""
    sims = [_golden_sim("1k_vllm_agg2"), _golden_sim("1k_vllm_disagg1p2d")]
    seen = {}
    real = memory.check_state_fits

    def spy(sims_, templates, n_q, rows, events=0):
        seen["bytes"] = memory.state_bytes(sims_, templates, n_q, rows, events)
        return real(sims_, templates, n_q, rows, events)

    monkeypatch.setattr(build, "check_state_fits", spy)
    state = build_state(sims)
    allocated = sum(a.nbytes for bundle in state if hasattr(bundle, "_fields")
                    for a in bundle if isinstance(a, np.ndarray))
    allocated -= state[3].phash.nbytes + state[3].hash_ids.nbytes  # workload tables: not state
    assert 0.8 * allocated <= seen["bytes"] <= 1.25 * allocated, (seen["bytes"], allocated)


def test_a_batch_too_large_for_memory_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 4 << 20)
    with pytest.raises(memory.StateTooLarge, match=r"needs about \d+ MiB of simulator state "
                                                          r"\(1 kernel unit\(s\), 3 workers, 2000 request "
                                                          r"rows\), 4 MiB is available: use fewer workers"):
        run_batch([_golden_sim("1k_vllm_disagg1p2d")])


def test_workers_past_the_last_arrival_get_no_unit():
    """Round robin on more workers than requests: every request alone on its worker,
    exactly as with one worker per request, and no kernel unit for the idle ones."""
    many = run_batch([_golden_sim("1k_vllm_agg2", workers=50_000)]).check()
    exact = run_batch([_golden_sim("1k_vllm_agg2", workers=1000)]).check()
    pd.testing.assert_frame_equal(many.requests[0], exact.requests[0], check_exact=True)
    assert len(split.worker_shards(_golden_sim("1k_vllm_agg2", workers=50_000))) == 1000


def test_kernel_sets_compile_under_names_of_their_own():
    """Numba names a closure's machine code after its qualified name and a per-process
    counter, so two kernel sets compiled in different processes into one cache could
    share a symbol, and a process loading both ran one set's loop for the other (an
    SGLang disaggregated batch ran the aggregated loop after an aggregated run). Each
    set's event loop and batch entry carries its own name."""
    from aisim_fast.kernels.loop import event_loop as E
    entries = [E.replay_aggregated_batch, E.replay_disaggregated_batch, E.replay_sglang_batch,
               E.replay_sglang_disaggregated_batch]
    names = [d.py_func.__qualname__ for d in entries]
    assert len(set(names)) == len(names), names


def test_one_compiled_version_per_batch_entry(monkeypatch):
    """A batch of one simulation and a batch split into chunks over the kernel threads
    run the same machine code: the chunks' ids are contiguous copies, not strided
    slices (a strided slice is another array type, which once compiled a second
    version of the entry silently, 20 s into a user's first multi-worker run, after
    the compile notice had been given)."""
    from aisim_fast.kernels.loop import event_loop as E
    monkeypatch.setattr(E, "_THREADS", [2])
    seen = []
    real = E.replay_aggregated_batch

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *args):
            seen.append(args[6])
            return real(*args)

    monkeypatch.setattr(E, "replay_aggregated_batch", Spy())
    monkeypatch.setattr(E, "_CHECKED", set())
    sims = [_golden_sim("1k_vllm_agg2", workers=w) for w in (1, 4, 8)]
    before = set(real.overloads)  # other tests' feature sets (kernels.features)
    run_batch(sims[:1]).check()
    run_batch(sims).check()  # 13 worker units in 8 chunks: some chunks hold two
    assert len(seen) == 9 and max(len(ids) for ids in seen) == 2
    assert all(ids.flags.c_contiguous and ids.dtype == np.int64 for ids in seen)
    # one version for both batches (the plain feature set), the same ids type in all
    assert len(set(real.overloads) - before) <= 1, list(real.overloads)
    plain = [sig for sig in real.overloads
             if sig[0].types[sig[0].fields.index("features")] == numba.typeof(L.Features())]
    assert len(plain) == 1, plain
    assert {sig[6] for sig in real.overloads} == {numba.typeof(np.zeros(1, np.int64))}
