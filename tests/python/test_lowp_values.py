"""Frozen tensors whose values are exact in the compute dtype keep no fp32 copy (issue 42;
runtime/layout.h ``ChunkGroup::compute_only``, docs/pretrained.md): a bf16 checkpoint (written by
transformers' own ``save_pretrained``, a real 32,000-token vocabulary) loaded in bf16 puts its
frozen tensors into groups with only their bf16 compute chunk, loaded by copying the file's
bytes (served in place from NVMe: nothing written, nothing read for the NVMe-homed groups).
Served logits equal ``from_pretrained`` + plain torch in bf16; a LoRA run on that base trains
as it did with fp32 masters, bit for bit; reads (state_dict, export, checkpoints) upcast exactly;
a write of a value bf16 cannot hold is refused naming the tensor, nothing changed; a tiermem
checkpoint and an export round-trip; an old checkpoint saved with fp32 masters loads where its
values are exact and is refused, naming the tensor, where they are not."""
import pytest
import safetensors.torch as st
import torch

import tiermem
import tiermem.weights
from test_hf_weights import LORA, VOCAB, llama_config, on_meta, plain, save_hf, tokens, train

transformers = pytest.importorskip("transformers")


def bf16_checkpoint(tmp_path, tied=False):
    return save_hf(llama_config(tied), tmp_path / "base", dtype=torch.bfloat16)


def file_values(ckpt) -> dict:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(st.load_file(f))
    return out


def bf16_cfg(tmp_path, **kw):
    c = {"device_kind": "sim", "device": "4MiB", "host": "256MiB", "precision": "bf16",
         "optimizer": {"lr": 2e-3, "weight_decay": 0.01}}
    c.update(kw)
    return c


def groups(rt):
    return [rt.session.group(g) for g in range(rt.session.num_groups)]


def frozen_bytes(rt) -> int:
    return sum(r.numel for r in rt.params if not r.trainable)


def assert_no_fp32_copy_of_the_frozen(rt):
    """Every frozen tensor is in a compute_only group, which has no fp32 chunk."""
    K = tiermem._C.ChunkKind
    for g in range(rt.session.num_groups):
        grp = rt.session.group(g)
        assert grp.compute_only == (not grp.trainable), g
        if grp.compute_only:
            assert rt.session.chunk_bytes(g, K.param_fp32) == 0, g
            assert rt.session.chunk_bytes(g, K.param_lowp) > 0, g
    assert all(r.compute_only for r in rt.params if not r.trainable)


def with_masters(monkeypatch):
    """The layout before: frozen tensors keep fp32 masters (the loader never sets the fact)."""
    monkeypatch.setattr(tiermem.weights.LoadPlan, "values_in", lambda self, params, dtype: set())


def test_a_bf16_checkpoint_served_in_bf16_keeps_no_fp32_copy_and_reads_nothing_in_place(
        tmp_path):
    ckpt = bf16_checkpoint(tmp_path)
    ref = plain(ckpt).eval()
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    nparams = sum(p.numel() for p in ref.parameters())
    (tmp_path / "nvme").mkdir()
    # Host mode, a host budget below the model: most groups NVMe-homed.
    c = {"device_kind": "host", "host": "2MiB", "precision": "bf16", "in_place": "on",
         "nvme": {"size": "32MiB", "path": str(tmp_path / "nvme")}}
    model = tiermem.inference(on_meta(llama_config(False)), c, weights=ckpt)
    rt = tiermem.runtime_of(model)
    assert_no_fp32_copy_of_the_frozen(rt)
    assert rt.model_bytes == 2 * nparams  # 2 bytes a parameter, not 6
    report = rt._weights.report
    assert report["chunks_in_place"] > 0, report
    K = tiermem._C.ChunkKind
    nvme_homed = [g for g in range(rt.session.num_groups)
                  if rt.session.home(g, K.param_lowp) == tiermem._C.Tier.nvme]
    assert nvme_homed and report["chunks_in_place"] == len(nvme_homed), report
    # Only the host-homed groups were read: the NVMe-homed ones are header parsing only.
    host_bytes = sum(pc.numel * 2 for r in rt.params for pc in rt.session.place(r.index)
                     if rt.session.home(pc.group, K.param_lowp) != tiermem._C.Tier.nvme)
    assert report["bytes_in_place"] == 2 * nparams - host_bytes, report
    assert report["bytes_read"] <= host_bytes + 8192 * report["requests"], report
    assert rt.stats()["bytes_moved"].get("host->nvme", 0) == 0  # the load wrote nothing
    ids = tokens(VOCAB)[0]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    # Reads upcast exactly: the values are the file's.
    want = file_values(ckpt)
    sd = model.state_dict()
    for k, v in want.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v.float()), k
    # Exported in Hugging Face's layout and read back by transformers: the same values.
    tiermem.save_pretrained(model, tmp_path / "export")
    back = plain(tmp_path / "export").state_dict()
    for k, v in want.items():
        assert torch.equal(back[k], v.float()), k


def test_lora_in_bf16_on_a_bf16_base_trains_as_with_fp32_masters(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    ckpt = bf16_checkpoint(tmp_path, tied=True)
    data = tokens(VOCAB)

    def run():
        torch.manual_seed(7)
        ours = peft.get_peft_model(on_meta(llama_config(True)), peft.LoraConfig(**LORA))
        torch.manual_seed(7)
        model, opt = tiermem.initialize(ours, bf16_cfg(tmp_path), weights=ckpt)
        return model, opt, train(model, opt, data)

    model, opt, losses = run()
    rt = tiermem.runtime_of(model)
    assert_no_fp32_copy_of_the_frozen(rt)
    # The same run with the old layout (fp32 masters of the frozen base): the same losses,
    # bit for bit — the bf16 compute copies are the same values.
    with monkeypatch.context() as m:
        with_masters(m)
        before, _, before_losses = run()
        brt = tiermem.runtime_of(before)
        assert not any(g.compute_only for g in groups(brt))
        assert brt.model_bytes - rt.model_bytes == 4 * frozen_bytes(rt)
        brt.close()
    assert losses == before_losses
    # Plain torch on the same base in bf16 (adapters fp32 as tiermem's masters, autocast):
    # the first loss exactly, the run close (tiermem steps fp32 masters, torch bf16 params).
    torch.manual_seed(7)
    ref = peft.get_peft_model(plain(ckpt), peft.LoraConfig(**LORA))
    for n, p in ref.named_parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=2e-3,
                                weight_decay=0.01)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_losses = train(ref, ref_opt, data)
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    # The frozen base's values, read back, are the file's bit for bit.
    want = file_values(ckpt)
    sd = model.state_dict()
    for k, v in want.items():
        ours_key = "base_model.model." + k
        ours_key = ours_key.replace("q_proj.weight", "q_proj.base_layer.weight")
        ours_key = ours_key.replace("v_proj.weight", "v_proj.base_layer.weight")
        assert torch.equal(sd[ours_key], v.float()), k


def test_a_write_of_a_value_bf16_cannot_hold_is_refused_and_changes_nothing(tmp_path):
    ckpt = bf16_checkpoint(tmp_path)
    model = tiermem.inference(on_meta(llama_config(False)), bf16_cfg(tmp_path), weights=ckpt)
    rt = tiermem.runtime_of(model)
    name = "model.layers.0.mlp.up_proj.weight"
    w = model.model.layers[0].mlp.up_proj.weight
    before = model.state_dict()[name]
    third = torch.full(w.shape, 1 / 3)
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight.*not exact"):
        with torch.no_grad():
            w.copy_(third)
    assert torch.equal(model.state_dict()[name], before)
    # The core refuses the same, naming the tensor; nothing written either.
    r = next(r for r in rt.params if r.name == "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(Exception, match="model.layers.0.mlp.up_proj.weight.*not exact in bf16"):
        rt.session.write_param(r.index, third.reshape(-1))
    assert torch.equal(model.state_dict()[name], before)
    # Exact values are taken, and read back exactly.
    exact = (before * 2).to(torch.bfloat16).float()
    with torch.no_grad():
        w.copy_(exact)
    assert torch.equal(model.state_dict()[name], exact)
    rt.session.write_param(r.index, before.reshape(-1))
    assert torch.equal(model.state_dict()[name], before)


def test_a_checkpoint_round_trips_and_an_old_one_loads_only_where_exact(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    ckpt = bf16_checkpoint(tmp_path, tied=True)
    data = tokens(VOCAB)

    def lora(**kw):
        torch.manual_seed(7)
        ours = peft.get_peft_model(on_meta(llama_config(True)), peft.LoraConfig(**LORA))
        torch.manual_seed(7)
        return tiermem.initialize(ours, bf16_cfg(tmp_path), weights=ckpt)

    model, opt = lora()
    train(model, opt, data[:1])
    tiermem.save_checkpoint(model, opt, tmp_path / "ck.safetensors")
    saved = model.state_dict()
    # A fresh run from the checkpoint: every value, frozen ones included, exactly.
    model2, opt2 = lora()
    tiermem.load_checkpoint(model2, opt2, tmp_path / "ck.safetensors")
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert train(model2, opt2, data[1:]) == train(model, opt, data[1:])
    # An old checkpoint (fp32 masters of the frozen base): its exact values load ...
    with monkeypatch.context() as m:
        with_masters(m)
        old, old_opt = lora()
        tiermem.save_checkpoint(old, old_opt, tmp_path / "old.safetensors")
        # ... and one whose frozen values bf16 cannot hold is refused, naming the tensor.
        w = old.base_model.model.model.layers[1].mlp.down_proj.weight
        with torch.no_grad():
            w.copy_(torch.full(w.shape, 1 / 3))
        tiermem.save_checkpoint(old, old_opt, tmp_path / "inexact.safetensors")
        tiermem.runtime_of(old).close()
    new, new_opt = lora()
    before = new.state_dict()
    with pytest.raises(Exception, match="model.layers.1.mlp.down_proj.*not exact in bf16"):
        tiermem.load_checkpoint(new, new_opt, tmp_path / "inexact.safetensors")
    for k, v in new.state_dict().items():  # nothing was loaded
        assert torch.equal(v, before[k]), k
    tiermem.load_checkpoint(new, new_opt, tmp_path / "old.safetensors")
    for k, v in new.state_dict().items():
        assert torch.equal(v, before[k]), k
