"""The CUDA path: the package is built with CUDA wherever the toolkit is; TIERMEM_DEVICE=cuda
without a GPU is a clear error, and so is 'auto' when torch sees a GPU tiermem cannot use (never
silent CPU training); with a GPU (marker gpu), training on the CUDA tier at a quarter of the
model's training state equals plain torch on the GPU, with the optimizer on the device for the
groups that fit and on the host for the others, over many steps."""
import os
import shutil

import pytest
import torch

import tiermem
from conftest import (END_TO_END_LOSS_REL, END_TO_END_PARAM_ATOL, END_TO_END_PARAM_RTOL,
                      assert_close_rel, assert_placement_changes_nothing, batches, chunk_total,
                      encoder_batches, encoder_lm, make_pair, model_bytes, placement_budget,
                      train_each_placement, train_encoder, train_steps)
from tiermem import _C

HAVE_GPU = torch.cuda.is_available() and _C.cuda_built()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_requested_without_a_gpu_is_a_clear_error_and_leaves_the_model(monkeypatch):
    ref, ours = make_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    monkeypatch.setenv("TIERMEM_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        tiermem.initialize(ours, {"device_kind": "sim", "device": model_bytes(ref) // 4})
    after = ours.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert getattr(ours, "_tiermem_runtime", None) is None


def test_the_package_is_built_with_cuda_where_the_toolkit_and_a_cuda_torch_are():
    nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") or None)
    if not nvcc or torch.version.cuda is None:
        pytest.skip("no CUDA toolkit or a CPU-only torch here")
    assert _C.cuda_built(), "pip install . built tiermem without CUDA although nvcc is here"
    major = torch.version.cuda.split(".")[0]
    assert _C.cuda_runtime_version().split(".")[0] == major, \
        (_C.cuda_runtime_version(), torch.version.cuda)


def test_auto_on_a_gpu_tiermem_cannot_use_is_a_clear_error(monkeypatch):
    # torch sees a GPU, tiermem's runtime does not (a build without CUDA, or an old driver):
    # 'auto' must not fall back to training on the CPU in silence.
    if HAVE_GPU:
        pytest.skip("tiermem can use this machine's GPU")
    ref, ours = make_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="torch sees a GPU but .*device_kind 'sim'"):
        tiermem.initialize(ours, {"device": model_bytes(ref) // 4, "device_kind": "auto"})
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())
    assert getattr(ours, "_tiermem_runtime", None) is None
    # Asked for explicitly, the CPU is fine.
    model, _ = tiermem.initialize(ours, {"device": model_bytes(ref) // 4, "device_kind": "sim"})
    assert tiermem.runtime_of(model).session.device_kind == tiermem.DeviceKind.sim


def test_bad_device_kind_is_a_clear_error(monkeypatch):
    _, ours = make_pair()
    monkeypatch.setenv("TIERMEM_DEVICE", "tpu")
    with pytest.raises(ValueError, match="TIERMEM_DEVICE"):
        tiermem.initialize(ours, {})


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU and a CUDA build of tiermem")
def test_cuda_20_steps_quarter_budget_matches_torch_adamw_on_gpu(monkeypatch):
    monkeypatch.setenv("TIERMEM_DEVICE", "cuda")
    ref, ours = make_pair()
    budget = model_bytes(ref) // 4
    data = [(x.cuda(), y.cuda()) for x, y in batches(20)]
    ref = ref.cuda()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": budget, "host": "1GiB",
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    rt = tiermem.runtime_of(model)
    assert rt.session.cuda
    for i, (x, y) in enumerate(data):
        ropt.zero_grad()
        rl = ref(x, y)
        rl.backward()
        ropt.step()
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        assert_close_rel(loss.item(), rl.item(), END_TO_END_LOSS_REL, f"loss at step {i}")
    ours_sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours_sd[k].cpu(), v.cpu(), rtol=END_TO_END_PARAM_RTOL,
                                   atol=END_TO_END_PARAM_ATOL, msg=k)
    assert not rt.timeline_peaks()["over_budget"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU and a CUDA build of tiermem")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_optimizer_placed_on_the_device_where_it_fits_equals_host_placement(precision):
    # A budget that holds every param and grad chunk and about half the optimizer state: some
    # groups step on the GPU (the CUDA kernels), the others on the host (the CPU kernels). The
    # kernels agree bit for bit, so the run equals the all-host run exactly; fp32 also equals
    # plain torch's AdamW within the end-to-end tolerance.
    data = [(x.cuda(), y.cuda()) for x, y in batches(12)]
    base = {"host": "1GiB", "device_kind": "cuda", "chunk_size": 4096,
            "precision": precision, "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
    runs = train_each_placement(base, data, placement_budget(chunk_total(base), precision))
    assert_placement_changes_nothing(runs)
    if precision == "fp32":
        ref, _ = make_pair()
        ref = ref.cuda()
        ref_losses = train_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3,
                                                        weight_decay=0.01), data)
        assert_close_rel(runs["auto"][0], ref_losses, END_TO_END_LOSS_REL, "losses")
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(runs["auto"][1][k], v.cpu(), rtol=END_TO_END_PARAM_RTOL,
                                       atol=END_TO_END_PARAM_ATOL, msg=k)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU and a CUDA build of tiermem")
def test_cuda_stress_many_steps_small_budget_nvme_and_a_side_stream(tmp_path):
    # 60 steps at an eighth of the training state, NVMe homes, a plan, and the model run on a
    # non-default stream: every ordering edge (write-back after torch's writes, reuse after its
    # reads, compute after prefetches) is crossed thousands of times. The reference is tiermem
    # on the same GPU with everything fitting, on the default stream (nothing moves): a missing
    # wait shows up as garbage, far outside GPU rounding.
    data = [(x.cuda(), y.cuda()) for x, y in batches(60)]
    opt_cfg = {"lr": 1e-3, "weight_decay": 0.01}

    def run(cfg, stream):
        _, ours = make_pair()
        model, opt = tiermem.initialize(ours, dict(cfg, device_kind="cuda", optimizer=opt_cfg))
        stream.wait_stream(torch.cuda.current_stream())  # the data was made on the default one
        with torch.cuda.stream(stream):
            losses = train_steps(model, opt, data)
        return losses, model, tiermem.runtime_of(model)

    ref, _ = make_pair()
    want, ref_model, _ = run({"device_kind": "sim", "device": "1GiB", "host": "1GiB"}, torch.cuda.current_stream())
    got, model, rt = run({"device_kind": "sim", "device": model_bytes(ref) // 8, "host": model_bytes(ref) // 2,
                          "plan": "auto", "nvme": {"path": str(tmp_path), "size": "256MiB"}},
                         torch.cuda.Stream())
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, 1e-5, f"loss at step {i}")
    sd, rsd = model.state_dict(), ref_model.state_dict()
    for k, v in rsd.items():
        torch.testing.assert_close(sd[k].cpu(), v.cpu(), rtol=END_TO_END_PARAM_RTOL,
                                   atol=END_TO_END_PARAM_ATOL, msg=k)
    st = rt.stats()
    assert st["evictions"] > 0 and st["bytes_moved"].get("nvme->host", 0) > 0, st
    assert not rt.timeline_peaks()["over_budget"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU and a CUDA build of tiermem")
def test_cuda_deferred_updates_equal_updates_inside_step_across_stream_changes():
    # optimizer_overlap: next-forward on the GPU: some groups update with the CUDA kernels on
    # the device, queued on torch's stream at the next forward — which here alternates between
    # the default stream and a side stream every step (the update of step k runs on the stream
    # of step k+1). Bit for bit the run with every update inside step() ("off").
    data = [(x.cuda(), y.cuda()) for x, y in batches(10)]
    base = {"host": "1GiB", "device_kind": "cuda", "chunk_size": 4096,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
    budget = placement_budget(chunk_total(base))
    side = torch.cuda.Stream()
    out = {}
    for overlap in ("off", "next-forward"):
        _, ours = make_pair()
        model, opt = tiermem.initialize(ours, dict(base, device=budget,
                                                   optimizer_overlap=overlap))
        rt = tiermem.runtime_of(model)
        losses = []
        for i, (x, y) in enumerate(data):
            stream = side if i % 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.default_stream())
            with torch.cuda.stream(stream):
                opt.zero_grad()
                loss = model(x, y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            torch.cuda.default_stream().wait_stream(stream)
        assert rt.stats()["optimizer"]["device_groups"], "no group updated on the device"
        out[overlap] = (losses, {k: v.cpu() for k, v in model.state_dict().items()})
        rt.close()
    assert out["off"][0] == out["next-forward"][0]
    for k, v in out["off"][1].items():
        assert torch.equal(v, out["next-forward"][1][k]), k


def encoder_on_cuda_equals_outside(acts, extra, dropout, check, room=16_000_000):
    """The nn.TransformerEncoder LM trained on the GPU with `activations: acts` (and config
    `extra`) at a device budget of half its training state + `room` (below its activations),
    and with every activation kept (outside): bit for bit the same losses and weights;
    `check(runtime, steps)` on the first."""
    import copy
    base = encoder_lm(dropout=dropout)
    data = encoder_batches(6, batch=64, seq=64, device="cuda")
    nbytes = sum(p.numel() for p in base.parameters()) * 16
    out = {}
    for mode in ("outside", acts):
        model, opt = tiermem.initialize(
            copy.deepcopy(base), {"device": nbytes // 2 + room, "host": "1GiB",
                                  "device_kind": "cuda", "activations": mode,
                                  "optimizer": {"lr": 1e-3, "weight_decay": 0.01}, **extra},
            units=[torch.nn.TransformerEncoderLayer, torch.nn.Linear])
        rt = tiermem.runtime_of(model)
        losses = train_encoder(model, opt, data, seed=11)
        if mode == acts:
            check(rt, len(data))
            assert not rt.timeline_peaks()["over_budget"]
        out[mode] = (losses, {k: v.cpu() for k, v in model.state_dict().items()})
        rt.close()
    assert out[acts][0] == out["outside"][0]
    for k, v in out["outside"][1].items():
        assert torch.equal(v, out[acts][1][k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU and a CUDA build of tiermem")
def test_cuda_recomputed_activations_with_dropout_equal_kept_ones():
    # activations: recompute on the GPU: the recompute restores the CUDA RNG state of the
    # first run (dropout masks) and runs on torch's stream.
    def check(rt, steps):
        assert rt.stats()["activations"]["recomputed_units"] >= 4 * steps

    # The encoder layers hold Linear units, so only those recompute; the rest of a layer's
    # activations (36 MB at this batch) stay: room for them.
    encoder_on_cuda_equals_outside("recompute", {}, 0.1, check, room=40_000_000)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU and a CUDA build")
def test_cuda_activations_spilled_to_nvme_equal_kept_ones(tmp_path):
    # activations: offload with a host budget too small for them and an NVMe tier: they go
    # device -> pinned host bounce -> NVMe in the forward and back in the backward.
    def check(rt, steps):
        st = rt.stats()["activations"]
        assert st["spilled_bytes"] > 0 and st["fetched_bytes"] == st["offloaded_bytes"], st

    encoder_on_cuda_equals_outside(
        "offload", {"host": "8MiB", "nvme": {"path": str(tmp_path), "size": "1GiB"}}, 0.0, check)
