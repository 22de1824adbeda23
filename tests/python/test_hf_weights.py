"""Hugging Face checkpoints (tiermem/hf.py, docs/pretrained.md "Hugging Face models"):
checkpoints written in the test by transformers' own ``save_pretrained`` (several shards; random
weights from configs, nothing downloaded) load through ``weights=DIR`` into models built on
the meta device and then compute and train equal to ``from_pretrained`` + plain torch — Llama
tied and untied with a real 32,000-token vocabulary, the base-model prefix both ways, bf16
shards into fp32 chunks, NVMe homes in the loop, Qwen3-MoE and Mixtral assembled from
per-expert keys by transformers' conversion mapping; every bad checkpoint refused with the
model untouched; ``tiermem.save_pretrained`` read back by ``from_pretrained`` (and killed
half-way: not loadable); PEFT LoRA on a base loaded this way, its adapter saved by PEFT and
reloaded; ``tiermem export`` of a training checkpoint."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import safetensors.torch as st
import torch

import tiermem
from conftest import KernelAdamW
from tiermem.hf_export import main as export_main

transformers = pytest.importorskip("transformers")

VOCAB = 32_000  # a real vocabulary: the embedding and the head are the largest tensors
OPT = {"lr": 2e-3, "weight_decay": 0.01}
SHARD = "300KB"  # small shards: every checkpoint here has several
IDS = dict(bos_token_id=0, eos_token_id=None, pad_token_id=0)


def llama_config(tied, vocab=VOCAB, **kw):
    c = dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=8,
             max_position_embeddings=64, tie_word_embeddings=tied, **IDS)
    c.update(kw)
    return transformers.LlamaConfig(**c)


def qwen3_moe_config(**kw):
    c = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
             max_position_embeddings=64, tie_word_embeddings=False, **IDS)
    c.update(kw)
    return transformers.Qwen3MoeConfig(**c)


def mixtral_config(**kw):
    c = dict(vocab_size=256, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
             num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
             **IDS)
    c.update(kw)
    return transformers.MixtralConfig(**c)


def save_hf(config, path, seed=1, cls=None, dtype=None, shard=SHARD):
    """A checkpoint as users bring them: transformers' save_pretrained of a random model."""
    torch.manual_seed(seed)
    model = make(cls, config)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path, max_shard_size=shard)
    return path


def make(cls, config):
    if cls is None:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return cls._from_config(config, dtype=torch.float32)


def on_meta(config, cls=None, how="torch"):
    if how == "accelerate":
        import accelerate
        with accelerate.init_empty_weights():
            model = make(cls, config)
        model.tie_weights()  # accelerate's meta parameters untie: tie them again
        return model
    with torch.device("meta"):
        return make(cls, config)


def plain(path, cls=None):
    model = (cls or transformers.AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32)
    return model.train()


def sim_cfg(**kw):
    c = {"device_kind": "sim", "device": "4MiB", "host": "256MiB", "optimizer": OPT}
    c.update(kw)
    return c


def tokens(vocab, steps=3, batch=2, seq=8, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def train(model, opt, data):
    out = []
    for ids in data:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def assert_state_equal(model, ref):
    want = ref.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def assert_trains_like(model, opt, ref, vocab):
    """Same logits, same losses over three AdamW steps, same values after, as the plain
    model with the kernel's AdamW: exact (the same torch ops on the same values)."""
    data = tokens(vocab)
    with torch.no_grad():
        assert torch.equal(model(input_ids=data[0]).logits, ref(input_ids=data[0]).logits)
    losses = train(model, opt, data)
    assert losses == train(ref, KernelAdamW(ref.parameters(), **OPT), data)
    assert_state_equal(model, ref)


def shards(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values())), index["weight_map"]


@pytest.mark.parametrize("how", ["torch", "accelerate"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama_from_save_pretrained_computes_and_trains_like_from_pretrained(tmp_path, tied,
                                                                              how):
    ckpt = save_hf(llama_config(tied), tmp_path / "ckpt")
    files, weight_map = shards(ckpt)
    assert len(files) > 1 and ("lm_head.weight" in weight_map) == (not tied)
    model, opt = tiermem.initialize(on_meta(llama_config(tied), how=how), sim_cfg(),
                                    weights=ckpt)
    inner = tiermem.runtime_of(model).model
    assert (inner.lm_head.weight is inner.model.embed_tokens.weight) == tied
    # rotary frequencies built on meta under torch.device("meta") were computed
    assert not inner.model.rotary_emb.inv_freq.is_meta
    assert_trains_like(model, opt, plain(ckpt), VOCAB)


def test_a_declared_tie_that_is_two_parameters_is_refused(tmp_path):
    import accelerate
    ckpt = save_hf(llama_config(True), tmp_path / "ckpt")
    with accelerate.init_empty_weights():
        meta = transformers.AutoModelForCausalLM.from_config(llama_config(True))
    assert meta.lm_head.weight is not meta.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"'lm_head.weight' is tied to "
                                         r"'model.embed_tokens.weight' .* call "
                                         r"model.tie_weights\(\)"):
        tiermem.initialize(meta, sim_cfg(), weights=ckpt)
    assert all(p.is_meta for p in meta.parameters())


def test_bf16_shards_load_into_fp32_chunks_with_nvme_homes(tmp_path):
    ckpt = save_hf(llama_config(False), tmp_path / "ckpt", dtype=torch.bfloat16)
    assert st.load_file(ckpt / shards(ckpt)[0][0]).popitem()[1].dtype == torch.bfloat16
    meta = on_meta(llama_config(False))
    state_bytes = sum(p.numel() for p in meta.parameters()) * 16  # fp32 p, g, m, v
    cfg = {"device_kind": "host", "host": "15MiB", "optimizer": OPT,
           "nvme": {"size": "64MiB", "path": str(tmp_path / "nvme")}}
    assert state_bytes > 15 * 2**20  # the host budget is below the model
    model, opt = tiermem.initialize(meta, cfg, weights=ckpt)
    assert tiermem.runtime_of(model).stats()["tiers"]["nvme"]["used"] > 0
    assert_trains_like(model, opt, plain(ckpt), VOCAB)


def test_a_base_model_loads_a_causal_lm_checkpoint_and_back(tmp_path):
    # LlamaForCausalLM -> LlamaModel: the "model." prefix stripped, the head's key left.
    ckpt = save_hf(llama_config(False), tmp_path / "lm")
    with pytest.warns(UserWarning, match="lm_head.weight"):
        base, _ = tiermem.initialize(on_meta(llama_config(False), transformers.LlamaModel),
                                     sim_cfg(), weights=ckpt)
    ref = plain(ckpt, transformers.LlamaModel)
    assert_state_equal(base, ref)
    # LlamaModel -> tied LlamaForCausalLM: the prefix added, the head takes its tie's value.
    ckpt = save_hf(llama_config(True), tmp_path / "base", cls=transformers.LlamaModel)
    assert not any(k.startswith("model.") for k in shards(ckpt)[1])
    model, opt = tiermem.initialize(on_meta(llama_config(True)), sim_cfg(), weights=ckpt)
    assert_trains_like(model, opt, plain(ckpt), VOCAB)


@pytest.mark.parametrize("config", [qwen3_moe_config, mixtral_config], ids=["qwen3_moe", "mixtral"])
def test_moe_experts_are_assembled_from_per_expert_keys(tmp_path, config):
    ckpt = save_hf(config(), tmp_path / "ckpt", shard="40KB")
    files, weight_map = shards(ckpt)
    experts = [k for k in weight_map if ".experts.3." in k]
    assert experts and len(files) > 3  # per-expert keys, spread over shards
    model, opt = tiermem.initialize(on_meta(config()), sim_cfg(), weights=ckpt)
    assert_trains_like(model, opt, plain(ckpt), 256)


@pytest.mark.parametrize("in_place", ["off", "on"])
def test_moe_with_nvme_homes_serves_like_from_pretrained(tmp_path, in_place):
    """Experts fused from per-expert keys, NVMe-homed: copied into the NVMe tier (off), or read
    in place from the checkpoint's shards (on: the fused parameter's chunks are spans of
    several files)."""
    ckpt = save_hf(qwen3_moe_config(), tmp_path / "ckpt", shard="40KB")
    cfg = {"device_kind": "host", "host": "192KiB", "in_place": in_place,
           "nvme": {"size": "64MiB", "path": str(tmp_path / "nvme")}}
    model = tiermem.inference(on_meta(qwen3_moe_config()), cfg, weights=ckpt)
    rt = tiermem.runtime_of(model)
    if in_place == "off":
        assert rt.stats()["tiers"]["nvme"]["used"] > 0
        assert rt._weights.report["chunks_in_place"] == 0
    else:
        assert rt._weights.report["chunks_in_place"] > 0
    ref = plain(ckpt).eval()
    ids = tokens(256)[0]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


# ---- bad checkpoints: refused, the model untouched ------------------------------------------
def rewrite(ckpt, drop=(), add=None, reshape=None):
    """The checkpoint with keys dropped, one added ({key: tensor}) or one reshaped, its index
    kept consistent (safetensors' own writer)."""
    files, weight_map = shards(ckpt)
    for f in files:
        sd = st.load_file(ckpt / f)
        sd = {k: v for k, v in sd.items() if k not in drop}
        if reshape is not None and reshape[0] in sd:
            sd[reshape[0]] = torch.zeros(reshape[1])
        if add and f == files[0]:
            sd.update(add)
        st.save_file(sd, ckpt / f, metadata={"format": "pt"})
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in weight_map.items() if k not in drop}
    index["weight_map"].update({k: files[0] for k in add or {}})
    index["metadata"].pop("total_size", None)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


BAD = {
    "missing key": (dict(drop=["model.layers.1.self_attn.k_proj.weight"]),
                    r"'model.layers.1.self_attn.k_proj.weight' has no key "
                    r"'model.layers.1.self_attn.k_proj.weight' in .*ckpt"),
    "unexpected key": (dict(add={"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
                       r"model-00001-of-\d+.safetensors holds key "
                       r"'model.layers.0.mlp.extra.weight', which no parameter"),
    "shape mismatch": (dict(reshape=("model.layers.0.mlp.up_proj.weight", [31, 16])),
                       r"'model.layers.0.mlp.up_proj.weight': key "
                       r"'model.layers.0.mlp.up_proj.weight' in .*safetensors has shape "
                       r"\[31, 16\], expected \[32, 16\]"),
    "untied head missing": (dict(drop=["lm_head.weight"]),
                            r"'lm_head.weight' has no key 'lm_head.weight' in .*ckpt \(the "
                            r"model does not tie it: config tie_word_embeddings=False\)"),
    "missing expert": (dict(drop=["model.layers.1.mlp.experts.2.up_proj.weight"]),
                       r"'model.layers.1.mlp.experts.gate_up_proj' \[4, 32, 32\], which "
                       r"transformers assembles from 8 keys: the checkpoint .*ckpt has no key "
                       r"'model.layers.1.mlp.experts.2.up_proj.weight'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_checkpoint_is_refused_and_leaves_the_model_untouched(tmp_path, case):
    config = qwen3_moe_config if case == "missing expert" else lambda: llama_config(False)
    ckpt = save_hf(config(), tmp_path / "ckpt", shard="40KB")
    change, message = BAD[case]
    rewrite(ckpt, **change)
    meta = on_meta(config())
    with pytest.raises(ValueError, match=message):
        tiermem.initialize(meta, sim_cfg(), weights=ckpt)
    assert getattr(meta, "_tiermem_runtime", None) is None
    assert all(p.is_meta for p in meta.parameters())
    assert all(b.is_meta for b in meta.buffers())
    # and the untouched model takes a good checkpoint afterwards
    good = save_hf(config(), tmp_path / "good", shard="40KB")
    model, _ = tiermem.initialize(meta, sim_cfg(), weights=good)
    assert_state_equal(model, plain(good))


def test_a_conversion_segments_cannot_express_is_refused_naming_model_type_and_op(tmp_path):
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import Interleave, WeightConverter
    ckpt = save_hf(llama_config(False), tmp_path / "ckpt")
    cm.get_checkpoint_conversion_mapping("llama")  # (builds the cache)
    saved = cm._checkpoint_conversion_mapping_cache.get("llama")
    cm._checkpoint_conversion_mapping_cache["llama"] = [WeightConverter(
        "mlp.up_proj.weight", "mlp.up_proj.weight", operations=[Interleave(dim=0)])]
    try:
        meta = on_meta(llama_config(False))
        with pytest.raises(ValueError, match=r"model type 'llama' \(Interleave\) of "
                                             r"'model.layers.0.mlp.up_proj.weight' does "
                                             r"torch\.transpose"):
            tiermem.initialize(meta, sim_cfg(), weights=ckpt)
        assert all(p.is_meta for p in meta.parameters())
    finally:
        if saved is None:
            cm._checkpoint_conversion_mapping_cache.pop("llama", None)
        else:
            cm._checkpoint_conversion_mapping_cache["llama"] = saved


# ---- save_pretrained -------------------------------------------------------------------------
@pytest.mark.parametrize("config", [lambda: llama_config(True), qwen3_moe_config],
                         ids=["llama-tied", "qwen3_moe"])
def test_save_pretrained_is_read_back_by_from_pretrained(tmp_path, config):
    ckpt = save_hf(config(), tmp_path / "ckpt", shard="40KB")
    model, opt = tiermem.initialize(on_meta(config()), sim_cfg(), weights=ckpt)
    vocab = model.config.vocab_size
    train(model, opt, tokens(vocab))
    out = tmp_path / "out"
    tiermem.save_pretrained(model, out, max_shard_size="40KB")
    files, weight_map = shards(out)
    assert set(weight_map) == set(shards(ckpt)[1])  # the keys as transformers writes them
    assert {"config.json", "generation_config.json"} <= set(os.listdir(out))
    back = plain(out)
    assert back.config.dtype == torch.float32
    assert_state_equal(model, back)
    ids = tokens(vocab)[0]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, back(input_ids=ids).logits)
    # bf16: rounded as .to(torch.bfloat16) rounds, the config says so
    tiermem.save_pretrained(model, tmp_path / "bf16", max_shard_size="40KB",
                            dtype=torch.bfloat16)
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert half.config.dtype == torch.bfloat16
    for k, v in back.state_dict().items():
        assert torch.equal(half.state_dict()[k], v.to(torch.bfloat16)), k


KILLED = textwrap.dedent("""
    import sys, tiermem
    sys.path.insert(0, {here!r})
    from test_hf_weights import llama_config, on_meta, sim_cfg
    model, _ = tiermem.initialize(on_meta(llama_config(False, hidden_size=64)), sim_cfg(),
                                  weights={ckpt!r})
    print("ready", flush=True)
    sys.stdin.readline()
    while True:
        tiermem.save_pretrained(model, {out!r}, max_shard_size="64KB")
""")


def killed_export(ckpt, out):
    """Runs save_pretrained over and over in a child process and SIGKILLs it while the first
    shard (the 8 MB head) is being written; True when the kill landed there."""
    child = subprocess.Popen([sys.executable, "-c", KILLED.format(
        here=os.path.dirname(__file__), ckpt=str(ckpt), out=str(out))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            names = os.listdir(out) if out.exists() else []
            if any(n.startswith("model-00001-of-") and n.endswith(".tmp") for n in names):
                child.send_signal(signal.SIGKILL)
                child.wait()
                return "model.safetensors.index.json" not in os.listdir(out)
    finally:
        child.kill()
        child.wait()
    pytest.fail("the export never started")


def test_a_killed_save_pretrained_leaves_nothing_loadable(tmp_path, monkeypatch):
    ckpt = save_hf(llama_config(False, hidden_size=64), tmp_path / "ckpt")
    out = tmp_path / "out"
    # (a kill that lands after the export completed is retried: it proves nothing)
    assert any(killed_export(ckpt, out) for _ in range(5))
    names = os.listdir(out)
    assert "config.json" in names and "model.safetensors" not in names
    with pytest.raises(OSError):
        transformers.AutoModelForCausalLM.from_pretrained(out)
    meta = on_meta(llama_config(False, hidden_size=64))
    with pytest.raises((ValueError, OSError), match="export that was interrupted"):
        tiermem.initialize(meta, sim_cfg(), weights=out)
    # A new export stopped right after its config.json was written: the old weights beside
    # the new config do not load either (the old index went first).
    model, _ = tiermem.initialize(meta, sim_cfg(), weights=ckpt)
    tiermem.save_pretrained(model, out, max_shard_size="64KB")
    plain(out)  # a complete export loads

    def crash(*args, **kwargs):
        raise OSError("killed")
    monkeypatch.setattr(tiermem.weights._C, "save_weights", crash)
    with pytest.raises(OSError, match="killed"):
        tiermem.save_pretrained(model, out, max_shard_size="64KB")
    with pytest.raises(OSError):
        transformers.AutoModelForCausalLM.from_pretrained(out)


# ---- PEFT ------------------------------------------------------------------------------------
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def test_lora_on_a_loaded_base_trains_like_plain_torch_and_its_adapter_reloads(tmp_path):
    peft = pytest.importorskip("peft")
    ckpt = save_hf(llama_config(True), tmp_path / "base")
    # plain: from_pretrained, then PEFT
    torch.manual_seed(7)
    ref = peft.get_peft_model(plain(ckpt), peft.LoraConfig(**LORA))
    # ours: the base on meta, PEFT on it (adapters on meta too), the base from the checkpoint
    ours = peft.get_peft_model(on_meta(llama_config(True)), peft.LoraConfig(**LORA))
    torch.manual_seed(7)  # PEFT's initialization of the meta adapters draws what PEFT drew
    model, opt = tiermem.initialize(ours, sim_cfg(), weights=ckpt)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    assert_trains_like(model, opt, ref, VOCAB)
    # PEFT's own save: only the adapter, with its real values
    model.save_pretrained(tmp_path / "adapter")
    saved = st.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # it trained
    for k, v in saved.items():
        want = ref.state_dict()[k.replace(".weight", ".default.weight")]
        assert torch.equal(v, want), k
    back = peft.PeftModel.from_pretrained(plain(ckpt), tmp_path / "adapter")
    ids = tokens(VOCAB)[0]
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)


def test_an_adapter_loaded_on_a_meta_base_is_refused_until_its_values_are_assigned(tmp_path):
    # PeftModel.from_pretrained on a meta base leaves the loaded adapter on meta: tiermem must
    # not give it a fresh initialization in place of its trained values.
    peft = pytest.importorskip("peft")
    ckpt = save_hf(llama_config(True), tmp_path / "base")
    torch.manual_seed(7)
    trained = peft.get_peft_model(plain(ckpt), peft.LoraConfig(**LORA))
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.normal_()  # as if trained: B is no longer zero
    trained.save_pretrained(tmp_path / "adapter")
    meta = peft.PeftModel.from_pretrained(on_meta(llama_config(True)), tmp_path / "adapter",
                                          low_cpu_mem_usage=True)
    with pytest.raises(ValueError, match="loaded for inference"):
        tiermem.inference(meta, sim_cfg(), weights=ckpt)
    assert all(p.device.type == "meta" for p in meta.parameters())  # left as it was
    saved = st.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    meta.load_state_dict({k[:k.rindex(".")] + ".default" + k[k.rindex("."):]: v
                          for k, v in saved.items()}, strict=False, assign=True)
    served = tiermem.inference(meta, sim_cfg(), weights=ckpt, strict=False)
    ids = tokens(VOCAB)[0]
    with torch.no_grad():
        assert torch.equal(served(input_ids=ids).logits, trained.eval()(input_ids=ids).logits)


# ---- tiermem export ----------------------------------------------------------------------------
@pytest.mark.parametrize("config", [lambda: llama_config(True), mixtral_config],
                         ids=["llama-tied", "mixtral"])
def test_tiermem_export_turns_a_training_checkpoint_into_a_hf_checkpoint(tmp_path, config):
    src = save_hf(config(), tmp_path / "src", shard="40KB")
    model, opt = tiermem.initialize(on_meta(config()), sim_cfg(), weights=src)
    vocab = model.config.vocab_size
    train(model, opt, tokens(vocab))
    tiermem.save_checkpoint(model, opt, tmp_path / "train.safetensors")
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "tiermem", "export", str(tmp_path / "train.safetensors"),
           str(out), "--config-from", str(src), "--max-shard-size", "40KB"]
    done = subprocess.run(cli, capture_output=True, text=True)  # the CLI itself
    assert done.returncode == 0, done.stderr
    assert set(shards(out)[1]) == set(shards(src)[1])  # per-expert keys, the head once
    back = plain(out)
    assert_state_equal(model, back)
    ids = tokens(vocab)[0]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, back(input_ids=ids).logits)
    # --dtype bf16, and without --config-from the checkpoint's own names (in this process)
    assert export_main(cli[4:5] + [str(tmp_path / "bf16"), "--config-from", str(src),
                                   "--dtype", "bf16"]) == 0
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert half.config.dtype == torch.bfloat16
    for k, v in back.state_dict().items():
        assert torch.equal(half.state_dict()[k], v.to(torch.bfloat16)), k
    assert export_main(cli[4:5] + [str(tmp_path / "plain")]) == 0
    names = {k for k in st.load_file(tmp_path / "plain" / "model.safetensors")}
    assert names == {n for n, _ in model.named_parameters()}


def test_tiermem_export_refuses_a_checkpoint_of_another_model(tmp_path, capsys):
    src = save_hf(llama_config(False), tmp_path / "src")
    other = save_hf(llama_config(False, num_hidden_layers=3), tmp_path / "other")
    model, opt = tiermem.initialize(on_meta(llama_config(False, num_hidden_layers=3)),
                                    sim_cfg(), weights=other)
    tiermem.save_checkpoint(model, opt, tmp_path / "train.safetensors")
    assert export_main([str(tmp_path / "train.safetensors"), str(tmp_path / "out"),
                        "--config-from", str(src)]) == 1
    err = capsys.readouterr().err
    assert "holds 'model.layers.2." in err and "LlamaForCausalLM" in err, err
    assert not (tmp_path / "out").exists()


def test_a_plain_model_does_not_import_transformers(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch, safetensors.torch as st, tiermem
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        st.save_file({{k: v.contiguous() for k, v in model.state_dict().items()}},
                     {str(tmp_path / "w.safetensors")!r})
        tiermem.initialize(torch.nn.Sequential(torch.nn.Linear(4, 4)), {{"device_kind": "sim"}},
                           weights={str(tmp_path / "w.safetensors")!r})
        assert "transformers" not in sys.modules, "imported"
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
