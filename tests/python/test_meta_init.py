"""Models built on the meta device (``with torch.device("meta")``, accelerate's
init_empty_weights()): tiermem gives each parameter its values in its chunks, module by module
(each module's reset_parameters, then the user's init), so a model larger than RAM is never
whole in memory (tiermem/initvalues.py, docs/python.md "Models larger than RAM"). Values equal
the same per-module initialization on a plain model; training then equals plain torch from
those values bit for bit; what no initialization writes is an error, and a failed call leaves
the model on the meta device."""
import pytest
import torch
from torch import nn

import tiermem
from tiermem.examples.gpt import GPT
from conftest import (KernelAdamW, batches, encoder_batches, small_config, train_encoder,
                      train_steps)

OPT = {"lr": 2e-3, "weight_decay": 0.01}


def host_cfg(tmp_path, host="256KiB", **kw):
    c = {"device_kind": "host", "host": host, "optimizer": OPT,
         "nvme": {"size": "64MiB", "path": str(tmp_path / "nvme")}}
    c.update(kw)
    return c


def on_meta(build):
    with torch.device("meta"):
        return build()


def per_module_reference(build, init, seed):
    """The same initialization on a plain model: every module holding parameters, in module
    order, runs its reset_parameters (or _reset_parameters) and then init."""
    ref = on_meta(build)
    for p in ref.parameters():
        torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape), p.requires_grad))
    torch.manual_seed(seed)
    for m in ref.modules():
        if next(m.parameters(recurse=False), None) is None:
            continue
        with torch.no_grad():
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if reset is not None:
                reset()
            if init is not None:
                init(m)
    return ref


def plain_with_values_of(build, model):
    """A plain model holding `model`'s current values (tied weights stay tied)."""
    ref = build()
    ref.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    return ref


def assert_all_meta(model):
    assert all(p.device.type == "meta" for p in model.parameters()), \
        [n for n, p in model.named_parameters() if p.device.type != "meta"]


def test_gpt_on_meta_gets_the_per_module_values_and_trains_as_plain_torch(tmp_path):
    build = lambda: GPT(small_config())  # noqa: E731
    model = on_meta(build)
    assert_all_meta(model)
    torch.manual_seed(5)
    model, opt = tiermem.initialize(model, host_cfg(tmp_path), init=GPT._init_weights)
    rt = tiermem.runtime_of(model)
    expect = per_module_reference(build, GPT._init_weights, 5)
    assert expect.lm_head.weight is expect.wte.weight
    got = model.state_dict()
    for k, v in expect.state_dict().items():
        assert torch.equal(got[k], v), k
    assert got["blocks.0.ln1.weight"].eq(1).all()  # LayerNorm.reset_parameters
    assert 0.015 < got["blocks.0.fc.weight"].std() < 0.025  # GPT's init, not Linear's

    ref = plain_with_values_of(build, model)
    data = batches(5)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), **OPT), data)
    assert train_steps(model, opt, data) == ref_losses
    assert ref_losses[-1] < ref_losses[0]
    moved = rt.stats()["bytes_moved"]
    assert moved.get("nvme->host", 0) > 0 and moved.get("host->nvme", 0) > 0, moved


def test_the_model_is_never_whole_in_memory(tmp_path):
    # At every init call, only the parameters of the module being initialized (and a tied
    # weight waiting for its last module) hold memory; the rest are meta or already in chunks.
    model = on_meta(lambda: GPT(small_config(n_layer=4)))
    params = list(model.parameters())
    most = []

    def init(m):
        most.append(sum(1 for p in params if p.device.type == "cpu" and p.numel() > 0))
        GPT._init_weights(m)

    model, _ = tiermem.initialize(model, host_cfg(tmp_path), init=init)
    assert len(most) == sum(1 for m in model.modules()
                            if next(m.parameters(recurse=False), None) is not None)
    assert max(most) <= 3, most  # a Linear's weight and bias + the tied embedding
    assert len(params) > 20
    # Closing it without making its values (a model larger than RAM) leaves them empty.
    tiermem.runtime_of(model).close(keep_values=False)
    assert all(p.numel() == 0 and type(p) is nn.Parameter for p in model.parameters())
    assert getattr(model, "_tiermem_runtime", None) is None


def test_torch_transformer_encoder_on_meta_needs_no_init(tmp_path):
    # nn.MultiheadAttention initializes by _reset_parameters, Linear and LayerNorm by
    # reset_parameters: torch's own modules need no init function.
    from conftest import encoder_lm
    build = encoder_lm
    model = on_meta(build)
    torch.manual_seed(7)
    model, opt = tiermem.initialize(model, host_cfg(tmp_path, "1MiB"))
    expect = per_module_reference(build, None, 7)
    got = model.state_dict()
    for k, v in expect.state_dict().items():
        assert torch.equal(got[k], v), k
    w = got["0.layers.0.self_attn.in_proj_weight"]
    assert w.abs().max() <= (6 / (64 + 192)) ** 0.5 + 1e-6 and w.std() > 0.05  # xavier_uniform_
    assert got["0.layers.0.self_attn.in_proj_bias"].eq(0).all()

    ref = plain_with_values_of(build, model)
    data = encoder_batches(3, batch=4, seq=8)
    ref_losses = train_encoder(ref, KernelAdamW(ref.parameters(), **OPT), data)
    assert train_encoder(model, opt, data) == ref_losses


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_models_on_meta_with_their_init_weights(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    from test_hf import batches as hf_batches, gpt2, llama, train as hf_train
    build = gpt2 if arch == "gpt2" else llama
    if arch == "gpt2":
        model = on_meta(build)  # GPT-2 has no buffers
    else:  # Llama's rotary frequencies are a buffer: accelerate keeps buffers real
        with accelerate.init_empty_weights():
            model = build()
    assert_all_meta(model)
    torch.manual_seed(9)
    model, opt = tiermem.initialize(model, host_cfg(tmp_path, "512KiB"),
                                    init=model._init_weights)
    vals = model.state_dict()
    assert all(torch.isfinite(v).all() for v in vals.values())
    emb = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    assert 0.015 < vals[emb].std() < 0.025  # the config's initializer_range

    ref = plain_with_values_of(build, model)
    data = hf_batches(4)
    ref_losses = hf_train(ref, KernelAdamW(ref.parameters(), **OPT), data)
    assert hf_train(model, opt, data) == ref_losses
    assert isinstance(transformers.__version__, str)


class Scale(nn.Module):
    """A module with a parameter and no reset_parameters."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return self.lin(x) * self.w


def test_a_parameter_no_initialization_writes_is_an_error_and_the_model_stays_meta(tmp_path):
    model = on_meta(lambda: nn.Sequential(nn.Linear(8, 8), Scale(8), nn.Linear(8, 2)))
    with pytest.raises(ValueError, match=r"1\.w was built on the meta device and Scale has no "
                                         r"reset_parameters\(\) and no init was given"):
        tiermem.initialize(model, host_cfg(tmp_path))
    assert_all_meta(model)  # the first Linear, written before the error, is meta again
    assert getattr(model, "_tiermem_runtime", None) is None

    def half_init(m):  # writes only part of the parameter
        if isinstance(m, Scale):
            m.w[:4] = 1.0

    with pytest.raises(ValueError, match=r"1\.w .* Scale has no reset_parameters\(\) and init "
                                         r"did not write all of it"):
        tiermem.initialize(model, host_cfg(tmp_path), init=half_init)
    assert_all_meta(model)

    def init(m):
        if isinstance(m, Scale):
            m.w.fill_(2.0)

    model, opt = tiermem.initialize(model, host_cfg(tmp_path), init=init)
    assert model.state_dict()["1.w"].eq(2.0).all()


def test_bad_input_with_a_meta_model_is_refused_and_changes_nothing(tmp_path):
    model = on_meta(lambda: GPT(small_config()))
    with pytest.raises(ValueError, match="init must be a function"):
        tiermem.initialize(model, host_cfg(tmp_path), init=3)
    assert_all_meta(model)
    # A budget too small: refused by the session before any value is made.
    with pytest.raises(MemoryError):
        tiermem.initialize(model, {"device_kind": "sim", "device": "4KiB", "host": "1MiB"},
                           init=GPT._init_weights)
    assert_all_meta(model)
    # A buffer on the meta device: its value was its constructor's, which never ran.
    m = on_meta(lambda: nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="buffer running_mean is on the meta device"):
        tiermem.initialize(m, host_cfg(tmp_path))
    assert_all_meta(m)
    # A module with meta and real parameters: its reset would overwrite the real ones.
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mixed[1].bias = nn.Parameter(torch.empty(4, device="meta"))
    w = mixed[1].weight.detach().clone()
    with pytest.raises(ValueError, match=r"Linear holds parameters on the meta device and real "
                                         r"ones \(1\.weight\)"):
        tiermem.initialize(mixed, host_cfg(tmp_path))
    assert torch.equal(mixed[1].weight, w) and mixed[1].bias.device.type == "meta"


def test_serving_a_meta_model_then_loading_its_weights(tmp_path):
    # Weights larger than RAM: build on meta, place in chunks (host 1/4 of the weights, the
    # rest on NVMe), then load the plain model's weights through load_state_dict.
    torch.manual_seed(0)
    plain = GPT(small_config())
    model = on_meta(lambda: GPT(small_config()))
    model = tiermem.inference(model, {"device_kind": "host", "host": "128KiB",
                                      "nvme": {"size": "64MiB", "path": str(tmp_path / "n")}},
                              init=GPT._init_weights)
    model.load_state_dict(plain.state_dict())
    x, _ = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    assert tiermem.runtime_of(model).stats()["tiers"]["nvme"]["used"] > 0
