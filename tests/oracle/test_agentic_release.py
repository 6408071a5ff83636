"""The agentic release rule (``kernels.agentic.release``) against a plain-Python oracle.

A request of an agentic graph is sent at ``max(not_before_ms, max over its
dependencies of (trigger time + delay_ms))``, where a ``dispatch`` dependency's trigger
time is when its source was sent and a ``completion`` one's when its source completed
(with lanes, ``not_before_ms`` counts from when a lane took the play). The oracle
reads the trigger times and the plays' starts from the run itself, so it checks the
rule, not the engine's timing: on the reference's agentic goldens (with and without
lanes, v2 and legacy rows) and on random graphs (chains, fan-outs and joins across
both triggers, floors on later requests, zero delays), every request is sent exactly
when the rule says.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from aisim_fast import Simulation, parse_rank, run_batch
from aisim_fast.config.payload import load_spec
from aisim_fast.engine.simulation import simulation_from_setup
from aisim_fast.trace.agentic_graph import TRIGGERS, load_agentic_mooncake
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_agentic"
COMPLETION = TRIGGERS.index("completion")


def release_floor_ms(graph, sent_ms: np.ndarray) -> np.ndarray:
    """Each node's floor: its ``not_before_ms`` without lanes; with lanes, its play's
    start (when the lane took it: its earliest root is sent then) plus how far its
    ``not_before_ms`` lies past the play's roots' earliest."""
    if not graph.lanes:
        return graph.not_before_ms.astype(np.float64)
    play = graph.node_play
    start = np.full(len(graph.play_names), np.nan)
    for n in np.flatnonzero(graph.is_root):
        if not np.isnan(sent_ms[n]) and not sent_ms[n] >= start[play[n]]:
            start[play[n]] = sent_ms[n]
    return start[play] + np.maximum(0.0, graph.not_before_ms - graph.root_not_before_ms()[play])


def release_ms(graph, sent_ms: np.ndarray, completed_ms: np.ndarray) -> np.ndarray:
    """Each node's release time by the rule, from its sources' trigger times in this run;
    NaN where a source never fired (it was not sent, or did not complete)."""
    floor = release_floor_ms(graph, sent_ms)
    out = np.empty(graph.num_nodes)
    for n in range(graph.num_nodes):
        t = float(floor[n])
        for e in range(graph.dep_indptr[n], graph.dep_indptr[n + 1]):
            src = graph.dep_source[e]
            fired = completed_ms[src] if graph.dep_trigger[e] == COMPLETION else sent_ms[src]
            t = max(t, fired + float(graph.dep_delay_ms[e]))  # NaN stays NaN: never released
        out[n] = t
    return out


def check_release(graph, requests) -> int:
    """Asserts the rule on every request that was sent (a failed play skips the rest);
    returns how many were. The
    frame's rows are matched to the graph's nodes by their agentic request id (a request never
    sent may have no row)."""
    by_node = requests.set_index("agentic_request_id").reindex(graph.request_id)
    sent = by_node["dispatched_at_ms"].to_numpy(np.float64)
    done = np.where(by_node["terminal_status"].to_numpy() == "completed",
                    by_node["completion_ms"].to_numpy(np.float64), np.nan)
    expected = release_ms(graph, sent, done)
    was_sent = ~np.isnan(sent)
    bad = was_sent & (sent != expected)
    assert not bad.any(), [(graph.request_id[n], sent[n], expected[n]) for n in np.flatnonzero(bad)[:5]]
    return int(was_sent.sum())


@pytest.mark.parametrize("case", sorted(p.name[:-len(".spec.json")] for p in GOLDEN.glob("*.spec.json")))
def test_goldens_send_each_request_when_its_dependencies_release_it(case):
    sim = simulation_from_setup(load_spec(GOLDEN / f"{case}.spec.json"))
    res = run_batch([sim], record_passes=False)
    assert res.status[0] == "ok", res.error[0]
    assert check_release(sim.workload.agentic, res.requests[0]) > 0


def random_graph(rng: random.Random) -> list[dict]:
    """v2 rows: plays of 1-8 requests, each depending on up to 3 earlier ones of its
    play (either trigger, delays 0 to 80 ms), floors on roots and on some later ones."""
    rows = []
    for p in range(rng.randint(2, 6)):
        names = []
        for k in range(rng.randint(1, 8)):
            rid = f"p{p}-{k}"
            deps = []
            if names:
                for src in rng.sample(names, rng.randint(1, min(3, len(names)))):
                    trigger = rng.choice(TRIGGERS)  # only a spawn may fire at its source's dispatch
                    deps.append({"request_id": src, "trigger": trigger,
                                 "delay_ms": rng.choice([0.0, 0.25, 5.5, 80.0]),
                                 "relation": "spawn" if trigger == "dispatch" else rng.choice(["sequence", "join"])})
            floor = rng.choice([0.0, 40.0, 300.0]) if not deps or rng.random() < 0.3 else 0.0
            input_len = rng.choice([64, 300, 1200])
            rows.append({"request_id": rid, "play_id": f"p{p}", "session_id": f"p{p}", "model": "m",
                         "input_length": input_len, "output_length": rng.randint(1, 40),
                         "hash_ids": [p * 100 + b for b in range((input_len + 63) // 64)],
                         "not_before_ms": floor + 25.0 * p, "dependencies": deps})
            names.append(rid)
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_random_graphs_send_each_request_when_its_dependencies_release_it(tmp_path, seed):
    rng = random.Random(seed)
    header = {"schema": "dynamo.agentic_mooncake", "version": 2, "block_size": 64, "hash_id_scope": "local",
              "source": {"format": "test", "digest": str(seed)}}
    path = tmp_path / "graph.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header, *random_graph(rng)]) + "\n")
    workload = load_agentic_mooncake(path, lanes=None)
    backend = ("vllm", "sglang")[seed % 2]
    rank = parse_rank({"backend": backend, "block_size": 16, "num_gpu_blocks": 4096, "max_num_seqs": 4})
    res = run_batch([Simulation(workload, rank, workers=1 + seed % 3)], record_passes=False)
    assert res.status[0] == "ok", res.error[0]
    assert check_release(workload.agentic, res.requests[0]) == workload.num_requests
