"""Host mode's floor with a real vocabulary (docs/host-mode.md "Chunk size and the host room";
runtime/host_floor.h): a Llama with a 32,000-token vocabulary trains with NVMe at a host budget
below seven chunks of its embedding (the floor while tensors stay whole), its embedding and head
split into pieces of rows, equal to plain torch; below the lower floor the refusal names the
tensor that sets it and leaves a model built on meta untouched."""
import copy
import time

import pytest
import torch

import tiermem
from conftest import KernelAdamW

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

OPT = {"lr": 2e-3, "weight_decay": 0.01}
MiB = 1 << 20


def llama(hidden, layers, intermediate, heads):
    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=64, tie_word_embeddings=False)


# CI-sized: 32,000 x 64 embedding and head (8.19 MB each in fp32), 4.2 M params.
CI = dict(hidden=64, layers=2, intermediate=128, heads=4)
# The floor while tensors stay whole: 7 chunks of the head (measured by asking the refusal
# before this change: 58,519,552 bytes).
CI_WHOLE_FLOOR = 58519552


def cfg(tmp_path, host):
    return {"device_kind": "host", "host": host, "optimizer": OPT,
            "nvme": {"size": "256MiB", "path": str(tmp_path / "nvme")}}


def train(model, opt, data):
    out = []
    for ids in data:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def pair_and_data(shape, steps, batch=2, seq=16):
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(llama(**shape))
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 32000, (batch, seq), generator=g) for _ in range(steps)]
    return ref, ours, data


def test_a_32k_vocabulary_trains_below_the_whole_tensor_floor_equal_to_plain_torch(tmp_path):
    ref, ours, data = pair_and_data(CI, 4)
    ref_losses = train(ref, KernelAdamW(ref.parameters(), **OPT), data)
    host = 32 * MiB
    assert host < CI_WHOLE_FLOOR
    model, opt = tiermem.initialize(ours, cfg(tmp_path, host))
    rt = tiermem.runtime_of(model)
    s = rt.session
    split = {r.name for r in rt.params if r.split}
    assert split == {"model.embed_tokens.weight", "lm_head.weight"}, split
    # The head's compute copy and gradient are kept out of the host tier.
    st = rt.stats()
    assert st["tiers"]["host"]["capacity"] == host - 2 * 32000 * 64 * 4
    assert train(model, opt, data) == ref_losses
    assert ref_losses[-1] < ref_losses[0]
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    moved = rt.stats()["bytes_moved"]
    assert moved.get("nvme->host", 0) > 0 and moved.get("host->nvme", 0) > 0, moved
    assert s.host_compute


def test_the_refusal_below_the_floor_names_the_tensor_and_leaves_a_meta_model_untouched(
        tmp_path):
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(llama(**CI))
    with pytest.raises(MemoryError,
                       match=r"host budget of 12\.00 MiB \(12582912 bytes\) is below the minimum "
                             r"of .* for this model with NVMe: tensor 'model\.embed_tokens\."
                             r"weight' \(32000 x 64, fp32\) is split across chunks and needs "
                             r"15\.62 MiB for its contiguous compute copy and its gradient.*a "
                             r"host budget of .* is enough"):
        tiermem.initialize(model, cfg(tmp_path, "12MiB"))
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(ValueError, match="not managed by tiermem"):
        tiermem.runtime_of(model)


@pytest.mark.slow
def test_the_12x768_llama_with_a_32k_vocabulary_trains_in_512MiB_equal_to_plain_torch(tmp_path):
    # The shape: 12 layers of 768, a 32,000 x 768 embedding and head (98 MB each),
    # 134 M params, 2.1 GB of fp32 training state. Refused below 725 MiB before (7 chunks of the
    # head), now it needs 2 x the head plus small chunks.
    ref, ours, data = pair_and_data(dict(hidden=768, layers=12, intermediate=2048, heads=12), 3)
    ref_losses = train(ref, KernelAdamW(ref.parameters(), **OPT), data)
    c = cfg(tmp_path, "512MiB")
    c["nvme"]["size"] = "4GiB"
    model, opt = tiermem.initialize(ours, c)
    t0 = time.perf_counter()
    losses = train(model, opt, data)
    print(f"12x768x32k at 512 MiB: {len(data)} steps in {time.perf_counter() - t0:.1f} s")
    assert losses == ref_losses
    assert tiermem.runtime_of(model).stats()["tiers"]["nvme"]["used"] > 0


def test_tiermem_floor_prints_the_budgets_the_session_asks_for(tmp_path):
    # `tiermem floor` computes the floors of a Llama shape with the session's own rules, without
    # a model: its host budget is the refusal's "is enough", and that budget trains a step; its
    # whole-tensor floor is the one measured before splitting.
    import re
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tiermem", "floor", "--layers", "2", "--hidden",
                          "64", "--intermediate", "128", "--vocab", "32000", "--heads", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    enough = int(re.search(r"a host budget of .* \((\d+) bytes\) is enough; tensor "
                           r"'model\.embed_tokens\.weight' \(32000 x 64\) sets it",
                           out.stdout).group(1))
    whole = int(re.search(r"tensors kept whole \(before splitting\): .* \((\d+) bytes\)",
                          out.stdout).group(1))
    assert whole == CI_WHOLE_FLOOR
    assert "device mode: a device budget of at least" in out.stdout
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(llama(**CI))
    with pytest.raises(MemoryError, match=rf"a host budget of .* \({enough} bytes\) is enough"):
        tiermem.initialize(model, cfg(tmp_path, "12MiB"))
    _, ours, data = pair_and_data(CI, 1)
    model, opt = tiermem.initialize(ours, cfg(tmp_path, enough))
    train(model, opt, data)
    assert tiermem.runtime_of(model).stats()["tiers"]["nvme"]["used"] > 0
    bad = subprocess.run([sys.executable, "-m", "tiermem", "floor", "--layers", "2", "--hidden",
                          "64", "--intermediate", "128", "--vocab", "32000", "--precision", "f8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--precision 'f8'" in bad.stderr, bad.stderr


def test_the_floor_is_exact_one_byte_below_is_refused_and_at_it_training_equals_plain_torch(
        tmp_path):
    # The copy of a split tensor is assembled one piece's chunk at a time, so the floor is its
    # copy and gradient plus 8 chunks (7 of room, 1 piece): under 2.7 x the head. The refusal's
    # "is enough" is that floor to the byte.
    import re
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(llama(**CI))
    with pytest.raises(MemoryError) as e:
        tiermem.initialize(model, cfg(tmp_path, "12MiB"))
    floor = int(re.search(r"a host budget of .* \((\d+) bytes\) is enough", str(e.value)).group(1))
    head = 32000 * 64 * 4
    assert 2 * head < floor < 2.7 * head
    with pytest.raises(MemoryError,
                       match=rf"host budget of .* \({floor - 1} bytes\) is below the minimum of "
                             rf".* \((\d+) bytes\) for this model with NVMe: tensor "
                             rf"'model\.embed_tokens\.weight' \(32000 x 64, fp32\) is split .* "
                             rf"plus .* for the chunk of its pieces pinned at a time meanwhile.*"
                             rf"a host budget of .* \({floor} bytes\) is enough"):
        tiermem.initialize(model, cfg(tmp_path, floor - 1))
    assert all(p.device.type == "meta" for p in model.parameters())
    ref, ours, data = pair_and_data(CI, 2)
    ref_losses = train(ref, KernelAdamW(ref.parameters(), **OPT), data)
    model, opt = tiermem.initialize(ours, cfg(tmp_path, floor))
    assert train(model, opt, data) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_tiermem_floor_served_whole_tensor_floor_is_the_sessions_edge(tmp_path):
    # Serving keeps host room for the most chunk groups one unit pins (runtime/layout.h
    # UnitsOf): `tiermem floor --serve` gives the tensors the units the Python package makes of a
    # Llama, so its whole-tensor floor is the budget from which the session keeps every tensor
    # whole — and one byte below it splits them. (Without the units it printed 1,179,648 bytes
    # for this shape, where the session splits.)
    import re
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tiermem", "floor", "--layers", "2", "--hidden",
                          "128", "--intermediate", "344", "--vocab", "256", "--heads", "4",
                          "--kv-heads", "2", "--serve"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    whole = int(re.search(r"tensors kept whole \(before splitting\): .* \((\d+) bytes\)",
                          out.stdout).group(1))
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    for host, split in ((whole, False), (whole - 1, True)):
        model = tiermem.inference(copy.deepcopy(ref), {
            "device_kind": "host", "host": host,
            "nvme": {"size": "64MiB", "path": str(tmp_path / f"nvme-{host}")}})
        assert any(r.split for r in tiermem.runtime_of(model).params) == split, host
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
        tiermem.close(model)
