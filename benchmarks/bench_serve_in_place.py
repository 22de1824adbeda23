"""Serving in place from the checkpoint (issue 42 §2; docs/inference.md "Serving in place"):
first-token time and tokens/s of ``tiermem.inference(model, config, weights=DIR)`` whose
NVMe-homed chunks are read straight from the checkpoint's files, against the time the bytes
it read take at fio's sequential O_DIRECT read rate on the same file system (goal: <= 1.10x).

    benchmarks/run.sh bench_serve_in_place --dir /mnt/nvme/ckpt [--target-gb 39]
        [--layers L --width W --vocab V] [--dtype bf16|fp32] [--host 2GiB]
        [--new-tokens 4] [--json]
    benchmarks/run.sh bench_serve_in_place --compute-only [--threads 2]

The checkpoint is a Llama-shaped model (hidden W, L layers, intermediate 8/3 W rounded to 256,
GQA with 8 KV heads, untied head) written shard by shard from random values by this script
(``--target-gb`` picks L at W = 4096 unless given), never whole in memory: each shard is
made, written with safetensors and dropped before the next. A directory that already holds
``model.safetensors.index.json`` with the same shape is reused. The model is built with its
parameters on the meta device (accelerate's ``init_empty_weights``) and served in host mode (``device_kind: host``) with ``--host`` of host budget, the rest
homed on NVMe, ``in_place: on``; the page cache is not involved (O_DIRECT).

``--compute-only``: what bf16 compute costs on this CPU against fp32 — torch matmuls of a
served model's shapes (a decode step: [B, W] x [W, W] and [W, 4W]; a prefill of 128 tokens)
in each dtype, on ``--threads`` threads, median of repeats: the measurement that picks the
in_place default (docs/benchmarks.md, "Serving in place").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import tiermem


def matmul_rates(threads: int, width: int, repeats: int = 7) -> list[dict]:
    """Per shape: ms per matmul in fp32 and bf16 and the ratio (bf16 / fp32)."""
    torch.set_num_threads(threads)
    out = []
    g = torch.Generator().manual_seed(0)
    for rows, inner, cols in [(1, width, width), (4, width, 4 * width), (128, width, width)]:
        row = {"shape": f"[{rows}, {inner}] x [{inner}, {cols}]"}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(rows, inner, generator=g).to(dtype)
            w = torch.randn(inner, cols, generator=g).to(dtype)
            torch.matmul(a, w)  # warm-up
            times = []
            n = max(1, int(2e8 // (rows * inner * cols)) + 1)
            for _ in range(repeats):
                t = time.perf_counter()
                for _ in range(n):
                    torch.matmul(a, w)
                times.append((time.perf_counter() - t) / n)
            row["fp32_ms" if dtype == torch.float32 else "bf16_ms"] = statistics.median(times) * 1e3
        row["bf16_over_fp32"] = row["bf16_ms"] / row["fp32_ms"]
        out.append(row)
    return out


def llama_config(layers, width, vocab):
    import transformers
    inter = (8 * width // 3 + 255) // 256 * 256
    heads = max(1, width // 128)
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=inter,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=min(8, heads),
                                    max_position_embeddings=256, tie_word_embeddings=False,
                                    bos_token_id=0, eos_token_id=None, pad_token_id=0)


def layer_bytes(cfg, esize):
    w, i = cfg.hidden_size, cfg.intermediate_size
    kv = w // cfg.num_attention_heads * cfg.num_key_value_heads
    return (2 * w * w + 2 * w * kv + 3 * w * i + 2 * w) * esize


def write_checkpoint(d, cfg, dtype, shard_bytes=2 << 30):
    """A Hugging Face directory of random `dtype` shards of cfg's Llama, one shard in memory at
    a time (a layer's tensors never split across shards)."""
    from safetensors.torch import save_file
    idx = os.path.join(d, "model.safetensors.index.json")
    want = {"layers": cfg.num_hidden_layers, "width": cfg.hidden_size, "vocab": cfg.vocab_size,
            "dtype": str(dtype)}
    if os.path.exists(idx):
        with open(idx) as f:
            if json.load(f).get("metadata", {}).get("shape") == want:
                return
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    w, i = cfg.hidden_size, cfg.intermediate_size
    kv = w // cfg.num_attention_heads * cfg.num_key_value_heads

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    groups = [{"model.embed_tokens.weight": (cfg.vocab_size, w)}]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        groups.append({p + "self_attn.q_proj.weight": (w, w), p + "self_attn.k_proj.weight": (kv, w),
                       p + "self_attn.v_proj.weight": (kv, w), p + "self_attn.o_proj.weight": (w, w),
                       p + "mlp.gate_proj.weight": (i, w), p + "mlp.up_proj.weight": (i, w),
                       p + "mlp.down_proj.weight": (w, i), p + "input_layernorm.weight": (w,),
                       p + "post_attention_layernorm.weight": (w,)})
    groups.append({"model.norm.weight": (w,), "lm_head.weight": (cfg.vocab_size, w)})
    shards, cur, cur_bytes = [], {}, 0
    for grp in groups:
        b = sum(torch.Size(s).numel() for s in grp.values()) * torch.finfo(dtype).bits // 8
        if cur and cur_bytes + b > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur.update(grp)
        cur_bytes += b
    shards.append(cur)
    weight_map, total = {}, 0
    for k, shapes in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: (torch.ones(s, dtype=dtype) if key.endswith("norm.weight") else rnd(*s))
                   for key, s in shapes.items()}
        save_file(tensors, os.path.join(d, name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({key: name for key in shapes})
        del tensors
    with open(idx, "w") as f:
        json.dump({"metadata": {"total_size": total, "shape": want}, "weight_map": weight_map}, f)
    cfg.save_pretrained(d)


def serve(d, cfg, dtype, host, new_tokens, nvme_dir):
    import transformers
    from accelerate import init_empty_weights  # parameters on meta, buffers real
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(cfg).eval()
    conf = {"device_kind": "host", "host": host, "in_place": "on",
            "precision": "bf16" if dtype == torch.bfloat16 else "fp32",
            "nvme": {"size": "1GiB", "path": nvme_dir}}
    t0 = time.perf_counter()
    model = tiermem.inference(model, conf, weights=d)
    load_s = time.perf_counter() - t0
    rt = tiermem.runtime_of(model)
    ids = torch.randint(1, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))

    def nvme_read():
        return sum(v for k, v in rt.stats()["bytes_moved"].items() if k.startswith("nvme->"))

    r0 = nvme_read()
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                   pad_token_id=0)
    first_s = time.perf_counter() - t
    r1 = nvme_read()
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    gen_s = time.perf_counter() - t
    r2 = nvme_read()
    out = {"load_s": load_s, "first_token_s": first_s, "first_token_bytes": r1 - r0,
           "generate_s": gen_s, "generate_tokens": new_tokens, "generate_bytes": r2 - r1,
           "report": {k: v for k, v in rt._weights.report.items() if k not in ("missing", "ignored")}}
    rt.close(keep_values=False)  # a model beyond RAM: its values are not materialized
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--compute-only", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dir", default=None, help="checkpoint directory (written if absent)")
    ap.add_argument("--target-gb", type=float, default=39.0)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--host", default="2GiB")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.compute_only:
        rows = matmul_rates(a.threads, a.width)
        res = {"threads": a.threads, "matmul": rows}
        print(json.dumps(res) if a.json else "\n".join(
            f"{r['shape']:>28}: fp32 {r['fp32_ms']:8.3f} ms  bf16 {r['bf16_ms']:8.3f} ms  "
            f"bf16/fp32 {r['bf16_over_fp32']:.2f}" for r in rows))
        return res
    if a.dir is None:
        ap.error("--dir is required (a directory on the NVMe file system)")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    esize = 2 if dtype == torch.bfloat16 else 4
    cfg = llama_config(1, a.width, a.vocab)
    layers = a.layers or max(1, int((a.target_gb * 1e9 - 2 * a.vocab * a.width * esize)
                                    // layer_bytes(cfg, esize)))
    cfg = llama_config(layers, a.width, a.vocab)
    ckpt = os.path.join(a.dir, "ckpt")
    write_checkpoint(ckpt, cfg, dtype)
    nvme_dir = os.path.join(a.dir, "nvme")
    os.makedirs(nvme_dir, exist_ok=True)
    res = serve(ckpt, cfg, dtype, a.host, a.new_tokens, nvme_dir)
    from benchmarks.fio import fio_rates
    fio = fio_rates(a.dir, size="1G")
    res.update({"layers": layers, "width": a.width, "vocab": a.vocab, "dtype": a.dtype,
                "checkpoint_bytes": sum(os.path.getsize(os.path.join(ckpt, f))
                                        for f in os.listdir(ckpt) if f.endswith(".safetensors")),
                "fio": fio})
    if fio and fio.get("read"):
        rate = fio["read"] * 1e9
        res["first_token_over_fio"] = res["first_token_s"] / (res["first_token_bytes"] / rate)
        res["generate_over_fio"] = res["generate_s"] / (res["generate_bytes"] / rate)
    res["tokens_per_s"] = a.new_tokens / res["generate_s"]
    print(json.dumps(res, indent=None if a.json else 2))
    return res


if __name__ == "__main__":
    main()
