"""The pretrained-weights demonstrations (issue 42 §5; docs/pretrained.md "Try it",
docs/benchmarks.md "Pretrained weights"): a Llama-shaped bf16 checkpoint written shard by
shard from random values, then fine-tuned from it under tiermem.

    python -m benchmarks.demo_pretrained write DIR [SHAPE]      the checkpoint only
    python -m benchmarks.demo_pretrained lora  [SHAPE] [--host 15GiB] [--work DIR] [--small]
    python -m benchmarks.demo_pretrained full  [SHAPE] [--host 4GiB] [--work DIR] [--small]

SHAPE: --layers --hidden --vocab --heads --kv-heads --intermediate (each overrides the
default shape's).

  write  a Hugging Face checkpoint directory: config.json from `transformers.LlamaConfig`,
         `model-0000k-of-0000n.safetensors` shards of at most --shard bytes and
         `model.safetensors.index.json`; each tensor normal(0, 0.02) (norm weights 1.0) in bf16,
         drawn from a generator seeded per tensor, one shard at a time: the process never holds
         more than one shard of values.
  lora   (default shape: Llama-3-8B: 32 x 4096, vocabulary 128,256, 32 heads, 8 KV heads,
         intermediate 14,336) writes the checkpoint, builds the model on the meta device, puts
         PEFT LoRA on it (q_proj, v_proj), loads the frozen base with
         `tiermem.initialize(weights=CKPT)`, trains 3 steps on one repeated batch (the loss must
         fall), saves the adapter with PEFT's `save_pretrained`, then reloads it: a fresh meta
         base, `peft.PeftModel.from_pretrained(base, ADAPTER, low_cpu_mem_usage=True)`, the
         adapter's values assigned from its file (PEFT leaves an adapter on its base layer's
         device, meta: `assign_adapter`), and the base from the checkpoint by
         `tiermem.inference(weights=CKPT, strict=False)` (the adapter keeps its loaded values);
         the reloaded model's logits on a few tokens must equal the trained model's.
  full   (default shape: 2.09 B params: 28 x 2560, vocabulary 32,000, intermediate 6912) writes
         the checkpoint, loads it with `tiermem.initialize(weights=CKPT)` (fp32 masters and
         AdamW state; what the host budget does not hold is homed on NVMe under --work), trains
         3 steps (the checkpoint is removed after the load unless --keep: disk), exports with
         `tiermem.save_pretrained` (fp32, or --export-dtype bf16) and
         reloads the export with transformers' `from_pretrained`: its logits on a few tokens must
         equal tiermem's (fp32 export: within 1e-5; bf16: within bf16 rounding).

`--small` runs a tiny shape (seconds; what the tests run). Every phase prints its elapsed time
and the process's peak RSS during it (VmHWM, reset between phases through
/proc/self/clear_refs) and its RSS at the end (phases: write, load, steps, save, probe, close,
reload), and the run ends with one JSON line. Working files go under
--work (default: a temporary directory, removed at the end unless --keep).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import tempfile
import time

import torch

SHAPES = {
    # (layers, hidden, vocab, heads, kv_heads, intermediate)
    "llama3-8b": (32, 4096, 128_256, 32, 8, 14_336),
    "llama-2b": (28, 2560, 32_000, 20, 4, 6912),
    "small": (2, 64, 1000, 4, 2, 160),
}


def llama_config(layers, hidden, vocab, heads, kv_heads, intermediate, tied=False):
    import transformers
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=tied, rope_theta=500_000.0,
        bos_token_id=0, eos_token_id=None, pad_token_id=0, dtype="bfloat16")


def checkpoint_tensors(config):
    """[(key, shape)] of the checkpoint transformers' save_pretrained would write for a
    LlamaForCausalLM of `config`, in the model's order (a tied head once), from a model on
    the meta device."""
    import transformers
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    seen, out = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.append((name, tuple(p.shape)))
    return out


def write_checkpoint(config, directory, max_shard_bytes=2 * 10**9, seed=0):
    """Writes `config`'s Llama as a bf16 Hugging Face checkpoint directory, shard by shard
    (module docstring); returns its total tensor bytes. Each shard is written to NAME.tmp and
    renamed, the index last."""
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    tensors = checkpoint_tensors(config)
    shards, size = [[]], 0
    for key, shape in tensors:  # greedy split in model order, as save_pretrained splits
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, shape))
        size += nbytes
    n, weight_map, total = len(shards), {}, 0
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{n:05d}.safetensors"
        values = {}
        for key, shape in shard:
            g = torch.Generator().manual_seed(seed * 1_000_003 + len(weight_map))
            if key.endswith("norm.weight"):
                values[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                values[key] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            weight_map[key] = name
            total += values[key].numel() * 2
        save_file(values, os.path.join(directory, name + ".tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(directory, name + ".tmp"), os.path.join(directory, name))
        del values
    config.save_pretrained(directory)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return total


class Phases:
    """Times named phases and the process's peak RSS in each: VmHWM after resetting it
    (`echo 5 > /proc/self/clear_refs`; where that is refused, the peak since the start), and
    its RSS at the phase's end (VmRSS)."""

    def __init__(self):
        self.rows = []

    @staticmethod
    def _status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    @contextlib.contextmanager
    def __call__(self, name):
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")
        t0 = time.perf_counter()
        yield
        row = {"phase": name, "s": time.perf_counter() - t0, "peak_rss": self._status("VmHWM:"),
               "rss_after": self._status("VmRSS:")}
        self.rows.append(row)
        print(f"  {name:8s} {row['s']:8.1f} s   peak RSS {row['peak_rss'] / 2**30:6.2f} GiB"
              f"   RSS after {row['rss_after'] / 2**30:6.2f} GiB", flush=True)


def tiermem_config(a, nvme_dir):
    from benchmarks import tier_config
    return {**tier_config("auto", a.device, a.host), "precision": a.precision,
            "nvme": {"size": a.nvme_size, "path": nvme_dir}}


def fixed_batch(vocab, batch=1, seq=16, seed=3):
    """The one batch every step trains on (so 3 steps lower its loss) and the probe tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, seq), generator=g)


def train_steps(model, opt, ids, steps):
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"    loss {losses[-1]:.6f}", flush=True)
    if not all(b < a for a, b in zip(losses, losses[1:])):
        raise SystemExit(f"the loss did not fall: {losses}")
    return losses


@torch.no_grad()
def logits_of(model, ids):
    # No graph: logits with a grad_fn would keep the trained model's session (its whole host
    # budget) alive through the reload.
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def close_trained(model, a):
    """Closes the trained model once its adapter or export is written: without its values
    (`keep_values=False`). Keeping them would make the whole model's fp32 values in RAM (32 GB
    for the 8 B base: where the 8 B run was killed, after the probe). The session's memory goes
    at close() and the runtime with `del model, opt` (no garbage collection needed).
    `--close-keeping-values` closes as before, to measure what that costs."""
    import tiermem
    tiermem.close(model, keep_values=a.close_keeping_values)


def assign_adapter(model, adapter_dir, name="default"):
    """Puts the saved adapter's values into `model`'s adapter parameters, which PEFT leaves
    on the meta device when the base is there (it moves each adapter to its base layer's
    device after loading it): `load_state_dict(assign=True)` with PEFT's file keys
    (`...lora_A.weight`) mapped to the module's (`...lora_A.default.weight`)."""
    from safetensors.torch import load_file
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    own = model.state_dict()
    mapped = {}
    for key, value in saved.items():
        cut = key.rindex(".")
        mapped[key[:cut] + f".{name}" + key[cut:]] = value
    missing = [k for k in mapped if k not in own]
    if missing:
        raise SystemExit(f"adapter keys the model lacks: {missing[:3]}")
    model.load_state_dict(mapped, strict=False, assign=True)


def adapter_state_dict(model):
    """The LoRA modules' state dict under the model's own keys (what PEFT's save_pretrained
    keeps of model.state_dict()), read module by module: only the adapters' values."""
    out = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B"):
            out.update(module.state_dict(prefix=name + "."))
    if not out:
        raise SystemExit("no LoRA modules found in the model")
    return out


def run_lora(a, config, work, ph):
    import peft
    import transformers

    import tiermem
    ckpt, adapter = os.path.join(work, "ckpt"), os.path.join(work, "adapter")
    with ph("write"):
        nbytes = write_checkpoint(config, ckpt, a.shard)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)
    with ph("load"):
        with torch.device("meta"):
            base = transformers.LlamaForCausalLM(config)
        torch.manual_seed(0)
        model, opt = tiermem.initialize(peft.get_peft_model(base, lora),
                                        {**tiermem_config(a, os.path.join(work, "nvme")),
                                         "optimizer": {"lr": a.lr}}, weights=ckpt)
    nvme_used = tiermem.runtime_of(model).stats()["tiers"]["nvme"]["used"]
    ids = fixed_batch(config.vocab_size)
    with ph("steps"):
        losses = train_steps(model, opt, ids, a.steps)
    with ph("save"):
        # The adapter's own state dict, passed to PEFT: without it PEFT's save_pretrained calls
        # model.state_dict() and keeps its LoRA keys, and a whole-model state dict is every
        # value in RAM (32 GB for this shape's fp32 base: the first 8 B run was killed here).
        model.save_pretrained(adapter, state_dict=adapter_state_dict(model))
    probe = ids[:, :a.probe]
    with ph("probe"):
        want = logits_of(model, probe)
    with ph("close"):
        close_trained(model, a)
        del model, opt
    with ph("reload"):
        with torch.device("meta"):
            base = transformers.LlamaForCausalLM(config)
        back = peft.PeftModel.from_pretrained(base, adapter, low_cpu_mem_usage=True)
        assign_adapter(back, adapter)
        back = tiermem.inference(back, tiermem_config(a, os.path.join(work, "nvme")),
                                 weights=ckpt, strict=False)
        got = logits_of(back, probe)
    # Without its values: the served base is the whole model (keeping them would make its fp32
    # values in RAM, refused beyond free memory: the first 8 B run that reached here was).
    tiermem.runtime_of(back).close(keep_values=False)
    diff = (got - want).abs().max().item()
    if not torch.equal(got, want):
        raise SystemExit(f"the reloaded adapter's logits differ (max |diff| {diff})")
    print(f"  reloaded adapter: logits on {a.probe} tokens equal", flush=True)
    return {"checkpoint_bytes": nbytes, "nvme_used": nvme_used, "losses": losses,
            "max_abs_diff": diff}


def run_full(a, config, work, ph):
    import transformers

    import tiermem
    ckpt, out = os.path.join(work, "ckpt"), os.path.join(work, "export")
    with ph("write"):
        nbytes = write_checkpoint(config, ckpt, a.shard)
    with ph("load"):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        model, opt = tiermem.initialize(model, {**tiermem_config(a, os.path.join(work, "nvme")),
                                                "optimizer": {"lr": a.lr}}, weights=ckpt)
    nvme_used = tiermem.runtime_of(model).stats()["tiers"]["nvme"]["used"]
    if not a.keep:  # the reload reads the export: the checkpoint's disk space goes back now
        shutil.rmtree(ckpt)
    ids = fixed_batch(config.vocab_size)
    with ph("steps"):
        losses = train_steps(model, opt, ids, a.steps)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[a.export_dtype]
    with ph("save"):
        tiermem.save_pretrained(model, out, max_shard_size=a.shard, dtype=dtype)
    probe = ids[:, :a.probe]
    with ph("probe"):
        want = logits_of(model, probe)
    with ph("close"):
        close_trained(model, a)
        del model, opt
    with ph("reload"):
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        got = logits_of(back.eval(), probe)
    diff = (got - want).abs().max().item()
    # fp32 export: the masters exactly, so only summation-order noise; bf16: each weight
    # rounded to 8 bits of mantissa.
    tol = 1e-5 if dtype is None else 5e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        raise SystemExit(f"from_pretrained's logits differ from tiermem's: max |diff| {diff}")
    print(f"  from_pretrained of the export: logits on {a.probe} tokens within {tol} "
          f"(max |diff| {diff:.3g})", flush=True)
    return {"checkpoint_bytes": nbytes, "nvme_used": nvme_used, "losses": losses,
            "max_abs_diff": diff}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["write", "lora", "full"])
    ap.add_argument("dir", nargs="?", help="write: the checkpoint directory")
    ap.add_argument("--small", action="store_true", help="a tiny shape (seconds)")
    for name in ("layers", "hidden", "vocab", "heads", "kv-heads", "intermediate"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--shard", default=2 * 10**9, type=int, help="max shard bytes")
    ap.add_argument("--host", default=None,
                    help="tiermem's host budget (default: 15GiB for lora, over the 8 B shape's "
                         "whole-tensor floor, 14.46 GiB; 4GiB for full; 2MiB --small)")
    ap.add_argument("--device", default="4GiB", help="device budget (with a GPU)")
    ap.add_argument("--nvme-size", default=None,
                    help="NVMe tier size (default: 5 bytes a param for lora's frozen fp32 base, "
                         "3 with --precision bf16 (the bf16 base alone: no fp32 masters), 18 "
                         "for full's params, grads and AdamW state, plus 1 GiB)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--export-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--probe", type=int, default=4, help="tokens whose logits are compared")
    ap.add_argument("--work", default=None, help="working directory (checkpoints, NVMe files)")
    ap.add_argument("--keep", action="store_true", help="keep --work's files")
    ap.add_argument("--close-keeping-values", action="store_true",
                    help="close the trained model keeping its values (the whole model in RAM)")
    a = ap.parse_args(argv)
    shape = list(SHAPES["small" if a.small else
                        {"lora": "llama3-8b", "full": "llama-2b", "write": "llama3-8b"}[a.what]])
    for i, name in enumerate(("layers", "hidden", "vocab", "heads", "kv_heads", "intermediate")):
        if getattr(a, name) is not None:
            shape[i] = getattr(a, name)
    config = llama_config(*shape)
    nparams = sum(math.prod(s) for _, s in checkpoint_tensors(config))
    if a.host is None:
        a.host = "2MiB" if a.small else {"lora": "15GiB", "full": "4GiB", "write": "0"}[a.what]
    if a.nvme_size is None:
        # full: fp32 params, grads, m and v (16 bytes) and the chunks' padding; lora: the fp32
        # base (4 bytes) and its chunks' padding (the 8 B shape at 15 GiB: 2.2 GB chunks, ~12%
        # left empty); in bf16 the bf16 base alone (2 bytes: a frozen tensor the checkpoint
        # holds in the compute dtype keeps no fp32 master, docs/pretrained.md) and its padding
        per_param = 18 if a.what == "full" else 5 if a.precision == "fp32" else 3
        # Every byte: how much the host tier homes depends on its reserve (7 chunks of the
        # largest tensor while tensors are whole: at 15 GiB for the 8 B shape nearly all of
        # it) and on the split tensors' copies (host-mode.md), not on the budget alone.
        a.nvme_size = per_param * nparams + (1 << 30)
    print(f"{a.what}: Llama {shape[0]} x {shape[1]}, vocabulary {shape[2]}, {shape[3]} heads, "
          f"{shape[4]} KV heads, intermediate {shape[5]}: {nparams / 1e9:.3f} B params, "
          f"bf16 checkpoint {2 * nparams / 1e9:.2f} GB; host {a.host}", flush=True)
    ph = Phases()
    if a.what == "write":
        if not a.dir:
            ap.error("write needs DIR")
        with ph("write"):
            write_checkpoint(config, a.dir, a.shard)
        result = {}
    else:
        work = a.work or tempfile.mkdtemp(prefix=f"tiermem-demo-{a.what}-")
        os.makedirs(work, exist_ok=True)
        try:
            result = (run_lora if a.what == "lora" else run_full)(a, config, work, ph)
        finally:
            if not a.keep:
                shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"demo": a.what, "shape": shape, "params": nparams, **result,
                      "phases": ph.rows}))


if __name__ == "__main__":
    main()
