"""Compressed optimizer state (config optimizer.state_dtype; docs/python.md "Optimizer state in
8 bits or bf16"): the code maps against bitsandbytes', the engine against the same kernel on
plain tensors bit for bit (host mode with NVMe, and SimDevice), losses against bitsandbytes'
AdamW8bit, state_dict (torch-compatible, dequantized), checkpoints across formats, stats."""
import copy
import math

import pytest
import torch

import tiermem
from tiermem import _C
from conftest import KernelAdamW, batches, make_pair, model_bytes, train_steps

OPT = {"lr": 2e-3, "weight_decay": 0.01}


def cfg(tmp_path=None, dtype="int8", **kw):
    c = {"device_kind": "host", "host": "64MiB",
         "optimizer": dict(OPT, state_dtype=dtype)}
    if tmp_path is not None:
        c.update(host="384KiB", nvme={"size": "64MiB", "path": str(tmp_path / "nvme")})
    c.update(kw)
    return c


def test_code_maps_are_bitsandbytes_maps():
    F = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        ours = _C.dynamic_code(signed)
        theirs = F.create_dynamic_map(signed=signed).float()
        assert ours.shape == theirs.shape == (256,)
        # Generated from the description in double precision: the same values, bitsandbytes'
        # float32 linspace rounding aside (at most 2 ulps).
        ulps = (ours.view(torch.int32) - theirs.view(torch.int32)).abs()
        assert ulps.max().item() <= 2, (signed, ulps.max())
        assert (ulps == 0).sum().item() >= 128


def test_quantization_is_nearest_code_and_round_trips():
    torch.manual_seed(0)
    x = torch.randn(10000) * torch.logspace(-6, 0, 10000)
    codes, absmax = _C.quantize_state(x, "int8", 256, True)
    assert codes.dtype == torch.uint8 and absmax.shape == (40,)
    code = _C.dynamic_code(True)
    blocks = torch.nn.functional.pad(x, (0, 240)).view(-1, 256)
    assert torch.equal(absmax, blocks.abs().amax(1))
    # Nearest code by exhaustive search (ties aside: none in random data).
    y = (blocks * (1.0 / absmax)[:, None]).view(-1)[:10000]
    nearest = (y[:, None] - code[None, :]).abs().argmin(1)
    assert torch.equal(codes.long(), nearest)
    back = _C.dequantize_state(codes, absmax, 256, True)
    assert torch.equal(back, code[codes.long()] * absmax.repeat_interleave(256)[:10000])
    bf, none = _C.quantize_state(x, "bf16")
    assert none is None and torch.equal(bf, x.bfloat16())
    assert torch.equal(_C.dequantize_state(bf), x.bfloat16().float())
    with pytest.raises(ValueError, match="expected fp32, bf16 or int8"):
        _C.quantize_state(x, "int4")


@pytest.mark.parametrize("nvme", [False, True])
def test_engine_equals_the_kernel_on_plain_tensors(tmp_path, nvme):
    ref, ours = make_pair()
    data = batches(8)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), **OPT, state_dtype="int8"), data)
    model, opt = tiermem.initialize(ours, cfg(tmp_path if nvme else None))
    rt = tiermem.runtime_of(model)
    assert train_steps(model, opt, data) == ref_losses
    assert ref_losses[-1] < ref_losses[0]
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    st = rt.stats()["optimizer"]
    assert st["state_dtype"] == "int8"
    assert st["state_bytes"] < 0.6 * st["state_bytes_fp32"], st
    if nvme:
        assert st["nvme_state_bytes"] > 0, st
        ratio = st["state_bytes_fp32"] / st["state_bytes"]
        assert st["nvme_bytes_saved"] == int(st["nvme_state_bytes"] * (ratio - 1)), st
        io = rt.timeline_peaks()["io"]["nvme"]
        assert io["category_bytes"]["optim_state"] > 0, io


def test_sim_device_and_speculative_steps_equal_the_kernel_too():
    ref, ours = make_pair()
    data = batches(6)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), **OPT, state_dtype="int8"), data)
    # A third of the training state on the device: chunks move, groups step on the host, and
    # their updates are speculated in the backward (the compressed shadows adopted by step()).
    model, opt = tiermem.initialize(
        ours, {"device_kind": "sim", "device": model_bytes(ours) // 3, "host": "64MiB",
               "optimizer": dict(OPT, state_dtype="int8"), "optimizer_overlap": "backward"})
    assert train_steps(model, opt, data) == ref_losses
    assert tiermem.runtime_of(model).session.speculation["committed"] > 0


def test_losses_track_bitsandbytes_adamw8bit():
    bnb = pytest.importorskip("bitsandbytes")
    ref, ours = make_pair()
    data = batches(20)
    ref_losses = train_steps(ref, bnb.optim.AdamW8bit(ref.parameters(), **OPT), data)
    model, opt = tiermem.initialize(ours, cfg())
    losses = train_steps(model, opt, data)
    rel = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    assert rel < 1e-3, (rel, losses, ref_losses)


def test_state_dict_is_torch_compatible_and_round_trips():
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, cfg())
    train_steps(model, opt, batches(3))
    sd = opt.state_dict()
    rt = tiermem.runtime_of(model)
    for p_index, st in sd["state"].items():
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
        assert (st["exp_avg_sq"] >= 0).all()
    # torch's AdamW loads it; and back into tiermem: int8 tensors store the values' own codes
    # (quantized from the tensor's first element on), fp32-state ones the values.
    ref = copy.deepcopy(make_pair()[0])
    torch.optim.AdamW(ref.parameters(), **OPT).load_state_dict(sd)
    opt.load_state_dict(sd)
    sd2 = opt.state_dict()
    for k in sd["state"]:
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            a, b = sd["state"][k][name], sd2["state"][k][name]
            if a.numel() >= 4096:
                codes, absmax = _C.quantize_state(a.reshape(-1).contiguous(), "int8", 256, signed)
                a = _C.dequantize_state(codes, absmax, 256, signed).view(a.shape)
            assert torch.equal(a, b), (k, name)
    assert rt.session.state_format(0).dtype == "int8"


def test_checkpoint_across_state_dtypes_converts_with_a_warning(tmp_path, capfd):
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, cfg())
    train_steps(model, opt, batches(3))
    path = str(tmp_path / "ckpt.safetensors")
    tiermem.save_checkpoint(model, opt, path)
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        big = [k for k in keys if k.startswith("exp_avg/") and
               f.get_slice(k).get_dtype() == "U8"]
        assert big and all(k.replace("exp_avg/", "exp_avg_absmax/") in keys for k in big)
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    capfd.readouterr()
    _, other = make_pair()
    m2, o2 = tiermem.initialize(other, cfg(dtype="fp32"))
    tiermem.load_checkpoint(m2, o2, path)
    err = capfd.readouterr().err
    assert "saved as int8 (block 256)" in err and "fp32" in err, err
    for k, st in o2.state_dict()["state"].items():
        assert torch.equal(st["exp_avg"], saved[k]["exp_avg"]), k  # dequantized exactly


def test_unknown_state_dtype_is_refused_before_anything_changes():
    _, ours = make_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match="optimizer.state_dtype.*int4"):
        tiermem.initialize(ours, cfg(dtype="int4"))
    for k, v in ours.state_dict().items():
        assert torch.equal(v, before[k])
