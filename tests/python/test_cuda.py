"""The CUDA path: TIERMEM_DEVICE=cuda without a GPU is a clear error; with a GPU (label gpu),
20 training steps on the CUDA tier (params are CUDA tensors) equal plain torch on the GPU."""
import pytest
import torch

import tiermem
from conftest import (END_TO_END_LOSS_REL, END_TO_END_PARAM_ATOL, END_TO_END_PARAM_RTOL,
                      assert_close_rel, batches, make_pair, model_bytes)
from tiermem import _C

HAVE_GPU = torch.cuda.is_available() and _C.cuda_built()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_requested_without_a_gpu_is_a_clear_error_and_leaves_the_model(monkeypatch):
    ref, ours = make_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    monkeypatch.setenv("TIERMEM_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        tiermem.initialize(ours, {"device": model_bytes(ref) // 4})
    after = ours.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert getattr(ours, "_tiermem_runtime", None) is None


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
    model, opt = tiermem.initialize(ours, {"device": budget, "host": "1GiB",
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    rt = tiermem.runtime_of(model)
    assert rt.s.cuda
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
