"""Offloaded inference (tiermem.inference, docs/inference.md): the same outputs as the plain
model for Hugging Face generate() (GPT-2, Llama) and torch's own modules, with the weights
streamed through a device budget far below their size from host DRAM or NVMe, the next
units prefetched, and the KV cache counted in the device budget."""
import copy
import re

import pytest
import torch
from torch import nn

import tiermem

transformers = pytest.importorskip("transformers")

VOCAB = 96


def gpt2(layers=6, width=64):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=width, n_layer=layers,
                                  n_head=4, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama(layers=4, width=64):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=None,
                                   pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def weight_bytes(m):
    return sum(p.numel() for p in m.parameters()) * 4


def prompts(batch, seq=7, seed=3):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, n=10):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("make,frac", [(gpt2, 0.35), (llama, 0.5)], ids=["gpt2", "llama"])
def test_generate_equals_plain_model_with_weights_streamed(make, frac, tmp_path):
    ref = make()
    model = copy.deepcopy(ref)
    budget = int(weight_bytes(ref) * frac)
    model = tiermem.inference(model, {"device_kind": "sim", "device": budget, "host": "256MiB",
                                      "timeline": str(tmp_path / "serve.tmt")})
    rt = tiermem.runtime_of(model)
    ids = prompts(3)
    expected = generate(ref, ids)
    got = generate(model, ids)
    assert torch.equal(got, expected)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    st = rt.stats()
    # Weights really streamed: more bytes into the device than it can hold, most acquires
    # prefetched (the order repeats every forward), never diverged, never over the budget.
    assert st["bytes_moved"]["host->device"] > 3 * budget
    assert st["prefetches"] > st["acquires"] // 3, st
    assert st["diverged"] == 0
    assert st["iterations"] == rt.forwards >= 10
    rep = rt.timeline_peaks()
    assert not rep["over_budget"]
    assert rep["peak"]["device"] <= budget
    # The KV cache is in the device budget: the timeline's activation category on the device.
    assert rt.cache_bytes > 0
    assert rep["category_peak"]["device"]["activation"] >= rt.cache_bytes
    # No gradient or optimizer chunks were made.
    assert rep["category_peak"]["host"]["grad"] == 0
    assert rep["category_peak"]["host"]["optim_state"] == 0
    rt.close()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert type(p) is nn.Parameter and torch.equal(p, q)


def test_weights_homed_on_nvme(tmp_path):
    ref = gpt2()
    wb = weight_bytes(ref)
    model = tiermem.inference(copy.deepcopy(ref), {
        "device_kind": "sim", "device": int(wb * 0.35), "host": int(wb * 0.5), "nvme": {"size": "64MiB", "path": str(tmp_path / "nvme")}})
    rt = tiermem.runtime_of(model)
    ids = prompts(2)
    assert torch.equal(generate(model, ids, 6), generate(ref, ids, 6))
    copied = rt.timeline_peaks()["copied"]
    assert sum(v for k, v in copied.items() if k.startswith("nvme->")) > wb  # read more than once
    assert not any(k.endswith("->nvme") for k in copied), copied  # weights never written back
    rt.close()


def test_kv_cache_too_large_for_the_budget_is_a_clear_error():
    ref = gpt2(layers=2)
    model = tiermem.inference(copy.deepcopy(ref), {"device_kind": "sim", "device": int(weight_bytes(ref) * 0.9)})
    rt = tiermem.runtime_of(model)
    big = prompts(48, seq=60)  # KV cache: 2 layers x 2 x 48 x 60 x 64 x 4 B = 2.9 MB
    with pytest.raises(MemoryError, match="non-chunk device memory.*KV cache"):
        with torch.no_grad():
            model(big, use_cache=True)
    # Nothing lost: a forward with a small cache works and equals the plain model.
    ids = prompts(2)
    assert torch.equal(generate(model, ids, 4), generate(ref, ids, 4))
    rt.close()


def test_kv_cache_evicts_weights_to_make_room(tmp_path):
    ref = gpt2(layers=4)
    wb = weight_bytes(ref)
    model = tiermem.inference(copy.deepcopy(ref), {"device_kind": "sim", "device": wb + (1 << 20)})
    rt = tiermem.runtime_of(model)
    ids = prompts(4)
    generate(model, ids, 2)  # everything fits: after it the weights sit on the device
    before = rt.stats()["evictions"]
    big = prompts(12, seq=50)  # KV cache ~1.3 MB: more than the 1 MiB left over
    out = generate(model, big, 4)
    assert torch.equal(out, generate(ref, big, 4))
    assert rt.stats()["evictions"] > before
    rep = rt.timeline_peaks()
    assert rep["peak"]["device"] <= wb + (1 << 20) and not rep["over_budget"]
    rt.close()


def test_torch_transformer_encoder_and_mha_equal_plain():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    ref = nn.Sequential(nn.Linear(16, 64), nn.TransformerEncoder(layer, 4,
                                                                 enable_nested_tensor=False),
                        nn.Linear(64, 8)).eval()
    model = tiermem.inference(copy.deepcopy(ref), {"device_kind": "sim", "device": int(weight_bytes(ref) * 0.6)},
                              units=[nn.TransformerEncoderLayer, nn.Linear])
    x = torch.randn(3, 10, 16)
    with torch.no_grad():  # served forwards run under no_grad: the encoder's fast path, as here
        expected = ref(x)
    for _ in range(3):
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    mha_ref = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    mha = tiermem.inference(copy.deepcopy(mha_ref), {"device_kind": "sim", "device": "1MiB"})
    q = torch.randn(2, 5, 32)
    a, w = mha(q, q, q)
    with torch.no_grad():
        ea, ew = mha_ref(q, q, q)
    torch.testing.assert_close(a, ea, rtol=0, atol=0)
    torch.testing.assert_close(w, ew, rtol=0, atol=0)
    assert not a.requires_grad  # served forwards run without autograd
    # The MHA is its own (root) unit: its forward left no saved-tensor hooks behind (they
    # leaked once, when the root wrapper copied the unit wrapper's attributes, and later
    # training in the same process could call a closed runtime's hooks).
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    tiermem.runtime_of(model).close()
    tiermem.runtime_of(mha).close()


def test_bad_input_leaves_the_model_as_it_was():
    ref = gpt2(layers=2)
    model = copy.deepcopy(ref)
    params = list(model.parameters())
    with pytest.raises(MemoryError, match="device budget"):
        tiermem.inference(model, {"device_kind": "sim", "device": 4096})
    with pytest.raises(ValueError):
        tiermem.inference(model, {"device_kind": "sim", "device": "lots"})
    assert list(model.parameters()) == params and not hasattr(model, "_tiermem_runtime")
    assert torch.equal(generate(model, prompts(1), 3), generate(ref, prompts(1), 3))
    tiermem.inference(model, {"device_kind": "sim", "device": "1MiB"})
    with pytest.raises(ValueError, match="already managed"):
        tiermem.inference(model)
    tiermem.runtime_of(model).close()


def test_budget_below_one_unit_names_the_bytes_needed():
    def block():
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    model = nn.Sequential(block(), block())
    params = list(model.parameters())
    # chunk_size 1024: the layout's minimum is 4 chunks (16 KiB), but a unit's 8 weights
    # alone fill 8 chunks (32 KiB).
    with pytest.raises(MemoryError, match=r"chunks of unit '0' need at once; set 'device' to "
                                          r"at least (\d+) bytes") as e:
        tiermem.inference(model, {"device_kind": "sim", "device": 20000, "chunk_size": 1024})
    need = int(re.search(r"at least (\d+) bytes", str(e.value)).group(1))
    assert need >= 8 * 4096
    tiermem.runtime_of(tiermem.inference(model, {"device_kind": "sim", "device": need, "chunk_size": 1024})).close()
    assert list(model.parameters()) == params and not hasattr(model, "_tiermem_runtime")
    assert all(type(p) is nn.Parameter for p in model.parameters())
