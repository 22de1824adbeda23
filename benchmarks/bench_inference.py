"""Offloaded-inference benchmark (CPU): greedy generate() tokens/s of tiermem.inference vs the
plain model and Hugging Face Accelerate's ``cpu_offload`` and ``disk_offload``, same model,
same prompts, same run, alternating the order of the systems every round (these machines are
noisy: per-round ratios, then their median).

Systems (docs/inference.md):
  plain         the model as it is (all weights in RAM, no budget)
  tiermem-host  weights homed in host DRAM, device budget `--device-frac` of the weights plus
                the KV cache's final size at that batch (the cache counts in the device
                budget, so the weights get the same share at every batch size); without a
                GPU, host mode: compute against the weights in place, no device budget
  tiermem-nvme  the same device budget, host budget `--host-frac` of the weights, the rest of
                the weights homed on NVMe (`--dir`); its time per token is compared with the
                bound set by the NVMe bytes it read per token at the fio read rate measured
                right after each of its runs (per round; the ratio's median is reported) in
                the same run with the same advantages (O_DIRECT, io_uring, --fixedbufs
                --registerfiles, the same block size and depth)
  acc-cpu       accelerate.cpu_offload(model, execution_device=cpu)
  acc-disk      accelerate.disk_offload(model, dir, execution_device=cpu)

The model is a GPT-2 (random weights from a config; nothing is downloaded). Default: 24 x 1024
with a 4096-token vocabulary (311 M params, 1.25 GB fp32): the vocabulary is cut so that the
largest tensor (the tied embedding) is small enough for a 10% budget: tiermem's chunks hold
whole tensors and the layout keeps four chunks resident.

    benchmarks/run.sh bench_inference [--batches 1,8,32] [--new-tokens 16]
        [--rounds 2] [--layers 24] [--width 1024] [--vocab 4096] [--dir DIR]
        [--prefetch-depth N] [--drop-caches] [--json]

`--drop-caches` (root) empties the page cache before every acc-disk run, as a cold start
would find it: disk_offload then reads its weights from the disk (tiermem-nvme reads with
O_DIRECT and never uses the page cache).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import tiermem
from benchmarks import tier_config
from benchmarks.fio import fio_rates


def make_model(layers, width, vocab, positions):
    import transformers
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width,
                                  n_layer=layers, n_head=max(1, width // 64), bos_token_id=0,
                                  eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def kv_bytes(model, batch, tokens):
    c = model.config
    return c.n_layer * 2 * batch * tokens * c.n_embd * 4


def nvme_bytes_read(stats):
    return sum(v for k, v in stats["bytes_moved"].items() if k.startswith("nvme->"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--device-frac", type=float, default=0.10)
    ap.add_argument("--host-frac", type=float, default=0.10)
    ap.add_argument("--systems", default="plain,tiermem-host,tiermem-nvme,acc-cpu,acc-disk")
    ap.add_argument("--dir", default=None, help="directory for NVMe files and disk_offload")
    ap.add_argument("--prefetch-depth", type=int, default=None,
                    help="tiermem's prefetch_depth (acquires of lookahead; default: the config's)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="sync and drop the page cache before each acc-disk run (root), so "
                         "disk_offload reads its weights from the disk, not from RAM")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    extra = {} if a.prefetch_depth is None else {"prefetch_depth": a.prefetch_depth}
    batches = [int(b) for b in a.batches.split(",")]
    systems = a.systems.split(",")
    workdir = tempfile.mkdtemp(prefix="tiermem-bench-inf-", dir=a.dir)
    tokens = a.prompt + a.new_tokens
    ref = make_model(a.layers, a.width, a.vocab, max(64, tokens))
    wbytes = sum(p.numel() for p in ref.parameters()) * 4
    nparams = wbytes // 4
    print(f"model: GPT-2 {a.layers} x {a.width}, vocab {a.vocab}: {nparams / 1e6:.1f} M params, "
          f"{wbytes / 2**20:.0f} MiB fp32; torch threads {torch.get_num_threads()}", flush=True)
    host_nvme = int(wbytes * a.host_frac)
    host_mode = "device" not in tier_config("auto", 1, 1)

    def device_budget(b):  # the weights' share is the same at every batch size
        return int(wbytes * a.device_frac) + kv_bytes(ref, b, tokens)

    for b in batches:
        print(f"batch {b}: device budget {device_budget(b) / 2**20:.0f} MiB = "
              f"{a.device_frac:.0%} of the weights + the final KV cache "
              f"({kv_bytes(ref, b, tokens) / 2**20:.1f} MiB)", flush=True)
    print(f"tiermem-nvme: host budget {host_nvme / 2**20:.0f} MiB"
          + (" + the final KV cache, kept as host_reserve (host mode: no device)"
             if host_mode else ""), flush=True)

    def build(name, b):
        m = copy.deepcopy(ref)
        if name == "plain":
            return m
        # Without a GPU, auto is host mode: no device budget (compute on the CPU against the
        # chunks in host memory); the device budget is a GPU's.
        if name == "tiermem-host":
            return tiermem.inference(m, {**tier_config("auto", device_budget(b), 4 * wbytes),
                                         **extra})
        if name == "tiermem-nvme":
            # In host mode the KV cache counts in the host budget: the weights' share stays
            # `--host-frac` at every batch size, as the device's does with a device.
            # host_reserve keeps the cache's room free of weight homes (they never move).
            kv = kv_bytes(ref, b, tokens) if host_mode else 0
            extra_b = {**extra, "host_reserve": kv} if kv else extra
            return tiermem.inference(m, {**tier_config("auto", device_budget(b), host_nvme + kv),
                                         "nvme": {"size": 2 * wbytes,
                                                  "path": os.path.join(workdir, f"nvme-{b}")},
                                         **extra_b})
        import accelerate
        if name == "acc-cpu":
            return accelerate.cpu_offload(m, execution_device=torch.device("cpu"))
        if name == "acc-disk":
            return accelerate.disk_offload(m, os.path.join(workdir, "acc-disk"),
                                           execution_device=torch.device("cpu"))
        raise SystemExit(f"unknown system {name}")

    models = {}  # (system, batch) -> model; tiermem gets one per batch (its budget)
    for s in systems:
        t0 = time.perf_counter()
        for b in batches:
            if s.startswith("tiermem") or b == batches[0]:
                models[(s, b)] = build(s, b)
            else:
                models[(s, b)] = models[(s, batches[0])]
        print(f"  {s}: set up in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(7)
    prompts = {b: torch.randint(1, a.vocab, (b, a.prompt), generator=g) for b in batches}

    def drop_caches():
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError as e:
            raise SystemExit(f"--drop-caches: cannot drop the page cache ({e}); run as root")

    def run(name, b):
        ids = prompts[b]
        if a.drop_caches and name == "acc-disk":
            drop_caches()  # outside the timed part
        m = models[(name, b)]
        rt = tiermem.runtime_of(m) if name.startswith("tiermem") else None
        before = rt.stats() if rt else None
        t0 = time.perf_counter()
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                         min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
        nvme_read = nvme_bytes_read(rt.stats()) - nvme_bytes_read(before) if rt else 0
        return out, dt, nvme_read

    times = {(s, b): [] for s in systems for b in batches}
    nvme_bytes = {b: [] for b in batches}
    fio_read = {b: [] for b in batches}  # fio's read GB/s right after each timed tiermem-nvme run
    fio_iomem = None
    expected = {}
    for r in range(a.rounds + 1):  # round 0 warms up (records the order, faults pages in)
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for b in batches:
            for s in order:
                out, dt, nr = run(s, b)
                if b not in expected:
                    expected[b] = out
                elif not torch.equal(out, expected[b]):
                    raise SystemExit(f"{s} at batch {b}: tokens differ from {systems[0]}")
                if r > 0:
                    times[(s, b)].append(dt)
                    if s == "tiermem-nvme":
                        nvme_bytes[b].append(nr)
                        # The disk's rate varies by the minute here: measure it next to the run.
                        rates = fio_rates(workdir, "1G", "4M", 8, 4 << 20)
                        if rates:
                            fio_read[b].append(rates["read"])
                            fio_iomem = rates["iomem"]
        if r > 0:
            print(f"round {r}: " + ", ".join(
                f"{s}@{b} {times[(s, b)][-1]:.2f}s" for b in batches for s in systems), flush=True)
    rows = []
    for b in batches:
        new = b * a.new_tokens
        row = {"batch": b}
        for s in systems:
            row[f"tok/s {s}"] = new / statistics.median(times[(s, b)])
        for s in systems:
            if s != "plain" and "plain" in systems:
                row[f"t {s}/plain"] = statistics.median(  # time ratio: < 2 is the goal
                    tx / tp for tx, tp in zip(times[(s, b)], times[("plain", b)]))
        for base in ("acc-disk", "acc-cpu"):
            for s in ("tiermem-host", "tiermem-nvme"):
                if base in systems and s in systems:
                    row[f"speedup {s} vs {base}"] = statistics.median(
                        tb / ts for ts, tb in zip(times[(s, b)], times[(base, b)]))
        if nvme_bytes[b] and len(fio_read[b]) == len(nvme_bytes[b]):
            # Per round: the forward's time against its NVMe bytes at that round's fio rate.
            t_fwd = [t / a.new_tokens for t in times[("tiermem-nvme", b)]]
            bound = [n / a.new_tokens / (f * 1e9) for n, f in zip(nvme_bytes[b], fio_read[b])]
            row["nvme GB/forward"] = statistics.median(nvme_bytes[b]) / a.new_tokens / 1e9
            row["fio read GB/s"] = statistics.median(fio_read[b])
            row["nvme s/forward"] = statistics.median(t_fwd)
            row["nvme bound s/forward"] = statistics.median(bound)
            row["nvme / bound"] = statistics.median(t / x for t, x in zip(t_fwd, bound))
        rows.append(row)
    print(f"fio read after each tiermem-nvme run (io_uring, O_DIRECT, 4 MiB, depth 8, "
          f"fixedbufs+registerfiles, iomem={fio_iomem}): " +
          (", ".join(f"batch {b}: " + " ".join(f"{x:.2f}" for x in fio_read[b]) + " GB/s"
                     for b in batches) if fio_iomem else "not measured"))
    for row in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()))
    if a.json:
        print(json.dumps({"rows": rows, "fio_read_gbps": fio_read, "params": nparams,
                          "device_budgets": {b: device_budget(b) for b in batches},
                          "host_budget_nvme": host_nvme}))
    for m in {id(m): m for m in models.values()}.values():
        rt = getattr(m, "_tiermem_runtime", None)
        if rt is not None:
            rt.close()
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
