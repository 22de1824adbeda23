"""Host mode (device_kind 'host', what 'auto' picks without a GPU; docs/host-mode.md): compute
on the CPU against the chunks in host memory, NVMe-homed chunks read into host room before
use. Values equal plain torch bit for bit (the same AdamW kernel: KernelAdamW), with NVMe in
the loop, for the repo's GPT, Hugging Face GPT-2 and torch's own nn.TransformerEncoder."""
import copy

import pytest
import torch

import tiermem
from benchmarks import objective_bytes
from conftest import Encoder, KernelAdamW, batches, encoder_batches, make_pair, train_steps

OPT = {"lr": 2e-3, "weight_decay": 0.01}


def host_cfg(tmp_path, host, **kw):
    c = {"device_kind": "host", "host": host, "optimizer": OPT,
         "nvme": {"size": "64MiB", "path": str(tmp_path / "nvme")}}
    c.update(kw)
    return c


def assert_nvme_in_the_loop(rt):
    st = rt.stats()
    assert rt.session.device_kind == tiermem.DeviceKind.host and rt.session.host_compute
    moved = st["bytes_moved"]
    assert moved.get("nvme->host", 0) > 0 and moved.get("host->nvme", 0) > 0, moved
    assert not any(k.startswith("device") or k.endswith("device") for k, v in moved.items()
                   if v), moved
    assert st["tiers"]["nvme"]["used"] > 0


@pytest.mark.parametrize("plan", ["off", "auto"])
def test_gpt_with_nvme_equals_plain_torch(tmp_path, plan):
    ref, ours = make_pair()
    data = batches(8)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), **OPT), data)
    # 768 KiB: about the model's 0.68 MB of state, less the host room for NVMe-homed chunks in
    # use, so part of it lives on NVMe (and the plan is not declined: at 384 KiB it is).
    model, opt = tiermem.initialize(ours, host_cfg(tmp_path, "768KiB", plan=plan))
    rt = tiermem.runtime_of(model)
    assert train_steps(model, opt, data) == ref_losses
    assert ref_losses[-1] < ref_losses[0]
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert_nvme_in_the_loop(rt)
    if plan == "auto":
        p = rt.stats()["plan"]
        assert p["plans"] >= 1 and p["declined"] == "" and p["followed_iterations"] >= 1, p


def nvme_bytes(rt):
    return objective_bytes(rt.stats(), host_mode=True)


@pytest.mark.parametrize("host", ["384KiB", "768KiB"])
def test_the_default_plan_runs_and_moves_no_more_nvme_bytes_than_the_reactive_engine(tmp_path,
                                                                                     host):
    # plan: auto is the default; in host mode the planner minimizes NVMe bytes (a plan that
    # would move more than the engine did over the recorded step would be declined:
    # test_plan.py tests that bar).
    data = batches(9)
    per_step, plan_stats = {}, None
    for plan in ("off", None):
        _, ours = make_pair()
        (tmp_path / str(plan)).mkdir()  # tiermem creates only the NVMe path's last directory
        cfg = host_cfg(tmp_path / str(plan), host)
        if plan is not None:
            cfg["plan"] = plan
        model, opt = tiermem.initialize(ours, cfg)
        rt = tiermem.runtime_of(model)
        train_steps(model, opt, data[:6])
        before = nvme_bytes(rt)
        train_steps(model, opt, data[6:])
        per_step[plan] = (nvme_bytes(rt) - before) / 3
        p = rt.stats()["plan"]
        if plan is None:
            plan_stats = p
        else:
            assert p["plans"] == 0 and not p["active"] and p["declined"] == "", p
    p = plan_stats
    assert p["active"] and p["declined"] == "" and p["error"] == "", p
    assert p["followed_iterations"] >= 3 and p["divergences"] == 0, p
    assert 0 < per_step[None] <= per_step["off"], per_step


def test_everything_in_host_memory_is_resident_and_moves_nothing():
    ref, ours = make_pair()
    data = batches(5)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), **OPT), data)
    model, opt = tiermem.initialize(ours, {"device_kind": "host", "host": "64MiB",
                                           "optimizer": OPT})
    rt = tiermem.runtime_of(model)
    assert rt._resident
    assert train_steps(model, opt, data) == ref_losses
    assert sum(rt.stats()["bytes_moved"].values()) == 0


def test_hf_gpt2_with_nvme_equals_plain(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=3,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ref = transformers.GPT2LMHeadModel(cfg)
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 96, (4, 16), generator=g) for _ in range(6)]

    def train(m, o):
        out = []
        for ids in data:
            o.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            out.append(loss.item())
        return out

    ref_losses = train(ref, KernelAdamW(ref.parameters(), **OPT))
    model, opt = tiermem.initialize(ours, host_cfg(tmp_path, "384KiB"))
    assert train(model, opt) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert_nvme_in_the_loop(tiermem.runtime_of(model))


def test_torch_transformer_encoder_with_nvme_equals_plain(tmp_path):
    torch.manual_seed(0)
    ref = Encoder()
    ours = copy.deepcopy(ref)
    data = encoder_batches(5)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), **OPT), data)
    model, opt = tiermem.initialize(ours, host_cfg(tmp_path, "1MiB"))
    assert train_steps(model, opt, data) == ref_losses
    assert_nvme_in_the_loop(tiermem.runtime_of(model))


def test_serving_from_nvme_equals_plain(tmp_path):
    ref, ours = make_pair()
    ref.eval()
    x, _ = batches(1)[0]
    model = tiermem.inference(ours, {"device_kind": "host", "host": "160KiB",
                                     "nvme": {"size": "64MiB", "path": str(tmp_path / "n")}})
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), ref(x))
    rt = tiermem.runtime_of(model)
    assert rt.stats()["bytes_moved"].get("nvme->host", 0) > 0


def test_serving_everything_in_host_memory_is_resident_and_counts_the_kv_cache():
    # Host mode, every chunk homed in host memory: the weights are pinned once and the model
    # computes with them in place (no acquire per unit per token), and generate()'s KV cache
    # still counts in the host budget.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=3,
                                  n_head=2, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    ours = copy.deepcopy(ref)
    model = tiermem.inference(ours, {"device_kind": "host", "host": "64MiB"})
    rt = tiermem.runtime_of(model)
    assert rt._resident
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
              pad_token_id=0)
    acquires = rt.stats()["acquires"]
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    assert rt.stats()["acquires"] == acquires  # nothing acquired per forward
    assert rt.stats()["bytes_moved"] == {}
    assert rt.cache_bytes > 0  # the last forward's KV cache, counted in the host budget


def test_host_reserve_keeps_room_for_the_kv_cache_of_a_model_served_from_nvme(tmp_path):
    # Weights mostly on NVMe; generate() at batch 8 makes a KV cache (~0.9 MB) larger than
    # the host room kept for NVMe-homed chunks in use. Host homes never move, so without
    # host_reserve the cache cannot grow (a clear MemoryError); with it, it has room of its own.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=64, n_layer=6,
                                  n_head=2, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(1, 96, (8, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
              pad_token_id=0)
    expect = ref.generate(ids, **kw)
    nvme = {"size": "64MiB", "path": str(tmp_path / "n")}
    model = tiermem.inference(copy.deepcopy(ref), {"device_kind": "host", "host": "1600KiB",
                                                   "nvme": nvme})
    with pytest.raises(MemoryError, match="host tier: need .* nothing is evictable"):
        model.generate(ids, **kw)
    tiermem.runtime_of(model).close()
    model = tiermem.inference(copy.deepcopy(ref), {"device_kind": "host", "host": "1600KiB",
                                                   "host_reserve": "1MiB", "nvme": nvme})
    assert torch.equal(model.generate(ids, **kw), expect)
    rt = tiermem.runtime_of(model)
    assert rt.stats()["bytes_moved"].get("nvme->host", 0) > 0
    assert rt.cache_bytes > 512 * 1024


def test_auto_picks_host_without_a_gpu_and_ignores_a_device_budget_with_a_warning(capfd):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: auto picks cuda")
    _, ours = make_pair()
    model, _ = tiermem.initialize(ours, {"device": "1MiB", "host": "64MiB"})
    rt = tiermem.runtime_of(model)
    assert rt.session.device_kind == tiermem.DeviceKind.host
    assert "config 'device' (1048576 bytes) is ignored" in capfd.readouterr().err
    assert rt.stats()["tiers"]["device"]["capacity"] == 0


@pytest.mark.parametrize("cfg, match", [
    ({"device_kind": "host", "device": "1MiB"}, "host mode has no device tier"),
    ({"device_kind": "host", "activations": "offload"}, "in host memory already"),
    ({"device_kind": "host", "activations": "auto"}, "in host memory already"),
])
def test_bad_host_mode_configs_are_clear_errors_and_leave_the_model(cfg, match):
    _, ours = make_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        tiermem.initialize(ours, cfg)
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())


def test_a_host_budget_too_small_for_nvme_says_how_much_is_needed(tmp_path):
    _, ours = make_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(MemoryError, match="below the minimum of"):
        tiermem.initialize(ours, host_cfg(tmp_path, "16KiB"))
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())


def test_activations_in_the_host_budget_that_do_not_fit_say_host_and_change_nothing(tmp_path):
    # activations: 'budget' in host mode counts the saved activations in the host budget, next
    # to the chunks' homes. A batch whose activations cannot fit there is refused naming the
    # host (not a device: host mode has none, and 'offload' is refused there).
    # No NVMe: with it, the homes fill the host budget but for the room of the NVMe-homed
    # chunks in use, and only that room is left for activations.
    ref, ours = make_pair()
    model, opt = tiermem.initialize(ours, {"device_kind": "host", "host": "2MiB",
                                           "activations": "budget", "optimizer": OPT})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batches(1, batch=64)[0]
    with pytest.raises(MemoryError) as e:
        model(x, y)
    msg = str(e.value)
    assert "on the host) do not fit the host budget" in msg, msg
    assert "device" not in msg and "'offload'" not in msg, msg
    assert "Use a larger host budget or a smaller batch; the model is unchanged" in msg, msg
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # A batch that fits then trains exactly.
    data = batches(3)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), **OPT), data)
    assert train_steps(model, opt, data) == ref_losses


@pytest.mark.parametrize("lookahead", ["room", "depth"])
def test_gpt_with_nvme_clipping_and_accumulation_equals_plain_torch(tmp_path, lookahead):
    # The deferred updates read grads, m and v from NVMe whenever the lookahead brings them
    # (room: during the backward and across the step boundary); only when bytes move changes:
    # global-norm clipping (that triggers: max_norm below every step's norm) and accumulation
    # over 2 micro-batches give plain torch's values bit for bit either way.
    from test_training import train_ours, train_ref
    ref, ours = make_pair()
    data = batches(8, batch=2)
    ref_losses = train_ref(ref, data, lr=OPT["lr"], wd=OPT["weight_decay"], clip=0.05, accum=2)
    model, opt = tiermem.initialize(ours, host_cfg(tmp_path, "384KiB", plan="off",
                                                   gradient_clipping=0.05,
                                                   gradient_accumulation_steps=2,
                                                   prefetch_lookahead=lookahead))
    rt = tiermem.runtime_of(model)
    assert train_ours(model, opt, data, accum=2) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert_nvme_in_the_loop(rt)
    waits = rt.stats()["acquire_waits"]
    assert set(waits) >= {"misses", "miss_bytes", "late", "late_bytes", "by_phase"}, waits
