"""The optimizer's update inside the backward where the host is full (optimizer_overlap
"backward", docs/python.md "When the optimizer runs"): with host budgets the homes fill, each
group's speculative update goes copy-on-write to fresh NVMe regions and step() flips the homes
(or drops it and runs the deferred update from the untouched old values). Bit-identical to
optimizer_overlap "off" with clipping that triggers and that does not, gradient accumulation,
fp16 loss scaling with overflowing steps and an NVMe tier too full for the speculative state;
the counters must show the NVMe path ran (a silently untaken path fails these tests)."""
import copy

import pytest
import torch

import tiermem
from conftest import (END_TO_END_LOSS_REL, END_TO_END_PARAM_ATOL, END_TO_END_PARAM_RTOL,
                      Encoder, KernelAdamW, batches, encoder_batches, make_pair, model_bytes)

SHAPE = dict(n_layer=4, n_embd=64)
OPT = {"lr": 2e-3, "weight_decay": 0.01}


def _cfg(tmp_path, overlap, nvme="64MiB", device_kind="host", **kw):
    # Host mode (compute on the CPU), or SimDevice with a quarter of the model on the device;
    # the host a third of the model either way: full of homes, m and v on NVMe.
    _, probe = make_pair(**SHAPE)
    total = model_bytes(probe)  # 3.4 MB of params, grads, m and v
    c = {"device_kind": device_kind, "host": f"{total // 3}B", "optimizer": OPT,
         "optimizer_overlap": overlap,
         "nvme": {"path": str(tmp_path / overlap), "size": nvme}}
    if device_kind == "sim":
        c["device"] = f"{total // 4}B"
    c.update(kw)
    return c


def _train(cfg, data, scaled=False):
    _, ours = make_pair(**SHAPE)
    model, opt = tiermem.initialize(ours, cfg)
    rt = tiermem.runtime_of(model)
    losses, skipped = [], 0
    for x, y in data:
        loss = model(x, y)
        (opt.scale_loss(loss) if scaled else loss).backward()
        opt.step()
        skipped += bool(opt.last_step_skipped)
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ostate = opt.state_dict()["state"]
    spec = dict(rt.session.speculation)
    rt.close()
    return losses, state, ostate, spec, skipped


def _same(a, b):
    assert a[0] == b[0]
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k
    for i in a[2]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[2][i][k], b[2][i][k]), (i, k)
    assert a[4] == b[4]


def _nvme_path_ran(spec, dropped=None):
    assert spec["speculated_nvme"] > 0 and spec["committed"] > 0, spec
    assert spec["no_room"] == 0, spec
    assert spec["committed"] + spec["dropped"] == spec["speculated"], spec
    assert spec["nvme_bytes_in_flight"] == 0 and spec["nvme_bytes_peak"] > 0, spec
    if dropped is not None:
        assert (spec["dropped"] > 0) == dropped, spec


@pytest.mark.parametrize("clip", [None, 1e9, "median"])
def test_copy_on_write_speculation_is_bit_identical_to_off(tmp_path, clip):
    # None: no clipping; 1e9: clipping that never triggers; "median": the threshold inside the
    # run's gradient norms, so about half the steps clip (their speculations are dropped).
    data = batches(8, **SHAPE)
    kw = {}
    if clip == "median":
        _, probe = make_pair(**SHAPE)
        opt = torch.optim.AdamW(probe.parameters(), **OPT)  # the same trajectory, unclipped
        norms = []
        for x, y in data:
            opt.zero_grad()
            probe(x, y).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(probe.parameters(), 1e9).item())
            opt.step()
        kw["gradient_clipping"] = sorted(norms)[len(norms) // 2]
    elif clip is not None:
        kw["gradient_clipping"] = clip
    off = _train(_cfg(tmp_path, "off", **kw), data)
    on = _train(_cfg(tmp_path, "backward", **kw), data)
    _same(off, on)
    _nvme_path_ran(on[3], dropped=True if clip == "median" else None)


def test_copy_on_write_speculation_with_gradient_accumulation(tmp_path):
    data = batches(8, **SHAPE)
    cfg = dict(gradient_accumulation_steps=2, gradient_clipping=1e9)
    # step()/zero_grad() every micro-batch: every second step() applies (docs/python.md).
    off = _train(_cfg(tmp_path, "off", **cfg), data)
    on = _train(_cfg(tmp_path, "backward", **cfg), data)
    _same(off, on)
    _nvme_path_ran(on[3])


def test_copy_on_write_speculation_with_fp16_overflow(tmp_path):
    # 2^20 overflows fp16 at first: those steps are skipped (their speculations dropped) and
    # the scale halves; growth_interval 2 doubles it again, overflowing again.
    data = batches(10, **SHAPE)
    cfg = dict(precision="fp16", loss_scaling={"initial_scale": 2 ** 20, "growth_interval": 2},
               device_kind="sim")
    off = _train(_cfg(tmp_path, "off", **cfg), data, scaled=True)
    on = _train(_cfg(tmp_path, "backward", **cfg), data, scaled=True)
    assert off[4] >= 2  # the test exercises skipping
    _same(off, on)
    _nvme_path_ran(on[3], dropped=True)


def test_an_nvme_tier_too_full_for_the_speculative_state_falls_back_exactly(tmp_path):
    # NVMe just big enough for the homes (as a probe session places them) and one block: no
    # group's new state fits beside them, nothing is speculated, every step runs deferred.
    data = batches(4, **SHAPE)
    _, probe = make_pair(**SHAPE)
    (tmp_path / "probe").mkdir()
    model, _ = tiermem.initialize(probe, _cfg(tmp_path / "probe", "off"))
    rt = tiermem.runtime_of(model)
    homes = rt.stats()["tiers"]["nvme"]["used"]
    rt.close()
    assert homes > 0
    nvme = f"{(homes + 4095) // 4096 * 4096 + 4096}B"
    off = _train(_cfg(tmp_path, "off", nvme=nvme), data)
    on = _train(_cfg(tmp_path, "backward", nvme=nvme), data)
    _same(off, on)
    spec = on[3]
    assert spec["speculated"] == 0 and spec["no_room"] > 0, spec
    assert spec["nvme_bytes_peak"] == 0, spec


def test_copy_on_write_speculation_equals_plain_adamw(tmp_path):
    # The GPT against plain torch AdamW (end-to-end tolerances, conftest) and against the same
    # AdamW kernel on the plain module (bit for bit).
    ref, ours = make_pair(**SHAPE)
    ref2, _ = make_pair(**SHAPE)
    data = batches(8, **SHAPE)
    torch_opt = torch.optim.AdamW(ref.parameters(), **OPT)
    kernel_opt = KernelAdamW(ref2.parameters(), **OPT)
    model, opt = tiermem.initialize(ours, _cfg(tmp_path, "backward"))
    rt = tiermem.runtime_of(model)
    for x, y in data:
        losses = []
        for m, o in ((ref, torch_opt), (ref2, kernel_opt), (model, opt)):
            o.zero_grad()
            loss = m(x, y)
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert losses[1] == losses[2]
        assert abs(losses[0] - losses[2]) <= END_TO_END_LOSS_REL * abs(losses[0]) + 1e-7
    sd = model.state_dict()
    for k, v in ref2.state_dict().items():
        assert torch.equal(sd[k], v), k
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=END_TO_END_PARAM_RTOL,
                                   atol=END_TO_END_PARAM_ATOL, msg=k)
    _nvme_path_ran(rt.session.speculation)
    rt.close()


def _encoder_steps(model, opt, data, clip=0.0, torch_clip=False):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if torch_clip and clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_transformer_encoder_with_copy_on_write_speculation(tmp_path, clip):
    # torch's own nn.TransformerEncoder in host mode, host 1 MiB of its 1.07 MB of state (the
    # rest on NVMe): vs optimizer_overlap "off" and the same AdamW kernel on the plain module
    # (bit for bit), vs plain torch AdamW (the end-to-end tolerances).
    torch.manual_seed(0)
    ref = Encoder()
    kref, ours_off, ours_on = (copy.deepcopy(ref) for _ in range(3))
    data = encoder_batches(5)
    torch_losses = _encoder_steps(ref, torch.optim.AdamW(ref.parameters(), **OPT), data, clip,
                                  torch_clip=True)
    kernel_losses = _encoder_steps(kref, KernelAdamW(kref.parameters(), clip=clip, **OPT), data)
    results = {}
    for overlap, ours in (("off", ours_off), ("backward", ours_on)):
        cfg = {"device_kind": "host", "host": "1MiB", "gradient_clipping": clip,
               "optimizer": OPT, "optimizer_overlap": overlap,
               "nvme": {"path": str(tmp_path / overlap), "size": "64MiB"}}
        model, opt = tiermem.initialize(ours, cfg)
        rt = tiermem.runtime_of(model)
        losses = _encoder_steps(model, opt, data)
        results[overlap] = (losses, {k: v.clone() for k, v in model.state_dict().items()},
                            dict(rt.session.speculation))
        rt.close()
    assert results["off"][0] == results["backward"][0] == kernel_losses
    for a, b in zip(torch_losses, kernel_losses):
        assert abs(a - b) <= END_TO_END_LOSS_REL * abs(a) + 1e-7
    on = results["backward"][1]
    for k, v in kref.state_dict().items():
        assert torch.equal(results["off"][1][k], on[k]), k
        assert torch.equal(on[k], v), k
    for k, v in ref.state_dict().items():
        got = on[k]
        if k.endswith("self_attn.in_proj_bias"):
            # The key bias (the middle third) adds the same term to every score of a query:
            # softmax cancels it, its gradient is rounding noise (~1e-10) that Adam scales to
            # lr-sized steps, so any two AdamW implementations part there (3e-5 between torch's
            # and the kernel on the plain module). Bit-equality with the kernel is asserted above.
            third = v.numel() // 3
            got, v = torch.cat([got[:third], got[2 * third:]]), torch.cat([v[:third], v[2 * third:]])
        torch.testing.assert_close(got, v, rtol=END_TO_END_PARAM_RTOL,
                                   atol=END_TO_END_PARAM_ATOL, msg=k)
    spec = results["backward"][2]
    assert spec["speculated_nvme"] > 0, spec
    assert spec["committed"] + spec["dropped"] == spec["speculated"], spec
