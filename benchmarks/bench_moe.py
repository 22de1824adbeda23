"""Mixture-of-experts serving benchmark (CPU, docs/moe.md): bytes moved per generated token and
time per token of ``tiermem.inference`` moving only the routed experts, against tiermem moving
every expert as any other weight (``experts=False``) and the plain model, same model, same
prompts, same run, rotating the order of the systems every round; and the moe system's recorded
acquires replayed through cache policies with the same room: Belady's optimum (MIN), LRU and a
static hot-expert placement (llama.cpp-style: the dense weights and the most used experts
pinned, every other expert streamed at each use; its hot list is taken from the recorded
counts, an oracle's).

Systems:
  plain     the model as it is (all weights in RAM)
  dense     tiermem.inference(experts=False): every layer's experts are weights of its unit.
            At the default sizes the budget holds four chunks of the largest fused tensor, so
            nothing is split and the layout is the one tiermem had before experts moved alone
  moe       tiermem.inference(): experts acquired when routed, prefetched at the router, the
            next layer's predicted and prefetched into room nothing else needs, cached by
            pick frequency (expert_cache.h)
  moe-evict the same, its predictions allowed to displace experts expected later
  moe-nvme  (--nvme DIR) host mode, host budget `--host-frac` of the weights, the rest homed on
            NVMe: NVMe bytes read per token against Belady's optimum for the host room the
            host-homed chunks and the KV cache leave, and time per token against the bound
            those bytes set at the fio read rate measured right after each run

Every system's tokens must equal the plain model's (greedy decoding), or the run stops.

Device budget (dense, moe): `--device-frac` of the weights plus the KV cache's final size at
that batch. The cache policies get, at each acquire, the room the engine had then (the
budget less the KV cache it had been told of), in chunks (every chunk is one size), and
count chunk fetches over the last run, warmed by the runs before it. Expert hit rate:
1 - expert chunks fetched / expert acquires; for tiermem its fetches are the expert copies
it started (routed and predicted prefetches, and acquires that found no copy), so unused
predictions count against it.

SimDevice: "device" copies are memcpys on the cores that compute, so times are a simulation
of a device, not of a GPU. "Per token" is per generated position: at batch B one decoding
step, B tokens. Times per token are generate() time over the new tokens, bytes per token the
bytes moved during generate() over the new tokens (the prompt's forward included in both).

`--impl` (default eager) is the experts implementation of the model every system runs:
tiermem computes each routed expert as that implementation does, but the plain and dense
systems run the implementation itself, and on the CPU transformers' grouped_mm falls back
to a loop over every expert, much slower than eager's loop over the routed ones: with
grouped_mm the time rows would compare implementations, not moves. `--threads` (default 1)
sets torch's intra-op threads, the same for every system: on the 2-core VM, two OpenMP threads
beside tiermem's copy threads (and another user's builds) made the small matmuls wait at
OpenMP barriers: 4 new tokens of the moe system at batch 8 took 64.8 s with two threads and
1.65 s with one (2026-12-06, under cProfile, not in the same minute).

The model is a Qwen3-MoE built from a config (random weights; nothing is downloaded): default
24 layers, 64 experts, top-8, hidden 256, expert width 128 (156.6 M params, 627 MB fp32).

    benchmarks/run.sh bench_moe [--batches 1,8] [--new-tokens 32] [--rounds 2]
        [--layers 24] [--experts 64] [--top-k 8] [--hidden 256] [--expert-width 128]
        [--device-frac 0.25] [--nvme DIR] [--host-frac 0.25] [--impl eager] [--threads 1]
        [--systems plain,dense,moe] [--train] [--json] [--verbose]

`--train` adds the training row: AdamW steps at `--device-frac` of params + grads, bytes
between host and device per step with experts moved alone and as any weights, against the
planner's OPT bound on the moe run's recorded step.
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import tiermem


def make_model(a, positions):
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        moe_intermediate_size=a.expert_width, num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
        head_dim=64, num_experts=a.experts, num_experts_per_tok=a.top_k, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=positions, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=None, pad_token_id=0)
    cfg._experts_implementation = a.impl
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def kv_bytes(model, batch, tokens):
    c = model.config
    return c.num_hidden_layers * 2 * batch * tokens * c.num_key_value_heads * c.head_dim * 4


def moved(stats, src, dst):
    return stats["bytes_moved"].get(f"{src}->{dst}", 0)


# ---- cache policies over a recorded sequence of acquires ----------------------------------------
def simulate(seq, experts, caps, policy, hot=None, count_from=0):
    """Fetches of `seq` (chunk groups in acquire order) through a cache whose room before
    acquire i is `caps[i]` chunks (all chunks are one size; the room is what the engine had
    then: the budget less the KV cache it had been told of). Policies: "min" (Belady: after
    each access, evict the farthest next uses down to the room — the access itself included,
    so a chunk used once is dropped at once: the fewest fetches any policy can make), "lru",
    or "static" (`hot`: the groups pinned; any other is fetched at each use into one
    streaming slot). Counted from position `count_from` on (the cache warmed by what comes
    before). Returns (fetches, expert accesses, expert hits)."""
    misses = e_acc = e_hit = 0
    if policy == "static":
        for i in range(count_from, len(seq)):
            g = seq[i]
            hit = g in hot
            misses += not hit
            if g in experts:
                e_acc += 1
                e_hit += hit
        return misses, e_acc, e_hit
    if policy == "lru":
        cache = collections.OrderedDict()
        for i, g in enumerate(seq):
            hit = g in cache
            if hit:
                cache.move_to_end(g)
            else:
                misses += i >= count_from
                cache[g] = True
            while len(cache) > max(caps[i], 1):
                cache.popitem(last=False)
            if g in experts and i >= count_from:
                e_acc += 1
                e_hit += hit
        return misses, e_acc, e_hit
    # Belady: next use of each position, then a max-heap of (next use) for the cached chunks.
    import heapq
    nxt = [0] * len(seq)
    last = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], len(seq) + i)  # never again: farther than any use
        last[seq[i]] = i
    cache, heap = {}, []  # group -> its next use; heap of (-next use, group), lazily cleaned
    for i, g in enumerate(seq):
        hit = g in cache
        if not hit:
            misses += i >= count_from
        cache[g] = nxt[i]
        heapq.heappush(heap, (-nxt[i], g))
        while len(cache) > caps[i]:
            nu, v = heapq.heappop(heap)
            if cache.get(v) == -nu:
                del cache[v]
        if g in experts and i >= count_from:
            e_acc += 1
            e_hit += hit
    return misses, e_acc, e_hit


def static_hot(seq, experts, capacity):
    """The static placement (llama.cpp-style, given the recorded counts: an oracle's hot
    list): every dense chunk, then the most used experts, in `capacity` - 1 chunks (one slot
    streams the others)."""
    counts = collections.Counter(seq)
    dense = [g for g in counts if g not in experts]
    hot = set(dense[:capacity - 1])
    for g, _ in counts.most_common():
        if len(hot) >= capacity - 1:
            break
        hot.add(g)
    return hot


def train_rows(a, ref, wbytes, workdir):
    """--train: `--train-steps` AdamW steps of the same model at a device budget of
    `--device-frac` of its params + grads, experts moved alone (moe) and as any weights
    (dense); bytes between host and device per step (after one warm-up step), the losses
    (equal: the same math), and the moe run's recorded step through the planner's OPT bound
    (``tiermem plan compare``: the fewest device-in bytes for that trace and budget)."""
    import subprocess
    import sys
    budget = int(a.device_frac * 2 * wbytes)
    g = torch.Generator().manual_seed(11)
    data = [torch.randint(1, a.vocab, (a.train_batch, 32), generator=g)
            for _ in range(a.train_steps + 1)]
    out, losses = {}, {}
    trace = os.path.join(workdir, "moe.tmtrace")
    for name in ("dense", "moe"):
        m, opt = tiermem.initialize(copy.deepcopy(ref).train(), {
            "device_kind": "sim", "device": budget, "host": 8 * wbytes,
            "optimizer": {"lr": 1e-4}}, experts=name == "moe")
        rt = tiermem.runtime_of(m)
        per_step, losses[name] = [], []
        for i, x in enumerate(data):
            if name == "moe" and i == 1:
                # Every step after the warm-up: the planner takes the trace's first iteration
                # as its own unmeasured warm-up (planner.md) and measures the others.
                rt.record_trace(trace, a.train_steps)
            st0 = rt.stats()
            opt.zero_grad()
            loss = m(x, labels=x).loss
            loss.backward()
            opt.step()
            st = rt.stats()
            losses[name].append(loss.item())
            if i > 0:
                per_step.append(sum(moved(st, s, d) - moved(st0, s, d)
                                    for s, d in (("host", "device"), ("device", "host"))))
        rt.finish_trace()
        rt.close()
        out[f"MB/step {name}"] = statistics.median(per_step) / 1e6
    if losses["dense"] != losses["moe"]:
        raise SystemExit(f"training losses differ: {losses}")
    row = {"train device budget MiB": budget / 2**20, **out,
           "train bytes moe/dense": out["MB/step moe"] / out["MB/step dense"]}
    r = subprocess.run([sys.executable, "-m", "tiermem", "plan", "compare", trace, "--device",
                        str(budget), "--host", str(8 * wbytes), "--json"],
                       capture_output=True, text=True)
    try:
        res = json.loads(r.stdout)
        res = res if isinstance(res, list) else res.get("results", res.get("policies", []))
        by = {p.get("policy"): p for p in res}
        if "error" in by["opt-recorded"]:
            raise KeyError(by["opt-recorded"]["error"])
        b = by["opt-recorded"]["bytes_per_iteration"]
        row["MB/step OPT (recorded)"] = (b["h2d"] + b["d2h"]) / 1e6
        row["train moe / OPT"] = out["MB/step moe"] / row["MB/step OPT (recorded)"]
        # The planner on this trace (simulated): its device-in bytes against the Belady
        # bound of the sequence it runs (plan compare's "opt").
        for pol in ("planned", "opt", "engine", "patrickstar"):
            if "error" not in by.get(pol, {"error": 1}):
                row[f"sim GB in/step {pol}"] = by[pol]["device_in_bytes_per_iteration"] / 1e9
                row[f"sim stall ms/step {pol}"] = by[pol]["stall_ns"] / 1e6
        if row.get("sim GB in/step opt"):
            row["sim planned / OPT"] = row["sim GB in/step planned"] / row["sim GB in/step opt"]
    except (ValueError, KeyError, TypeError):
        row["plan compare"] = (r.stdout + r.stderr)[-300:]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-width", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--impl", default="eager",
                    help="the model's experts implementation (transformers): eager (default) "
                         "or grouped_mm; see the module docstring")
    ap.add_argument("--device-frac", type=float, default=0.25)
    ap.add_argument("--systems", default="plain,dense,moe")
    ap.add_argument("--nvme", default=None, help="directory: also run moe-nvme (host mode)")
    ap.add_argument("--host-frac", type=float, default=0.25)
    ap.add_argument("--train", action="store_true", help="also the training row")
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print every run as it ends")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads (0: torch's default); see the docstring")
    a = ap.parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",") if b]  # none: --train alone
    systems = a.systems.split(",") + (["moe-nvme"] if a.nvme else [])
    tokens = a.prompt + a.new_tokens
    ref = make_model(a, max(64, tokens))
    wbytes = sum(p.numel() for p in ref.parameters()) * 4
    print(f"model: Qwen3-MoE {a.layers} layers x {a.experts} experts (top-{a.top_k}), hidden "
          f"{a.hidden}, expert width {a.expert_width}: {wbytes / 4e6:.1f} M params, "
          f"{wbytes / 2**20:.0f} MiB fp32; experts implementation {a.impl}; torch threads "
          f"{torch.get_num_threads()}", flush=True)
    workdir = tempfile.mkdtemp(prefix="tiermem-bench-moe-", dir=a.nvme)

    def device_budget(b):
        return int(wbytes * a.device_frac) + kv_bytes(ref, b, tokens)

    def build(name, b):
        m = copy.deepcopy(ref)
        if name == "plain":
            return m
        if name == "moe-nvme":
            return tiermem.inference(m, {"device_kind": "host", "host": int(wbytes * a.host_frac),
                                         "nvme": {"size": 2 * wbytes,
                                                  "path": os.path.join(workdir, f"nvme-{b}")}})
        m = tiermem.inference(m, {"device_kind": "sim", "device": device_budget(b),
                                  "host": 4 * wbytes}, experts=name != "dense")
        if name == "moe-evict":
            tiermem.runtime_of(m).experts.predict_evicts = True
        return m

    models = {(s, b): build(s, b) for s in systems for b in batches}
    # The acquires on the compute tier of the moe and moe-nvme systems, in order, every round
    # (the recorded routing), each with the KV cache bytes the engine had been told of then
    # (the room the budget left it); marks: where each run began; fetched: per run, the expert
    # chunks that system copied to its compute tier (routed and predicted prefetches that
    # started a copy, and acquires that found the chunk elsewhere).
    records = {(s, b): [] for s in ("moe", "moe-nvme") for b in batches}
    marks = {k: [] for k in records}
    fetched = {k: [] for k in records}
    predicted = {k: [] for k in records}  # of those, the predictions' copies
    at_acquire = {k: 0 for k in records}
    for (name, b), log in records.items():
        if name not in systems:
            continue
        rt = tiermem.runtime_of(models[(name, b)])
        experts = {gg for es in rt.expert_sets for gs in es.groups for gg in gs}

        def logged(group, kind, tier=None, _acq=rt.chunks.acquire, _log=log, _rt=rt,
                   _ex=experts, _key=(name, b)):
            ck = _rt.chunks
            if kind == ck.compute_kind:
                _log.append((group, _rt.cache_bytes))
                if group in _ex and _rt.session.resident(group, kind) != ck.tier:
                    at_acquire[_key] += 1
            return _acq(group, kind, tier)
        rt.chunks.acquire = logged
    g = torch.Generator().manual_seed(7)
    prompts = {b: torch.randint(1, a.vocab, (b, a.prompt), generator=g) for b in batches}

    def expert_fetches(key):
        st = tiermem.runtime_of(models[key]).experts.stats
        return st["hints"] + st["predicted_fetches"] + at_acquire[key]

    def run(name, b):
        ids = prompts[b]
        m = models[(name, b)]
        rt = tiermem.runtime_of(m) if name != "plain" else None
        before = rt.stats() if rt else None
        key = (name, b)
        if key in records:
            marks[key].append(len(records[key]))
            f0 = expert_fetches(key)
            p0 = tiermem.runtime_of(m).experts.stats["predicted_fetches"]
        t0 = time.perf_counter()
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                         min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
        st = rt.stats() if rt else None
        if key in records:
            fetched[key].append(expert_fetches(key) - f0)
            predicted[key].append(rt.experts.stats["predicted_fetches"] - p0)
        if rt is None:
            nbytes = 0
        elif name == "moe-nvme":
            nbytes = moved(st, "nvme", "host") - moved(before, "nvme", "host")
        else:
            nbytes = moved(st, "host", "device") - moved(before, "host", "device")
        return out, dt, nbytes

    times = {(s, b): [] for s in systems for b in batches}
    nbytes = {(s, b): [] for s in systems for b in batches}
    fio_read = {b: [] for b in batches}
    expected = {}  # per batch: the plain model's tokens (round 0 runs `systems` in order)
    for r in range(a.rounds + 1):  # round 0 warms up
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for b in batches:
            for s in order:
                out, dt, nb = run(s, b)
                if a.verbose:
                    print(f"  round {r} {s}@{b}: {dt:.2f} s, {nb / 1e6:.1f} MB", flush=True)
                if b not in expected:
                    expected[b] = out
                elif not torch.equal(out, expected[b]):
                    raise SystemExit(f"{s} at batch {b}, round {r}: tokens differ from "
                                     f"{systems[0]}'s")
                if r > 0:
                    times[(s, b)].append(dt)
                    nbytes[(s, b)].append(nb)
                    if s == "moe-nvme":
                        from benchmarks.fio import fio_rates
                        rates = fio_rates(workdir, "1G", "4M", 8, 4 << 20)
                        if rates:
                            fio_read[b].append(rates["read"])
        if r > 0 and batches:
            print(f"round {r}: " + ", ".join(
                f"{s}@{b} {times[(s, b)][-1]:.2f}s" for b in batches for s in systems),
                flush=True)
    rows = []
    for b in batches:
        row = {"batch": b, "device budget MiB": device_budget(b) / 2**20,
               "tokens equal to plain": "yes" if systems[0] == "plain" else "not checked"}
        n = a.new_tokens
        for s in systems:
            row[f"s/token {s}"] = statistics.median(times[(s, b)]) / n
            if s != "plain":
                row[f"MB/token {s}"] = statistics.median(nbytes[(s, b)]) / n / 1e6
        if "dense" in systems and "moe" in systems:
            row["bytes moe/dense"] = statistics.median(
                x / y for x, y in zip(nbytes[("moe", b)], nbytes[("dense", b)]))
            row["speedup moe vs dense"] = statistics.median(
                y / x for x, y in zip(times[("moe", b)], times[("dense", b)]))
        if "plain" in systems and "moe" in systems:
            row["t moe/plain"] = statistics.median(
                x / y for x, y in zip(times[("moe", b)], times[("plain", b)]))
        if "moe" in systems:
            key = ("moe", b)
            rt = tiermem.runtime_of(models[key])
            chunk = rt.session.chunk_bytes(0, rt._compute_kind)
            experts = {gg for es in rt.expert_sets for gs in es.groups for gg in gs}
            room = device_budget(b)  # the device budget; the KV cache takes its part of it
            seq = [gg for gg, _ in records[key]]
            caps = [(room - kv) // chunk for _, kv in records[key]]
            last = marks[key][-1]  # the policies over the last run, warmed by the ones before
            acc = sum(1 for gg in seq[last:] if gg in experts)
            res = {}
            for pol in ("min", "lru", "static"):
                hot = static_hot(seq, experts, min(caps)) if pol == "static" else None
                miss, e_acc, hit = simulate(seq, experts, caps, pol, hot, count_from=last)
                assert e_acc == acc
                res[pol] = (miss * chunk / n / 1e6, hit / max(acc, 1))
            ours = nbytes[key][-1] / n / 1e6  # the same run
            row["cache chunks"] = f"{min(caps[last:])}-{max(caps[last:])}"
            row["MB/token MIN"] = res["min"][0]
            row["moe / MIN"] = ours / res["min"][0] if res["min"][0] else float("inf")
            row["MB/token LRU"] = res["lru"][0]
            row["MB/token static"] = res["static"][0]
            # Expert hit rate: 1 - expert chunks fetched / expert acquires (for tiermem its
            # fetches include predictions that were not used).
            row["expert hits moe"] = 1 - fetched[key][-1] / max(acc, 1)
            row["expert hits MIN"] = res["min"][1]
            row["expert hits LRU"] = res["lru"][1]
            row["expert hits static"] = res["static"][1]
            row["expert acquires/token"] = acc / n
            row["moe expert fetches/token"] = fetched[key][-1] / n
            row["moe predicted fetches/token"] = predicted[key][-1] / n
            row["moe dense chunks fetched/token"] = (
                nbytes[key][-1] // chunk - fetched[key][-1]) / n
        if "moe-nvme" in systems:
            key = ("moe-nvme", b)
            rt = tiermem.runtime_of(models[key])
            s = rt.session
            ck = rt._compute_kind
            chunk = s.chunk_bytes(0, ck)
            on_nvme = {gg for gg in range(s.num_groups) if s.home(gg, ck) == tiermem._C.Tier.nvme}
            homed = sum(s.chunk_bytes(gg, ck) for gg in range(s.num_groups)
                        if s.home(gg, ck) == tiermem._C.Tier.host)
            host_cap = rt.stats()["tiers"]["host"]["capacity"]
            # The bytes bound: Belady over the NVMe-homed chunks' acquires, in the host room
            # that the host-homed chunks and the KV cache leave (the engine's staging room for
            # NVMe reads counted as cache: a bound, not what an engine could reach).
            log = [(gg, kv) for gg, kv in records[key]]
            last = marks[key][-1]
            sub = [(i, gg, (host_cap - homed - kv) // chunk) for i, (gg, kv) in enumerate(log)
                   if gg in on_nvme]
            first = next((j for j, (i, _, _) in enumerate(sub) if i >= last), len(sub))
            miss, _, _ = simulate([gg for _, gg, _ in sub], on_nvme, [c for _, _, c in sub],
                                  "min", count_from=first)
            row["nvme MB/token"] = nbytes[key][-1] / n / 1e6
            row["nvme MB/token MIN"] = miss * chunk / n / 1e6
            row["nvme / MIN"] = nbytes[key][-1] / (miss * chunk) if miss else float("inf")
            row["nvme host cache chunks"] = min(c for _, _, c in sub) if sub else 0
        if fio_read[b] and nbytes[("moe-nvme", b)]:
            t = [x / n for x in times[("moe-nvme", b)]]
            bound = [nb / n / (f * 1e9) for nb, f in zip(nbytes[("moe-nvme", b)], fio_read[b])]
            row["nvme s/token"] = statistics.median(t)
            row["nvme bound s/token"] = statistics.median(bound)
            row["nvme / bound"] = statistics.median(x / y for x, y in zip(t, bound))
            if "plain" in systems:
                row["nvme / plain"] = statistics.median(
                    x / y for x, y in zip(times[("moe-nvme", b)], times[("plain", b)]))
            row["fio read GB/s"] = statistics.median(fio_read[b])
        rows.append(row)
    if a.train:
        rows.append(train_rows(a, ref, wbytes, workdir))
    for row in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()))
    if a.json:
        print(json.dumps({"rows": rows, "weights_bytes": wbytes}))
    for m in models.values():
        rt = getattr(m, "_tiermem_runtime", None)
        if rt is not None:
            rt.close()
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
