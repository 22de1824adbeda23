"""Pretrained weights by the model's own names (tiermem/weights.py, docs/pretrained.md):
``initialize`` / ``inference`` with ``weights=PATH`` — a file written by safetensors itself or
a sharded directory — into real and meta-built models, with NVMe homes in the loop, then
training equal to plain torch loaded with ``load_state_dict``; bf16 files; tied names; buffers;
``strict=False``; every bad checkpoint refused with the model exactly as it was; and
``save_weights`` back out, read by safetensors and plain torch. The anonymous memory of a load
of a checkpoint several times the host budget stays within the budget, the staging and the
runtime's fixed overhead."""
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import safetensors.torch as st
import torch
from torch import nn

import tiermem
from tiermem.examples.gpt import GPT
from conftest import KernelAdamW, batches, small_config, train_steps

OPT = {"lr": 2e-3, "weight_decay": 0.01}


def sim_cfg(**kw):
    c = {"device_kind": "sim", "device": "1MiB", "host": "64MiB", "optimizer": OPT}
    c.update(kw)
    return c


def nvme_cfg(tmp_path, host="256KiB", **kw):
    c = {"device_kind": "host", "host": host, "optimizer": OPT,
         "nvme": {"size": "64MiB", "path": str(tmp_path / "nvme")}}
    c.update(kw)
    return c


def build(seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return GPT(small_config())


def on_meta():
    with torch.device("meta"):
        return GPT(small_config())


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_plain(model, path, drop=("lm_head.weight",)):
    """The model's state_dict with safetensors' own writer (a tie is one tensor: its second
    name dropped, as transformers does)."""
    st.save_file({k: v.contiguous() for k, v in state(model).items() if k not in drop}, str(path))


def plain_from(path):
    """A plain GPT loaded from the file with torch's load_state_dict."""
    ref = build(seed=99)
    sd = st.load_file(str(path))
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    return ref


def assert_untouched(model, before, meta):
    assert getattr(model, "_tiermem_runtime", None) is None
    if meta:
        assert all(p.device.type == "meta" for p in model.parameters())
    else:
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("meta", [False, True])
def test_a_safetensors_file_loads_and_trains_like_plain_torch(tmp_path, meta):
    path = tmp_path / "w.safetensors"
    save_plain(build(seed=1), path)
    model = on_meta() if meta else build(seed=2)
    model, opt = tiermem.initialize(model, sim_cfg(), weights=path)
    ref = plain_from(path)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    data = batches(3)
    assert train_steps(model, opt, data) == train_steps(ref, KernelAdamW(ref.parameters(), **OPT),
                                                        data)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    tiermem.runtime_of(model).close()


def test_a_meta_model_with_nvme_homes_loads_a_bf16_directory(tmp_path):
    src, _ = tiermem.initialize(build(seed=3), sim_cfg())
    tiermem.save_weights(src, tmp_path / "ckpt", max_shard_size=30_000, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "lm_head.weight" not in index["weight_map"]  # the tie, once
    model, opt = tiermem.initialize(on_meta(), nvme_cfg(tmp_path), weights=tmp_path / "ckpt")
    rt = tiermem.runtime_of(model)
    assert any(rt.session.home(g, tiermem._C.ChunkKind.param_fp32) == tiermem._C.Tier.nvme
               for g in range(rt.session.num_groups))
    want = {k: v.to(torch.bfloat16).float() for k, v in src.state_dict().items()}
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k  # bf16 values, widened exactly
    ref = build(seed=98)
    ref.load_state_dict(want)
    data = batches(2)
    assert train_steps(model, opt, data) == train_steps(ref, KernelAdamW(ref.parameters(), **OPT),
                                                        data)
    for r in (model, src):
        tiermem.runtime_of(r).close()


def test_a_huggingface_hub_sharded_directory(tmp_path):
    from huggingface_hub import save_torch_state_dict
    ref = build(seed=4)
    (tmp_path / "hub").mkdir()
    save_torch_state_dict({k: v for k, v in state(ref).items() if k != "lm_head.weight"},
                          tmp_path / "hub", max_shard_size=20_000)
    assert (tmp_path / "hub" / "model.safetensors.index.json").exists()
    model = tiermem.inference(on_meta(), sim_cfg(), weights=tmp_path / "hub")
    x = batches(1)[0][0]
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    tiermem.runtime_of(model).close()


def test_mixed_precision_loads_what_write_param_would(tmp_path):
    path = tmp_path / "w.safetensors"
    ref = build(seed=5)
    save_plain(ref, path)
    loaded, _ = tiermem.initialize(on_meta(), sim_cfg(precision="bf16"), weights=path)
    written, _ = tiermem.initialize(plain_from(path), sim_cfg(precision="bf16"))
    x, y = batches(1)[0]
    assert torch.equal(loaded(x, y), written(x, y))
    for r in (loaded, written):
        tiermem.runtime_of(r).close()


def test_tied_names_are_aliases(tmp_path):
    ref = build(seed=6)
    for keep in ("wte.weight", "lm_head.weight"):  # either name of the tie
        path = tmp_path / f"{keep}.safetensors"
        save_plain(ref, path, drop=({"wte.weight", "lm_head.weight"} - {keep}))
        model, _ = tiermem.initialize(build(seed=7), sim_cfg(), weights=path)
        assert torch.equal(model.state_dict()["wte.weight"], ref.wte.weight)
        tiermem.runtime_of(model).close()
    both = tmp_path / "both.safetensors"
    save_plain(ref, both, drop=())
    model, _ = tiermem.initialize(build(seed=7), sim_cfg(), weights=both)
    assert torch.equal(model.state_dict()["lm_head.weight"], ref.wte.weight)
    tiermem.runtime_of(model).close()


def test_strict_false_keeps_the_missing_parameters_initialization_in_one_warning(tmp_path):
    ref = build(seed=8)
    path = tmp_path / "w.safetensors"
    save_plain(ref, path, drop=("lm_head.weight", "blocks.1.fc.weight", "ln_f.bias"))
    with pytest.raises(ValueError, match=r"tensor 'blocks.1.fc.weight' has no source in .*w\."
                                         r"safetensors \(2 tensors are missing\)"):
        tiermem.initialize(on_meta(), sim_cfg(), weights=path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model, _ = tiermem.initialize(on_meta(), sim_cfg(), weights=path, strict=False,
                                      init=GPT._init_weights)
    mine = [w for w in caught if "tiermem" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "blocks.1.fc.weight" in str(mine[0].message) and "ln_f.bias" in str(mine[0].message)
    got = model.state_dict()
    assert torch.equal(got["blocks.0.fc.weight"], ref.blocks[0].fc.weight)
    assert got["ln_f.bias"].eq(0).all()  # LayerNorm's own reset_parameters
    assert 0.015 < got["blocks.1.fc.weight"].std() < 0.025  # GPT's init
    assert not torch.equal(got["blocks.1.fc.weight"], ref.blocks[1].fc.weight)
    tiermem.runtime_of(model).close()


@pytest.mark.parametrize("meta", [False, True])
def test_every_bad_checkpoint_leaves_the_model_exactly_as_it_was(tmp_path, meta):
    ref = build(seed=9)
    sd = {k: v for k, v in state(ref).items() if k != "lm_head.weight"}
    model = on_meta() if meta else build(seed=10)
    before = None if meta else state(model)

    def refused(path, match, exc=ValueError, **kw):
        with pytest.raises(exc, match=match):
            tiermem.initialize(model, nvme_cfg(tmp_path), weights=path, **kw)
        assert_untouched(model, before, meta)

    def write(name, d):
        st.save_file(d, str(tmp_path / name))
        return tmp_path / name

    missing = write("missing.safetensors", {k: v for k, v in sd.items() if k != "ln_f.weight"})
    refused(missing, r"tensor 'ln_f.weight' has no source in .*missing\.safetensors")
    extra = write("extra.safetensors", dict(sd, stray=torch.zeros(3)))
    refused(extra, r"extra\.safetensors holds key 'stray', which no parameter of the model uses")
    shape = write("shape.safetensors", dict(sd, **{"ln_f.bias": torch.zeros(5)}))
    refused(shape, r"tensor 'ln_f.bias': key 'ln_f.bias' in .*shape\.safetensors has shape "
                   r"\[5\], expected \[32\]")
    ints = write("ints.safetensors", dict(sd, **{"ln_f.bias": torch.zeros(32, dtype=torch.int32)}))
    refused(ints, r"key 'ln_f.bias' in .*ints\.safetensors is I32: only F32, BF16 and F16 load")
    # A torn shard and a shard the index names but the directory lacks.
    src, _ = tiermem.initialize(build(seed=9), sim_cfg())
    tiermem.save_weights(src, tmp_path / "torn", max_shard_size=30_000)
    tiermem.save_weights(src, tmp_path / "gone", max_shard_size=30_000)
    tiermem.runtime_of(src).close()
    shards = sorted(p.name for p in (tmp_path / "torn").glob("model-*.safetensors"))
    assert len(shards) > 2
    os.truncate(tmp_path / "torn" / shards[1], (tmp_path / "torn" / shards[1]).stat().st_size - 9)
    refused(tmp_path / "torn", re.escape(shards[1]) + r" is shorter than its header says \(torn "
                               r"or partially downloaded\)")
    os.remove(tmp_path / "gone" / shards[-1])
    refused(tmp_path / "gone", r"names the shard " + re.escape(shards[-1]) + r", which .*gone "
                               r"lacks")
    refused(tmp_path / "nowhere", r"nowhere does not exist", exc=OSError)
    # After all that, the model still initializes.
    good = write("good.safetensors", sd)
    model, _ = tiermem.initialize(model, nvme_cfg(tmp_path), weights=good)
    assert torch.equal(model.state_dict()["ln_f.weight"], ref.ln_f.weight)
    tiermem.runtime_of(model).close()


class WithNorm(nn.Module):
    """A model with persistent buffers (BatchNorm's running statistics, an int64 counter)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_buffers_load_and_export_with_the_parameters(tmp_path):
    torch.manual_seed(11)
    ref = WithNorm()
    ref.train()
    ref(torch.randn(16, 8))  # running statistics that are not the initial ones
    ref.eval()
    path = tmp_path / "w.safetensors"
    st.save_file(state(ref), str(path))
    with torch.device("meta"):
        meta = WithNorm()
    model = tiermem.inference(meta.eval(), sim_cfg(), weights=path)
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(model.state_dict()[k], ref.state_dict()[k]), k
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    tiermem.save_weights(model, tmp_path / "out.safetensors")
    back = st.load_file(str(tmp_path / "out.safetensors"))
    assert back.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(back[k], v), k
    tiermem.runtime_of(model).close()
    # A buffer of another shape or of a dtype torch has no tensor for: refused before anything.
    bad = state(ref)
    bad["bn.running_mean"] = torch.zeros(9)
    st.save_file(bad, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=r"buffer bn.running_mean: key 'bn.running_mean' in "
                                         r".*shape\.safetensors has shape \[9\], the buffer \[8\]"):
        tiermem.inference(WithNorm(), sim_cfg(), weights=tmp_path / "shape.safetensors")
    header = json.dumps({k: {"dtype": "F4" if k == "bn.running_mean" else
                             {torch.float32: "F32", torch.int64: "I64"}[v.dtype],
                             "shape": list(v.shape), "data_offsets": [0, 0]}
                         for k, v in state(ref).items()})
    # (a hand-made header: safetensors.torch cannot write F4)
    offsets, blobs, at = {}, [], 0
    for k, v in state(ref).items():
        raw = (bytes(4) if k == "bn.running_mean"
               else v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        offsets[k] = [at, at + len(raw)]
        blobs.append(raw)
        at += len(raw)
    h = json.loads(header)
    for k in h:
        h[k]["data_offsets"] = offsets[k]
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "f4.safetensors").write_bytes(len(text).to_bytes(8, "little") + text +
                                             b"".join(blobs))
    with pytest.raises(ValueError, match=r"buffer bn.running_mean: .* is F4, which no torch "
                                         r"tensor holds"):
        tiermem.inference(WithNorm(), sim_cfg(), weights=tmp_path / "f4.safetensors")
    # A buffer the checkpoint lacks: an error, or with strict=False its module's value.
    st.save_file({k: v for k, v in state(ref).items() if k != "bn.running_var"},
                 str(tmp_path / "nobuf.safetensors"))
    with pytest.raises(ValueError, match="buffer bn.running_var has no key"):
        tiermem.inference(WithNorm(), sim_cfg(), weights=tmp_path / "nobuf.safetensors")
    with pytest.warns(UserWarning, match="bn.running_var"):
        model = tiermem.inference(WithNorm(), sim_cfg(), weights=tmp_path / "nobuf.safetensors",
                                  strict=False)
    assert model.state_dict()["bn.running_var"].eq(1).all()
    tiermem.runtime_of(model).close()


def test_save_weights_is_read_by_safetensors_and_plain_torch(tmp_path):
    model, opt = tiermem.initialize(build(seed=12), sim_cfg(precision="bf16"))
    train_steps(model, opt, batches(2))
    sd = state(model)  # the fp32 masters
    tiermem.save_weights(model, tmp_path / "one.safetensors")
    back = st.load_file(str(tmp_path / "one.safetensors"))
    assert set(back) == set(sd) - {"lm_head.weight"}
    for k, v in back.items():
        assert v.dtype == torch.float32 and torch.equal(v, sd[k]), k
    tiermem.save_weights(model, tmp_path / "half", dtype=torch.float16, max_shard_size="20KB")
    files = sorted(os.listdir(tmp_path / "half"))
    assert files[-1] == "model.safetensors.index.json" and len(files) > 3
    ref = build(seed=13)
    loaded = {}
    for f in files[:-1]:
        loaded.update(st.load_file(str(tmp_path / "half" / f)))
    assert all(v.dtype == torch.float16 for v in loaded.values())
    for k, v in loaded.items():
        assert torch.equal(v, sd[k].to(torch.float16)), k  # rounded as .to rounds
    ref.load_state_dict({k: v.float() for k, v in loaded.items()}, strict=False)
    # Exporting again into the same directory as one shard replaces the sharded layout.
    tiermem.save_weights(model, tmp_path / "half", max_shard_size="1GB")
    assert sorted(os.listdir(tmp_path / "half")) == ["model.safetensors"]
    with pytest.raises(ValueError, match="dtype must be"):
        tiermem.save_weights(model, tmp_path / "x", dtype=torch.int8)
    tiermem.runtime_of(model).close()


# The load's anonymous memory: a served model built on the meta device, loaded from a
# checkpoint 4x the host budget (64 MiB of fp32), most chunks homed on NVMe. Measured in
# a child process (RssAnon of /proc/self/status, sampled while the load runs without the GIL),
# against its own baseline after torch and the model are set up.
RSS_CHILD = textwrap.dedent("""
    import sys, threading, time, torch, tiermem
    from torch import nn
    path, nvme = sys.argv[1], sys.argv[2]
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(512, 512, bias=False) for _ in range(64))
        def forward(self, x):
            for l in self.layers:
                x = l(x)
            return x
    with torch.device("meta"):
        model = Big()
    base, peak, done = anon(), [0], [False]
    def sample():
        while not done[0]:
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)
    t = threading.Thread(target=sample)
    t.start()
    try:
        model = tiermem.inference(model, {"device_kind": "host", "host": "16MiB",
                                          "nvme": {"size": "160MiB", "path": nvme}}, weights=path)
    finally:
        done[0] = True
        t.join()
    w = tiermem.runtime_of(model).session.read_param(5)
    print(base, peak[0], float(w[:4].sum()))
""")


def test_a_load_larger_than_the_host_budget_stays_within_budget_and_staging(tmp_path):
    torch.manual_seed(14)
    tensors = {f"layers.{i}.weight": torch.randn(512, 512)
               for i in range(64)}  # 64 MiB: 4x the 16 MiB host budget
    st.save_file(tensors, str(tmp_path / "w.safetensors"))
    (tmp_path / "nvme").mkdir()
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(tmp_path / "w.safetensors"),
                          str(tmp_path / "nvme")], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    base, peak, check = out.stdout.split()
    grew = int(peak) - int(base)
    host, staging, fixed = 16 << 20, 32 << 20, 32 << 20  # fixed: the runtime's own (stated)
    assert grew <= host + staging + fixed, f"anonymous memory grew by {grew >> 20} MiB"
    assert float(check) == float(tensors["layers.5.weight"][0, :4].sum())


# A write home failing in the middle of the load's pipeline (runtime/weights.cc): the session's
# NVMe file may not be written past 256 KiB once the session exists (RLIMIT_FSIZE: EFBIG, its
# signal ignored), in a child process so that the limit stays there.
WRITE_FAILS_CHILD = textwrap.dedent("""
    import resource, signal, sys, torch, tiermem
    from torch import nn
    path, nvme = sys.argv[1], sys.argv[2]
    torch.manual_seed(16)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(16)])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Session = tiermem._C.Session
    class Limited(Session):
        def __init__(self, *args):
            super().__init__(*args)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
    tiermem._C.Session = Limited
    try:
        tiermem.initialize(model, {"device_kind": "host", "host": "1MiB",
                                   "nvme": {"size": "16MiB", "path": nvme}}, weights=path)
    except Exception as e:
        print(type(e).__name__, str(e).replace(chr(10), " "))
    assert getattr(model, "_tiermem_runtime", None) is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    print("untouched")
""")


def test_a_write_home_failing_mid_load_is_an_error_and_leaves_the_model_as_it_was(tmp_path):
    torch.manual_seed(17)
    st.save_file({f"{i}.weight": torch.randn(256, 256) for i in range(16)},
                 str(tmp_path / "w.safetensors"))  # 4 MiB: 4x the host budget
    (tmp_path / "nvme").mkdir()
    out = subprocess.run([sys.executable, "-c", WRITE_FAILS_CHILD, str(tmp_path / "w.safetensors"),
                          str(tmp_path / "nvme")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    error, untouched = out.stdout.strip().split("\n")
    assert re.match(r"\w+Error .*failed after validation.*File too large", error), error
    assert untouched == "untouched"


def test_a_failure_after_the_load_gives_the_buffers_back(tmp_path, monkeypatch):
    torch.manual_seed(15)
    ref = WithNorm()
    ref.train()
    ref(torch.randn(16, 8))
    st.save_file(state(ref), str(tmp_path / "w.safetensors"))
    model = WithNorm()
    before = state(model)
    buffers = dict(model.named_buffers())

    def fail(runtime):
        raise RuntimeError("the optimizer could not be made")
    monkeypatch.setattr(tiermem, "ChunkedAdamW", fail)
    with pytest.raises(RuntimeError, match="could not be made"):
        tiermem.initialize(model, sim_cfg(), weights=tmp_path / "w.safetensors")
    assert_untouched(model, before, meta=False)
    for name, b in model.named_buffers():
        assert b is buffers[name], name  # the very objects, not copies


def _load_on_rank(rank, world, path, out):
    model, _ = tiermem.initialize(build(seed=20 + rank), sim_cfg(), weights=path)
    assert tiermem.runtime_of(model).session.sharded
    values = state(model)  # gathered from every rank's shard
    tiermem.save_weights(model, out, max_shard_size=40_000)  # every rank reads; rank 0 writes
    tiermem.runtime_of(model).close()
    return values


def test_ranks_load_their_shards_and_export_together(tmp_path):
    """Two ranks (Gloo): each reads its shard of the checkpoint; the gathered values are the
    file's on both; the export they make together is the same checkpoint again."""
    from dist_harness import run_ranks
    ref = build(seed=16)
    save_plain(ref, tmp_path / "w.safetensors")
    got = run_ranks(2, _load_on_rank, str(tmp_path / "w.safetensors"), str(tmp_path / "out"))
    for values in got:
        for k, v in ref.state_dict().items():
            assert torch.equal(values[k], v), k
    back = {}
    for f in (tmp_path / "out").glob("model-*.safetensors"):
        back.update(st.load_file(str(f)))
    assert back.keys() == ref.state_dict().keys() - {"lm_head.weight"}
    for k, v in back.items():
        assert torch.equal(v, ref.state_dict()[k]), k
