"""Pretrained-weights benchmark (CPU; issue 42 §5): loading a Hugging Face checkpoint into
tiermem's tiers and exporting it back, against fio and the libraries a user would use instead,
in the same run.

The checkpoint is a bf16 Llama written shard by shard from random values
(`demo_pretrained.write_checkpoint`; default 24 x 1536, vocabulary 4096, 607 M params, 1.21 GB,
3 shards). Every measurement runs in a fresh process which, after its imports and right before
the load, runs `sync; echo 3 > /proc/sys/vm/drop_caches` (root; where that is refused the run
says so: tiermem and fio read with O_DIRECT and never see the page cache, the baselines then
read from memory). Each round
runs the systems in a rotated order, then fio; ratios are per round against that round's fio,
and their median is printed.

  tiermem     the model on the meta device, `tiermem.initialize(model, cfg, weights=CKPT)`
              (fp32 chunks; host budget --host, the rest homed on NVMe in --nvme-dir), then
              `tiermem.save_pretrained(model, OUT)` (fp32, the masters).
  meta        today's meta init of the same model (`initialize` without weights; the model
              built under accelerate's `init_empty_weights`, its buffers real, values from the
              model's `_init_weights`): the RSS baseline.
  hf          transformers `from_pretrained(CKPT, dtype=float32)` (the whole model in RAM),
              then its `save_pretrained(OUT)` and a sync.
  accelerate  `load_checkpoint_and_dispatch` on an empty model with a `device_map` that
              puts every decoder layer on "disk" (`offload_folder`) and the embedding, the
              final norm and the head on the CPU, dtype float32.

Goal rows (docs/benchmarks.md "Pretrained weights"):
  load   tiermem's load time <= 1.25 x its bound: the checkpoint's bytes at fio's sequential
         read rate on the checkpoint's own largest shard, plus the bytes the load wrote
         (/proc/self/io write_bytes: the NVMe-homed chunks) at fio's write rate in --nvme-dir
         (same engine, O_DIRECT, 1 MiB, depth 8, registered buffers and files).
  RSS    the peak of RssAnon (/proc/self/status, sampled every 2 ms on a thread) during the
         load minus RssAnon just before it <= host budget + 256 MiB of staging + the runtime's
         fixed overhead (`stats()["outside_budget"]["runtime_bytes"]`), for a checkpoint >= 4 x
         the host budget (the ratio is printed); the meta init's growth beside it.
  export tiermem's save_pretrained time <= 1.25 x its bound: the bytes read from the tiers
         (the NVMe-homed bytes the load wrote) at fio's read rate plus the bytes written
         (write_bytes, synced) at fio's write rate.

    benchmarks/run.sh bench_weights [--layers 24 --hidden 1536 --vocab 4096] [--host 256MiB]
        [--rounds 3] [--nvme-dir DIR] [--systems tiermem,meta,hf,accelerate] [--quick]

Prints one table and one JSON line. `--quick`: a tiny Llama, one round, the page cache left
alone (`--no-drop`; seconds; the tests).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks import child_env
from benchmarks.fio import fio_rates, fio_read_file

CHILD = r"""
import json, os, sys, threading, time
import torch, transformers
p = json.loads(sys.argv[1])

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

def io():
    with open("/proc/self/io") as f:
        d = dict(l.split(": ") for l in f.read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])

def drop_caches():
    # After the imports, right before the operation: the page cache holds no checkpoint byte,
    # and the library pages this process has mapped stay (the kernel keeps mapped pages).
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False

class Measure:
    # Seconds, RssAnon growth (peak sampled every 2 ms minus the value before) and the bytes
    # the process read from and wrote to storage (/proc/self/io) of one operation.
    def __init__(self, drop=False):
        self.dropped = drop and drop_caches()
    def __enter__(self):
        self.base = status("RssAnon:")
        self.peak = self.base
        self.done = threading.Event()
        def sample():
            while not self.done.is_set():
                self.peak = max(self.peak, status("RssAnon:"))
                time.sleep(0.002)
        self.th = threading.Thread(target=sample, daemon=True)
        self.th.start()
        self.io0 = io()
        self.t0 = time.perf_counter()
        return self
    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
        r, w = io()
        self.done.set(); self.th.join()
        self.peak = max(self.peak, status("RssAnon:"))
        self.row = {"s": self.s, "rss_anon_growth": self.peak - self.base,
                    "rss_anon_before": self.base, "read_bytes": r - self.io0[0],
                    "write_bytes": w - self.io0[1], "cache_dropped": self.dropped}

config = transformers.AutoConfig.from_pretrained(p["ckpt"])
out = {"system": p["system"]}
if p["system"] in ("tiermem", "meta"):
    import tiermem
    cfg = {"host": p["host"], "nvme": {"size": p["nvme_size"], "path": p["work"] + "/nvme"}}
    if p["system"] == "tiermem":
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    else:
        import accelerate
        with accelerate.init_empty_weights():
            model = transformers.LlamaForCausalLM(config)
    with Measure(drop=p["drop"]) as m:
        if p["system"] == "tiermem":
            model, opt = tiermem.initialize(model, cfg, weights=p["ckpt"])
        else:
            model, opt = tiermem.initialize(model, cfg, init=model._init_weights)
    out["load"] = m.row
    out["runtime_bytes"] = tiermem.runtime_of(model).stats()["outside_budget"]["runtime_bytes"]
    if p["system"] == "tiermem":
        with Measure() as m:
            tiermem.save_pretrained(model, p["work"] + "/export")
        out["export"] = m.row
    tiermem.runtime_of(model).close()
elif p["system"] == "hf":
    with Measure(drop=p["drop"]) as m:
        model = transformers.AutoModelForCausalLM.from_pretrained(p["ckpt"], dtype=torch.float32)
    out["load"] = m.row
    with Measure() as m:
        model.save_pretrained(p["work"] + "/export")
        os.sync()
    out["export"] = m.row
elif p["system"] == "accelerate":
    import accelerate
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" for i in range(config.num_hidden_layers)})
    with Measure(drop=p["drop"]) as m:
        model = accelerate.load_checkpoint_and_dispatch(
            model, p["ckpt"], device_map=device_map, offload_folder=p["work"] + "/offload",
            dtype=torch.float32)
    out["load"] = m.row
print("RESULT " + json.dumps(out))
"""


def drop_caches() -> bool:
    """sync and empty the page cache (root); False where the kernel refuses."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_child(params: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(params)], capture_output=True,
                         text=True, env=child_env())
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{params['system']} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def bound_s(read_bytes: int, write_bytes: int, fio: dict) -> float:
    """The seconds `read_bytes` and `write_bytes` take at fio's rates (GB/s)."""
    return read_bytes / (fio["read"] * 1e9) + write_bytes / (fio["write"] * 1e9)


def load_bound(row: dict, ckpt_bytes: int, fio: dict) -> float:
    """The load's bound: the checkpoint's bytes read, the NVMe-homed bytes the load wrote
    (its write_bytes; the read_bytes would also count library pages faulted in)."""
    return bound_s(ckpt_bytes, row["load"]["write_bytes"], fio)


def export_bound(row: dict, fio: dict) -> float:
    """The export's bound: the NVMe-homed parameter bytes read back (what the load wrote
    there) and the bytes the export wrote."""
    return bound_s(row["load"]["write_bytes"], row["export"]["write_bytes"], fio)


def parse_bytes(text: str) -> int:
    import tiermem
    return tiermem.parse_config({"host": text}).host_budget


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=None, help="default: hidden / 128")
    ap.add_argument("--kv-heads", type=int, default=None, help="default: heads / 4")
    ap.add_argument("--intermediate", type=int, default=None, help="default: 8/3 hidden, to 256")
    ap.add_argument("--host", default="256MiB", help="tiermem's host budget")
    ap.add_argument("--shard", type=int, default=500 * 10**6, help="checkpoint shard bytes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default="tiermem,meta,hf,accelerate")
    ap.add_argument("--nvme-dir", default=None,
                    help="directory for the checkpoint, NVMe homes, exports (default: a temp dir)")
    ap.add_argument("--fio-size", default="1G", help="fio's write file size")
    ap.add_argument("--no-drop", action="store_true",
                    help="leave the page cache alone (the baselines may read from memory)")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny Llama, one round, the page cache left alone (a test)")
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.vocab, a.host, a.rounds = 2, 128, 1000, "4MiB", 1
        a.shard, a.fio_size, a.no_drop = 300_000, "16M", True
    from benchmarks.demo_pretrained import checkpoint_tensors, llama_config, write_checkpoint
    heads = a.heads or max(1, a.hidden // 128)
    kv = a.kv_heads or max(1, heads // 4)
    inter = a.intermediate or 256 * math.ceil(a.hidden * 8 / 3 / 256)
    config = llama_config(a.layers, a.hidden, a.vocab, heads, kv, inter)
    nparams = sum(math.prod(s) for _, s in checkpoint_tensors(config))
    systems = a.systems.split(",")
    host = parse_bytes(a.host)
    work = tempfile.mkdtemp(prefix="tiermem-bench-weights-", dir=a.nvme_dir)
    try:
        ckpt = os.path.join(work, "ckpt")
        ckpt_bytes = write_checkpoint(config, ckpt, a.shard)
        shards = [os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors")]
        largest = max(shards, key=os.path.getsize)
        print(f"checkpoint: Llama {a.layers} x {a.hidden}, vocabulary {a.vocab}, {heads} heads, "
              f"{kv} KV heads, intermediate {inter}: {nparams / 1e6:.1f} M params, bf16 "
              f"{ckpt_bytes / 1e9:.2f} GB in {len(shards)} shards = "
              f"{ckpt_bytes / host:.1f} x the host budget {a.host}", flush=True)
        rows, fio, dropped = {s: [] for s in systems}, [], True
        for r in range(a.rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for s in order:
                sub = os.path.join(work, f"run-{s}")
                os.makedirs(sub)
                rows[s].append(run_child({"system": s, "ckpt": ckpt, "work": sub, "host": a.host,
                                          "nvme_size": 20 * nparams + (256 << 20),
                                          "drop": not a.no_drop}))
                dropped &= rows[s][-1]["load"]["cache_dropped"]
                shutil.rmtree(sub, ignore_errors=True)
            if not a.no_drop:
                dropped &= drop_caches()
            read = fio_read_file(largest)
            rates = fio_rates(work, a.fio_size)
            fio.append({"read": read, "write": rates["write"]} if read and rates else None)
            print(f"round {r + 1}: " + ", ".join(
                f"{s} load {rows[s][-1]['load']['s']:.2f} s" for s in systems) +
                  (f"; fio read {read:.2f} GB/s, write {rates['write']:.2f} GB/s"
                   if fio[-1] else "; fio not measured"), flush=True)
        if a.no_drop:
            print("--no-drop: the page cache was not dropped (hf and accelerate may have read "
                  "from memory; tiermem and fio read with O_DIRECT)", flush=True)
        elif not dropped:
            print("the page cache could not be dropped (not root?): hf and accelerate may have "
                  "read from memory; tiermem and fio read with O_DIRECT", flush=True)
        report(a, systems, rows, fio, host, ckpt_bytes, nparams)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(a, systems, rows, fio, host, ckpt_bytes, nparams):
    med = statistics.median
    table, summary = [], {"params": nparams, "checkpoint_bytes": ckpt_bytes, "host": host,
                          "rounds": a.rounds, "fio": fio}
    for s in systems:
        load = [x["load"] for x in rows[s]]
        line = {"system": s, "load s": med(x["s"] for x in load),
                "RssAnon growth MiB": med(x["rss_anon_growth"] for x in load) / 2**20,
                "read GB": med(x["read_bytes"] for x in load) / 1e9,
                "written GB": med(x["write_bytes"] for x in load) / 1e9}
        if all("export" in x for x in rows[s]):
            line["export s"] = med(x["export"]["s"] for x in rows[s])
        if s == "tiermem" and all(fio):
            line["load / bound"] = med(x["load"]["s"] / load_bound(x, ckpt_bytes, f)
                                       for x, f in zip(rows[s], fio))
            line["export / bound"] = med(x["export"]["s"] / export_bound(x, f)
                                         for x, f in zip(rows[s], fio))
        if s in ("tiermem", "meta"):
            line["runtime MiB"] = med(x["runtime_bytes"] for x in rows[s]) / 2**20
        table.append(line)
    for base in ("hf", "accelerate"):
        if base in systems and "tiermem" in systems:
            summary[f"load speedup vs {base}"] = med(
                b["load"]["s"] / t["load"]["s"] for t, b in zip(rows["tiermem"], rows[base]))
    if "hf" in systems and "tiermem" in systems:
        summary["export speedup vs hf"] = med(
            b["export"]["s"] / t["export"]["s"] for t, b in zip(rows["tiermem"], rows["hf"]))
    keys = list(dict.fromkeys(k for line in table for k in line))
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for line in table:
        print("| " + " | ".join(f"{line[k]:.3f}" if isinstance(line.get(k), float)
                                else str(line.get(k, "")) for k in keys) + " |")
    if "tiermem" in systems:
        t = next(line for line in table if line["system"] == "tiermem")
        limit = host / 2**20 + 256 + t["runtime MiB"]
        summary["rss_limit_mib"] = limit
        summary["rss_growth_mib"] = t["RssAnon growth MiB"]
        print(f"RSS goal: growth {t['RssAnon growth MiB']:.0f} MiB <= host "
              f"{host / 2**20:.0f} + staging 256 + runtime {t['runtime MiB']:.0f} = "
              f"{limit:.0f} MiB: {'met' if t['RssAnon growth MiB'] <= limit else 'NOT met'}"
              f" (checkpoint {ckpt_bytes / host:.1f} x the host budget)")
        for goal in ("load / bound", "export / bound"):
            if goal in t:
                print(f"{goal.split()[0]} goal: {t[goal]:.2f} x its fio bound <= 1.25: "
                      f"{'met' if t[goal] <= 1.25 else 'NOT met'}")
    for k, v in summary.items():
        if "speedup" in k:
            print(f"{k}: {v:.2f} x")
    print(json.dumps({"bench": "weights", "table": table, **summary}))


if __name__ == "__main__":
    main()
