"""Weka / AgentX agentic traces (``trace_format: weka``): one JSON object per play
(``{id, models, block_size, hash_id_scope, requests[...]}``), read from a ``.json`` /
``.jsonl`` file or a directory of them, and lowered to the dependency graph an
agentic Mooncake trace spells out (``agentic_graph``), as the reference lowers it
(verified on its runs: graph digests, arrivals and its source digest).

* A play's entries are requests (``type`` n | s: ``t`` seconds, ``model``, ``in``,
  ``out``, ``hash_ids``, ``api_time``) and subagents (``type`` subagent: ``t``,
  ``agent_id``, ``status`` completed = blocking | async_launched = background,
  ``duration_ms``, inner ``requests``). Inner times are absolute or relative to their
  marker: ``weka_nested_timestamp_basis`` auto picks relative when any inner request
  starts before its marker, anywhere in the corpus.
* Requests form streams: a chain grows while each request extends the one before by
  its prompt (same model, after its end); a request that shares only a prefix forks a
  worker stream off the chain it shares the most with; a fork that picks up where a
  chain's tail ended is spliced back in (a seam); a first request that shares nothing
  and is short is a preamble of the main stream. Each subagent's requests form streams
  of their own, spawned from the latest parent request authored before the marker.
* Edges: the requests of a stream follow each other (completion, their recorded gap);
  a stream's first request is spawned from its fork point (dispatch when it started
  before that request ended, else completion); within a scope (the top level, or one
  subagent) each request waits for the latest finished request of every other stream
  (replay barriers, the dominated ones dropped); a blocking subagent's stream ends
  join the parent request that starts after it; a stream left without any edge is
  spawned from the play's first request.
* Ids are namespaced by the blake3 of the object's place in the corpus (``file#index``);
  prompt blocks are blake3 identities of ``source:{place}:{hash id}`` (a tail block, or
  a block without a hash id, private to its request), so two plays never share cache.
* ``not_before_ms`` counts from the play's first start; the source digest is blake3
  over the corpus's bytes and the resolved basis, as the reference's.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections import defaultdict
from pathlib import Path

import blake3

from aisim_fast.trace.agentic_graph import (RELATION_JOIN, RELATION_REPLAY_BARRIER, RELATION_SEQUENCE,
                                            RELATION_SPAWN, TRIGGER_COMPLETION, TRIGGER_DISPATCH, GraphRow,
                                            check_speedup, graph_workload)
from aisim_fast.trace.workload import TraceError, Workload

BASES = ("auto", "absolute", "relative")
EPS_S = 1e-6
SEAM_MAX_GAP_S = 3600.0
SEAM_MIN_OVERLAP = 0.5
_CORPUS_DOMAIN = b"aisimulate-weka-corpus-v1\0"
_SEMANTIC_DOMAIN = b"aisimulate-weka-corpus-semantics-v2\0"
_U64 = 1 << 64


def load_weka(path, *, trace_block_size: int | None = None, arrival_speedup_ratio: float = 1.0,
              lanes: int | None = None, max_rows: int | None = None, cut=None,
              basis: str = "auto") -> Workload:
    """Load a Weka corpus (a file or a directory) as a ``Workload`` with its agentic
    graph (``trace_block_size``: an assertion on the corpus's own block size, None: any;
    ``basis``: weka_nested_timestamp_basis; ``cut``: as ``agentic_graph.graph_workload``'s)."""
    if basis not in BASES:
        raise ValueError(f"weka_nested_timestamp_basis must be one of {', '.join(BASES)}, got {basis!r}")
    ratio = check_speedup(arrival_speedup_ratio)
    path = str(path)
    files = _source_files(path)
    hasher = blake3.blake3(_CORPUS_DOMAIN)
    plays = []  # (source name, file, object)
    for full, rel in files:
        data = Path(full).read_bytes()
        hasher.update(len(rel.encode()).to_bytes(8, "little") + rel.encode())
        hasher.update(len(data).to_bytes(8, "little") + data)
        plays += _objects(full, rel, data)
    raw_digest = hasher.hexdigest()
    block, witness, replayable = None, False, False
    for src, full, obj in plays:
        _check_play(src, full, obj)
        for e in obj["requests"]:
            if e["type"] == "subagent" and e["requests"]:
                replayable = True
                witness = witness or any(r["t"] < e["t"] - EPS_S for r in e["requests"])
        if block is None:
            block = obj["block_size"]
        elif obj["block_size"] != block:
            raise TraceError(full, None, f"Weka corpus mixes block sizes: {src} has {obj['block_size']}, expected "
                                         f"{block}")
    resolved = basis if basis != "auto" else ("relative" if witness else "absolute" if replayable else
                                              "not_applicable")
    semantic = blake3.blake3(_SEMANTIC_DOMAIN + len(raw_digest).to_bytes(8, "little") + raw_digest.encode()
                             + len(resolved).to_bytes(8, "little") + resolved.encode()).hexdigest()
    if trace_block_size is not None and trace_block_size != block:
        raise TraceError(path, None, f"Weka source block size {block} does not match configured block size "
                                     f"{trace_block_size}")
    rows = []
    relative = resolved == "relative"
    for ordinal, (src, full, obj) in enumerate(plays):
        rows += _lower_play(src, full, obj, ordinal, relative)
    for k, r in enumerate(rows):
        r.line = k + 2
    w = graph_workload(path, (block, "weka", semantic), rows, input_format="weka", ratio=ratio, lanes=lanes,
                       max_rows=max_rows, cut=cut)
    w.agentic.extra_report["weka_nested_timestamp_basis"] = resolved
    return w


# ---------------------------------------------------------------------------------------------
# the corpus


def _source_files(path: str) -> list[tuple[str, str]]:
    """(file, its name in the corpus) in corpus order: a file alone by its name; a
    directory's JSON / JSONL files, found recursively, by their ``/``-joined path below it,
    in byte order."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise TraceError(path, None, f"failed to stat Weka source {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise TraceError(path, None, f"Weka source may not be a symlink: {path}")
    if stat.S_ISREG(st.st_mode):
        if not _is_json(path):
            raise TraceError(path, None, f"Weka source file must use a .json or .jsonl extension: {path}")
        return [(path, os.path.basename(path))]
    if not stat.S_ISDIR(st.st_mode):
        raise TraceError(path, None, f"Weka source is neither a file nor directory: {path}")
    out = []

    def walk(d: str, parts: list[str]) -> None:
        for name in sorted(os.listdir(d)):
            full = os.path.join(d, name)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                raise TraceError(full, None, f"Weka corpus may not contain symlinks: {full}")
            if stat.S_ISDIR(mode):
                walk(full, parts + [name])
            elif _is_json(name):
                out.append((full, "/".join(parts + [name])))
    walk(path, [])
    if not out:
        raise TraceError(path, None, f"Weka source {path} contains no JSON or JSONL files")
    return sorted(out, key=lambda f: f[1].encode())


def _is_json(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in (".json", ".jsonl")


def _objects(full: str, rel: str, data: bytes) -> list:
    """(source name, file, object) of each whitespace-separated JSON object of a file;
    a ``.json`` file holds exactly one."""
    jsonl = os.path.splitext(rel)[1].lower() == ".jsonl"
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise TraceError(full, None, f"parsing Weka source {full}: {exc}") from None
    decoder = json.JSONDecoder()
    out = []
    k = 0
    n = len(text)
    while True:
        while k < n and text[k] in " \t\r\n":
            k += 1
        if k >= n:
            break
        try:
            obj, k = decoder.raw_decode(text, k)
        except json.JSONDecodeError as exc:
            raise TraceError(full, exc.lineno, f"parsing Weka source {full} object {len(out) + 1}: {exc.msg}") \
                from None
        src = f"{rel}#{len(out):06d}" if jsonl else rel
        out.append((src, full, _trace(full, len(out) + 1, obj)))
    if not out:
        raise TraceError(full, None, f"Weka source {full} contains no trace objects")
    if not jsonl and len(out) > 1:
        raise TraceError(full, None, f"Weka JSON source {full} contains more than one object; use a .jsonl "
                                     "extension")
    return out


def _trace(full: str, k: int, obj) -> dict:
    """One play object, its fields typed as the reference's reader types them."""
    def bad(what: str):
        return TraceError(full, None, f"parsing Weka source {full} object {k}: {what}")

    if type(obj) is not dict:
        raise bad("invalid type: expected a Weka trace object")

    def need(o, key, kind, default=...):
        if key not in o or (o[key] is None and kind not in ("float?",)):
            if default is not ...:
                return default
            raise bad(f"missing field `{key}`")
        v = o[key]
        if kind == "str" and type(v) is str:
            return v
        if kind == "uint" and type(v) is int and 0 <= v < _U64:
            return v
        if kind == "int" and type(v) is int and -(1 << 63) <= v < 1 << 63:
            return v
        if kind == "float" and type(v) in (int, float):
            return float(v)
        if kind == "float?" and (v is None or type(v) in (int, float)):
            return None if v is None else float(v)
        if kind == "strs" and type(v) is list and all(type(x) is str for x in v):
            return v
        if kind == "uints" and type(v) is list and all(type(x) is int and 0 <= x < _U64 for x in v):
            return v
        raise bad(f"invalid type for `{key}`: {json.dumps(v)[:60]}")

    def request(e) -> dict:
        for key in ("input_types", "output_types"):
            need(e, key, "strs", [])
        if "stop" in e:
            need(e, "stop", "str")
        for key in ("think_time", "ttft"):
            need(e, key, "float?", None)
        return {"type": e["type"], "t": need(e, "t", "float"), "model": need(e, "model", "str"),
                "in": need(e, "in", "uint"), "out": need(e, "out", "uint"), "hash_ids": need(e, "hash_ids", "uints", []),
                "api_time": need(e, "api_time", "float?", None)}

    entries = []
    for e in _list(obj, "requests", bad):
        if type(e) is not dict:
            raise bad("invalid type: expected a request entry")
        kind = e.get("type")
        if kind in ("n", "s"):
            entries.append(request(e))
        elif kind == "subagent":
            status = need(e, "status", "str")
            need(e, "subagent_type", "str")
            for key in ("total_tokens", "tool_use_count"):
                need(e, key, "uint", None)
            for key in ("tool_tokens", "system_tokens"):
                need(e, key, "uint", 0)
            need(e, "models", "strs", [])
            inner = []
            for r in _list(e, "requests", bad):
                if type(r) is not dict:
                    raise bad("invalid type: expected a request entry")
                if r.get("type") not in ("n", "s"):
                    raise bad(f"unknown variant `{r.get('type')}`, expected `n` or `s`")
                inner.append(request(r))
            entries.append({"type": "subagent", "t": need(e, "t", "float"), "agent_id": need(e, "agent_id", "str"),
                            "status": status, "duration_ms": need(e, "duration_ms", "int", None),
                            "requests": inner})
        else:
            raise bad(f"unknown variant `{kind}`, expected one of `n`, `s`, `subagent`")
    for key in ("tool_tokens", "system_tokens"):
        need(obj, key, "uint", 0)
    return {"id": need(obj, "id", "str"), "models": need(obj, "models", "strs", []),
            "block_size": need(obj, "block_size", "uint"), "hash_id_scope": need(obj, "hash_id_scope", "str"),
            "requests": entries}


def _list(obj: dict, key: str, bad) -> list:
    if key not in obj or obj[key] is None:
        raise bad(f"missing field `{key}`")
    if type(obj[key]) is not list:
        raise bad(f"invalid type for `{key}`: expected a sequence")
    return obj[key]


def _check_play(src: str, full: str, t: dict) -> None:
    """The reference's header, model and request checks of one play, in its order."""
    def fail(what: str):
        raise TraceError(full, None, f"Weka trace {src} {what}")

    if not t["id"].strip():
        fail("has an empty id")
    if t["block_size"] == 0:
        fail("has zero block_size")
    if t["hash_id_scope"] != "local":
        fail(f"has unsupported hash_id_scope {json.dumps(t['hash_id_scope'])}; expected local")
    if any(not m.strip() for m in t["models"]):
        fail("declares an empty model")
    models = set()
    for e in t["requests"]:
        for r in (e["requests"] if e["type"] == "subagent" else [e]):
            if not r["model"].strip():
                fail("has an empty request model")
            models.add(r["model"])
    if not models:
        fail("has no model requests")
    if t["models"] and not models <= set(t["models"]):
        declared = "{" + ", ".join(json.dumps(m) for m in sorted(set(t["models"]))) + "}"
        found = "{" + ", ".join(json.dumps(m) for m in sorted(models)) + "}"
        fail(f"contains request models absent from its declaration: declared {declared}, found {found}")

    def check_request(r) -> None:
        if not math.isfinite(r["t"]) or r["t"] < 0:
            fail("has invalid request timestamp")
        if not r["model"].strip():
            fail("has an empty request model")
        if r["in"] == 0:
            fail("has a zero-length request")
        if r["api_time"] is not None and (not math.isfinite(r["api_time"]) or r["api_time"] < 0):
            fail("has invalid api_time; expected a finite non-negative value")
    for e in t["requests"]:
        if e["type"] != "subagent":
            check_request(e)
            continue
        if not math.isfinite(e["t"]) or e["t"] < 0:
            fail("has invalid subagent timestamp")
        if not e["agent_id"].strip():
            fail("has an empty subagent agent_id")
        if e["duration_ms"] is not None and e["duration_ms"] < 0:
            fail(f"has negative duration_ms for subagent {e['agent_id']}")
        if e["status"] not in ("completed", "async_launched"):
            fail(f"has unsupported non-success subagent status {json.dumps(e['status'])} for {e['agent_id']}")
        if e["status"] == "completed" and not e["requests"]:
            fail(f"has blocking subagent {e['agent_id']} with no replayable requests; external waits are not "
                 "modeled")
        for r in e["requests"]:
            check_request(r)


# ---------------------------------------------------------------------------------------------
# lowering one play


class _Req:
    __slots__ = ("sid", "order", "t", "api", "end", "hashes", "model", "n_in", "n_out")

    def __init__(self, sid: str, source_order: int, t: float, r: dict):
        self.sid, self.t, self.api = sid, t, r["api_time"]
        self.order = (t, source_order, sid)
        self.end = t + max(self.api or 0.0, 0.0)
        self.hashes, self.model, self.n_in, self.n_out = r["hash_ids"], r["model"], r["in"], r["out"]


class _Chain:
    __slots__ = ("requests", "fork", "spliced", "tail")

    def __init__(self):
        self.requests: list[_Req] = []
        self.fork = None      # [parent chain, fork request sid, depth, fork time]
        self.spliced = False
        self.tail: _Req | None = None

    def append(self, r: _Req) -> None:
        self.requests.append(r)
        if r.hashes:
            self.tail = r


def _lcp(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded to the nanosecond half away from zero (never
    negative), as the reference converts them."""
    return math.floor(max(seconds, 0.0) * 1e9 + 0.5) / 1e6


def _split_preamble(reqs: list) -> tuple[list, list]:
    reqs = sorted(reqs, key=lambda r: r.order)
    if len(reqs) < 2 or not reqs[0].hashes:
        return [], reqs
    first = reqs[0]
    if any(_lcp(first.hashes, r.hashes) > 0 for r in reqs[1:]):
        return [], reqs
    others = {h for r in reqs[1:] for h in r.hashes}
    if first.n_out > 64 and others.intersection(first.hashes):
        return [], reqs
    return [first], reqs[1:]


def _streams(reqs: list, by_sid: dict) -> list[tuple[list, str | None]]:
    """[(requests, fork request sid)] of one set of requests: the main stream (with the
    preamble), then the worker streams."""
    preamble, rest = _split_preamble(reqs)
    chains: list[_Chain] = []
    forks: dict[str, list[int]] = defaultdict(list)
    home: dict[str, int] = {}

    def put(k: int, r: _Req) -> None:
        chains[k].append(r)
        home[r.sid] = k
    for r in rest:
        if not r.hashes:
            if not chains:
                chains.append(_Chain())
            put(0, r)
            continue
        if not chains:
            chains.append(_Chain())
            put(0, r)
            continue
        best, best_len = None, -1
        for k, c in enumerate(chains):
            tail = c.tail
            if tail is None or not tail.hashes:
                continue
            n = len(tail.hashes)
            if n <= len(r.hashes) and tail.hashes == r.hashes[:n] and tail.model == r.model \
                    and tail.end <= r.t + EPS_S and n > best_len:
                best, best_len = k, n
        if best is not None:
            put(best, r)
            continue
        if all(c.tail is None for c in chains):
            put(0, r)
            continue
        parent, key = None, (0, -1)
        for k, c in enumerate(chains):
            if c.tail is None:
                continue
            d = _lcp(c.tail.hashes, r.hashes)
            if d > 0 and (d, len(c.tail.hashes)) > key:
                parent, key = k, (d, len(c.tail.hashes))
        depth = key[0] if parent is not None else 0
        fork_sid = chains[parent].tail.sid if parent is not None else None
        chains.append(_Chain())
        chains[-1].fork = [parent, fork_sid, depth, r.t]
        put(len(chains) - 1, r)
        if fork_sid and depth > 0:
            forks[fork_sid].append(len(chains) - 1)
    _resolve_seams(chains, forks, home, by_sid)
    live = sorted((k for k, c in enumerate(chains) if not c.spliced and c.requests),
                  key=lambda k: chains[k].requests[0].order)
    if not live:
        return [(sorted(preamble, key=lambda r: r.order), None)] if preamble else []
    main, workers = live[0], live[1:]
    fork_of = lambda c: c.fork[1] if c.fork is not None else None  # noqa: E731
    out = [(sorted(chains[main].requests + preamble, key=lambda r: r.order), fork_of(chains[main]))]
    out += [(list(chains[k].requests), fork_of(chains[k])) for k in workers]
    return out


def _resolve_seams(chains: list, forks: dict, home: dict, by_sid: dict) -> None:
    """Splice each fork that picks up where its parent chain's tail ended back into that
    chain (the deepest, then earliest, then first), re-parenting the other forks onto the
    new tail when they share a prefix with it."""
    alias: dict[int, int] = {}

    def resolve(k: int) -> int:
        while k in alias:
            k = alias[k]
        return k
    keys = set(forks)
    done: set = set()
    while keys:
        sid = min(keys)
        keys.discard(sid)
        if sid in done:
            continue
        done.add(sid)
        owner = resolve(home[sid])
        if chains[owner].tail is None or chains[owner].tail.sid != sid:
            continue
        tail = by_sid[sid]
        registered = [k for k in forks[sid] if not chains[k].spliced]

        def eligible(k: int) -> bool:
            c = chains[k]
            if c.fork[2] <= 0 or not c.requests:
                return False
            first = c.requests[0]
            if tail.end > first.t + EPS_S or first.model != tail.model:
                return False
            return not (first.t - tail.end > SEAM_MAX_GAP_S
                        and c.fork[2] / max(len(tail.hashes), 1) < SEAM_MIN_OVERLAP)
        candidates = [k for k in registered if eligible(k)]
        if not candidates:
            continue
        elected = min(candidates, key=lambda k: (-chains[k].fork[2], chains[k].fork[3], k))
        c_owner, c_elected = chains[owner], chains[elected]
        c_owner.requests += c_elected.requests
        c_owner.tail = c_elected.tail
        c_elected.spliced = True
        alias[elected] = owner
        new_tail = c_owner.tail
        for k in registered:
            c = chains[k]
            if k == elected or c.spliced:
                continue
            first = c.requests[0]
            if new_tail.t > first.t + EPS_S:
                continue
            d = _lcp(new_tail.hashes, first.hashes)
            if d == 0:
                continue
            c.fork = [owner, new_tail.sid, d, c.fork[3]]
            forks[new_tail.sid].append(k)
            done.discard(new_tail.sid)
            keys.add(new_tail.sid)


def _lower_play(src: str, full: str, t: dict, ordinal: int, relative: bool) -> list[GraphRow]:
    ns = "weka:" + blake3.blake3(src.encode()).hexdigest()[:16]
    play_id = f"{ns}:play:{t['id']}"
    entries = t["requests"]
    by_sid: dict[str, _Req] = {}
    top = []
    for i, e in enumerate(entries):
        if e["type"] != "subagent":
            r = _Req(f"outer:{i}", i, e["t"], e)
            top.append(r)
            by_sid[r.sid] = r
    if not top:
        raise TraceError(full, None, f"Weka trace {src} has no parent requests")
    # streams: (session, scope, requests, fork sid)
    streams = [(f"{ns}:session:root" + ("" if k == 0 else f":worker:{k - 1}"), f"{ns}:scope:root", reqs, fork)
               for k, (reqs, fork) in enumerate(_streams(top, by_sid))]
    outer_index = {r.sid: int(r.sid.split(":")[1]) for r in top}
    stream_of = {r.sid: k for k, s in enumerate(streams) for r in s[2]}
    joins = []  # (child stream indices, target sid)
    for i, e in enumerate(entries):
        if e["type"] != "subagent":
            continue
        owners = [r for r in top if outer_index[r.sid] < i]
        if not owners:
            raise TraceError(full, None, f"Weka trace {src} has subagent {e['agent_id']} at outer index {i} without "
                                         "a preceding parent request")
        owner = max(owners, key=lambda r: outer_index[r.sid])  # the latest authored before the marker
        inner = []
        for j, r in enumerate(e["requests"]):
            if relative:
                at = e["t"] + r["t"]
            else:
                if r["t"] < e["t"] - EPS_S:
                    raise TraceError(full, None, f"Weka source {src}, trace {t['id']}, subagent {e['agent_id']} inner "
                                                 f"request {j} at {_rust_f64(r['t'])} precedes its marker at "
                                                 f"{_rust_f64(e['t'])} under absolute nested_timestamp_basis")
                at = max(r["t"], e["t"])
            req = _Req(f"outer:{i}:inner:{j}", j, at, r)
            inner.append(req)
            by_sid[req.sid] = req
        if not inner:
            continue
        prefix = f"subagent:{i}:{e['agent_id']}"
        child = _streams(inner, by_sid)
        main_session = f"{ns}:session:{prefix}"
        first_child = len(streams)
        for k, (reqs, fork) in enumerate(child):
            session = main_session + ("" if k == 0 else f":worker:{k - 1}")
            streams.append((session, main_session, reqs, owner.sid if k == 0 else fork))
        if e["status"] == "completed":
            if e["duration_ms"] is not None:
                child_end = e["t"] + e["duration_ms"] / 1000.0
            else:
                child_end = max([e["t"]] + [r.end for r in inner])
            mine = streams[stream_of[owner.sid]][2]
            later = [r for r in mine if outer_index.get(r.sid, -1) > i and r.t + EPS_S >= child_end]
            if later:
                target = min(later, key=lambda r: outer_index[r.sid])
                joins.append((range(first_child, len(streams)), target.sid))
    deps: dict[str, list] = defaultdict(list)

    def push(target: str, source: str, trigger: int, delay_ms: float, relation: int) -> None:
        if any(d[0] == source and d[1] == trigger and d[3] == relation for d in deps[target]):
            return
        deps[target].append((source, trigger, delay_ms, relation))
    for _, _, reqs, _ in streams:
        for a, b in zip(reqs, reqs[1:]):
            push(b.sid, a.sid, TRIGGER_COMPLETION, _ms(b.t - a.end), RELATION_SEQUENCE)
    for _, _, reqs, fork in streams:
        if fork is None or not reqs:
            continue
        first, par = reqs[0], by_sid[fork]
        if first.t < par.end:
            push(first.sid, par.sid, TRIGGER_DISPATCH, _ms(first.t - par.t), RELATION_SPAWN)
        else:
            push(first.sid, par.sid, TRIGGER_COMPLETION, _ms(first.t - par.end), RELATION_SPAWN)
    scopes: dict[str, list[int]] = defaultdict(list)
    for k, s in enumerate(streams):
        scopes[s[1]].append(k)
    for scope in sorted(scopes):
        members = scopes[scope]
        for k in members:
            for x in streams[k][2]:
                frontier = []
                for o in members:
                    if o == k:
                        continue
                    done = [y for y in streams[o][2] if y.t < x.t and y.end <= x.t + EPS_S]
                    if done:
                        frontier.append(max(done, key=lambda y: (y.end, y.t, y.sid)))
                for y in frontier:
                    if not any(y.t < z.t and y.end <= z.t + EPS_S for z in frontier if z is not y):
                        push(x.sid, y.sid, TRIGGER_COMPLETION, 0.0, RELATION_REPLAY_BARRIER)
    for child_streams, target in joins:
        for k in child_streams:
            last = streams[k][2][-1]
            push(target, last.sid, TRIGGER_COMPLETION, _ms(by_sid[target].t - last.end), RELATION_JOIN)
    root = streams[0][2][0]
    for _, _, reqs, _ in streams:
        if reqs and reqs[0] is not root and not deps[reqs[0].sid]:
            push(reqs[0].sid, root.sid, TRIGGER_DISPATCH, _ms(reqs[0].t - root.t), RELATION_SPAWN)
    start = min(r.t for r in by_sid.values())
    block = t["block_size"]
    used: dict[int, str] = {}
    rows = []
    for session, _, reqs, _ in streams:
        for r in reqs:
            g = GraphRow()
            g.origin = (full, None)
            g.request_id = f"{ns}:request:{r.sid}"
            g.play_id, g.session_id, g.model = play_id, session, r.model
            g.input_length, g.output_length = r.n_in, r.n_out
            g.hash_ids = _prompt_hashes(src, g.request_id, r, block, used)
            g.output_token_ids = None
            g.not_before_ms = _ms(r.t - start)
            g.recorded_api_time_ms = None if r.api is None else _ms(r.api)
            g.source_play_ordinal = ordinal
            g.priority = g.strict_priority = 0
            g.policy_class = None
            g.dependencies = [(f"{ns}:request:{s}", trig, delay, rel) for s, trig, delay, rel in deps[r.sid]]
            rows.append(g)
    rows.sort(key=lambda g: g.request_id.encode())
    return rows


def _prompt_hashes(src: str, request_id: str, r: _Req, block: int, used: dict) -> list[int]:
    """The prompt's block identities: full blocks by the trace's hash id in this play
    (private to the request where it gives none), the tail block always private."""
    full, partial = divmod(r.n_in, block)
    out = []
    for b in range(full):
        identity = f"source:{src}:{r.hashes[b]}" if b < len(r.hashes) else f"private:missing:{request_id}:{b}"
        out.append(_unique_hash("weka-full-block", identity, used))
    if partial:
        out.append(_unique_hash("weka-partial-tail", f"{request_id}:{full}:{r.n_in}", used))
    return out


def _unique_hash(domain: str, identity: str, used: dict) -> int:
    nonce = 0
    while True:
        v = int.from_bytes(blake3.blake3(f"{domain}\0{identity}\0{nonce}".encode()).digest()[:8], "little")
        if used.setdefault(v, identity) == identity:
            return v
        nonce += 1


def _rust_f64(x: float) -> str:
    """A float as Rust's Display writes it (1, 0.25)."""
    return str(int(x)) if x == int(x) and abs(x) < 1e16 else repr(x)
