"""Checkpoints cross the bindings (one metadata format, runtime/checkpoint_meta.h): a checkpoint
the LibTorch API saved resumes in Python and trains on exactly like uninterrupted training,
and the reverse.

The LibTorch side is the example program (integrations/torch/examples/train_gpt.cc, built as
build/integrations/torch/tiermem_train_gpt; TIERMEM_TRAIN_GPT overrides the path). The
Python side trains `MirrorGPT`, the example's gpt.h in Python: the same modules under the same
names (embed, block0.., head; the head's weight tied to embed.wte's), constructed in the same
order so that one seed draws the same initial values, and the same forward, with residual
dropout so that the resumed run depends on the restored RNG state. Units are gpt.h's
units. Data: the example's synthetic text, which gpt.py's synthetic_batches draws with the
same generator calls. One thread on both sides. Everything is compared bit for bit: the
initial values, the batches, every loss, and the final values, Adam moments and step counts
(from the checkpoint files, read with safetensors).
"""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tiermem
from tiermem.examples.gpt import GPTConfig, synthetic_batches

safetensors = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# The example's flags and their Python equivalents.
VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD = 256, 16, 2, 2, 32  # gpt.h's vocab_size is fixed: 256
BATCH, DROPOUT, LR, WD = 4, 0.1, 1e-3, 0.01
SEED, DATA_SEED = 0, 3
FRACTION = 0.5  # device budget: half of params + grads + AdamW state
STEPS_BEFORE, STEPS_AFTER = 3, 3
STEPS = STEPS_BEFORE + STEPS_AFTER
CPP_FLAGS = ["--n-layer", N_LAYER, "--n-embd", N_EMBD, "--n-head", N_HEAD,
             "--block-size", BLOCK, "--batch", BATCH, "--lr", LR, "--dropout", DROPOUT,
             "--seed", SEED, "--data-seed", DATA_SEED, "--threads", 1,
             "--budget-fraction", FRACTION]


def train_gpt_binary():
    """This build's tiermem_train_gpt: skipped only when the build has no LibTorch API."""
    if os.environ.get("TIERMEM_TRAIN_GPT"):
        return Path(os.environ["TIERMEM_TRAIN_GPT"])
    # build/python-tree/tiermem/__init__.py -> build/ (the tree whose extension this is)
    for build in (Path(tiermem.__file__).parent.parent.parent, ROOT / "build"):
        cache = build / "CMakeCache.txt"
        if not cache.exists():
            continue
        if "TIERMEM_BUILD_LIBTORCH:BOOL=OFF" in cache.read_text():
            pytest.skip(f"{build} was configured with TIERMEM_BUILD_LIBTORCH=OFF: no LibTorch "
                        "API, no tiermem_train_gpt")
        exe = build / "integrations" / "torch" / "tiermem_train_gpt"
        if not exe.exists():
            pytest.fail(f"{exe} is not built: cmake --build {build} --target tiermem_train_gpt")
        return exe
    pytest.skip("no CMake build tree next to this tiermem (an installed wheel): the LibTorch "
                "example is not built; set TIERMEM_TRAIN_GPT to run this test")


def run_cpp(tmp, steps, save=None, resume=None, print_data=False):
    """Runs the example; its JSON line ({"start", "losses"[, "data"]})."""
    cmd = [str(train_gpt_binary()), "--steps", str(steps), "--timeline", str(tmp / "cpp.tmt"),
           *map(str, CPP_FLAGS), "--print-losses"]
    if save:
        cmd += ["--save", str(save)]
    if resume:
        cmd += ["--resume", str(resume)]
    if print_data:
        cmd += ["--print-data"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- gpt.h in Python ----------------------------------------------------------------------

def init_linear(lin):  # gpt.h InitLinear
    with torch.no_grad():
        nn.init.normal_(lin.weight, 0.0, 0.02)
        if lin.bias is not None:
            nn.init.zeros_(lin.bias)


class Attention(nn.Module):  # CausalSelfAttentionImpl
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.proj = nn.Linear(N_EMBD, N_EMBD)
        init_linear(self.qkv)
        init_linear(self.proj)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // N_HEAD
        q, k, v = self.qkv(x).split(d, 2)
        q = q.view(b, t, N_HEAD, hd).transpose(1, 2)
        k = k.view(b, t, N_HEAD, hd).transpose(1, 2)
        v = v.view(b, t, N_HEAD, hd).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(float(hd)))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(mask.logical_not(), float("-inf")).softmax(-1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(b, t, d)
        return self.proj(y)


class Block(nn.Module):  # BlockImpl
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(N_EMBD)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(N_EMBD)
        self.fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.out = nn.Linear(4 * N_EMBD, N_EMBD)
        init_linear(self.fc)
        init_linear(self.out)

    def forward(self, x):
        x = x + F.dropout(self.attn(self.ln1(x)), DROPOUT, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), DROPOUT, self.training)


class Embed(nn.Module):  # EmbedImpl
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        with torch.no_grad():
            nn.init.normal_(self.wte.weight, 0.0, 0.02)
            nn.init.normal_(self.wpe.weight, 0.0, 0.02)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.size(1), dtype=torch.long))


class Head(nn.Module):  # HeadImpl: the final LayerNorm and the tied LM head
    def __init__(self, tied):
        super().__init__()
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.weight = tied

    def forward(self, x):
        return F.linear(self.ln_f(x), self.weight)


class MirrorGPT(nn.Module):  # GPTImpl: children embed, block0.., head
    def __init__(self):
        super().__init__()
        self.embed = Embed()
        self.blocks = []  # registered below as block0.. (gpt.h's names), not as a ModuleList
        for i in range(N_LAYER):
            self.blocks.append(Block())
            self.add_module(f"block{i}", self.blocks[-1])
        self.head = Head(self.embed.wte.weight)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def gpt_units(name, module):  # gpt.h's units: embed, each block, head
    return name == "embed" or name == "head" or (name.startswith("block") and "." not in name)


def data():
    return list(synthetic_batches(GPTConfig(block_size=BLOCK), BATCH, STEPS, DATA_SEED))


def n_params(model):
    return sum(p.numel() for p in model.parameters())  # the tied weight once, as train_gpt.cc


def run_python(steps, save=None, resume=None):
    """The example's loop in Python: losses of the steps run (from the checkpoint's step)."""
    torch.manual_seed(SEED if resume is None else 123)  # resumed: all from the checkpoint
    model = MirrorGPT()
    config = {"device_kind": "sim", "device": int(n_params(model) * 16 * FRACTION), "host": "1GiB",
              "optimizer": {"lr": LR, "weight_decay": WD}}
    model, opt = tiermem.initialize(model, config, units=gpt_units)
    start = 0
    if resume is not None:
        start = tiermem.load_checkpoint(model, opt, resume)["step"]
    losses = []
    for x, y in data()[start:steps]:
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if save is not None:
        tiermem.save_checkpoint(model, opt, save, extra={"step": steps})
    tiermem.runtime_of(model).close()
    return losses


def assert_same_state(a, b):
    """Two checkpoint files hold the same values, Adam moments and step counts, bit for bit."""
    ta, tb = safetensors.load_file(str(a)), safetensors.load_file(str(b))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        ma, mb = fa.metadata(), fb.metadata()
    for k in ("steps", "micro_steps"):
        assert json.loads(ma[k]) == json.loads(mb[k]), k


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted runs on both sides (their final checkpoints), the C++ initial state, and
    a checkpoint of each side after STEPS_BEFORE steps."""
    tmp = tmp_path_factory.mktemp("cross")
    r = {"tmp": tmp}
    r["cpp_init"] = tmp / "cpp-init.safetensors"
    run_cpp(tmp, 0, save=r["cpp_init"])
    r["cpp_full"] = run_cpp(tmp, STEPS, save=tmp / "cpp-full.safetensors", print_data=True)
    run_cpp(tmp, STEPS_BEFORE, save=tmp / "cpp-half.safetensors")
    r["py_full"] = run_python(STEPS, save=tmp / "py-full.safetensors")
    run_python(STEPS_BEFORE, save=tmp / "py-half.safetensors")
    return r


def test_both_sides_start_alike_and_train_alike(runs):
    """The premise of the cross tests: gpt.h and MirrorGPT are one model, with one data."""
    tmp = runs["tmp"]
    torch.manual_seed(SEED)
    mirror = MirrorGPT()
    init = safetensors.load_file(str(runs["cpp_init"]))
    names = [n for n, _ in mirror.named_parameters()]
    assert sorted(names) == sorted(k for k in init if "/" not in k)
    for n, p in mirror.named_parameters():
        assert torch.equal(p.detach(), init[n]), n
    assert runs["cpp_full"]["data"] == [x.reshape(-1).tolist() for x, _ in data()]
    assert runs["cpp_full"]["start"] == 0
    assert runs["cpp_full"]["losses"] == runs["py_full"]  # bit for bit
    assert_same_state(tmp / "cpp-full.safetensors", tmp / "py-full.safetensors")
    # Dropout is on: the losses depend on the generator.
    with torch.no_grad():
        x = data()[0][0]
        torch.manual_seed(1)
        a = mirror(x)
        torch.manual_seed(2)
        assert not torch.equal(a, mirror(x))


def test_a_libtorch_checkpoint_resumes_in_python(runs):
    tmp = runs["tmp"]
    losses = run_python(STEPS, resume=tmp / "cpp-half.safetensors",
                        save=tmp / "py-from-cpp.safetensors")
    assert losses == runs["cpp_full"]["losses"][STEPS_BEFORE:]  # bit for bit
    assert_same_state(tmp / "py-from-cpp.safetensors", tmp / "cpp-full.safetensors")


def test_a_python_checkpoint_resumes_with_the_libtorch_api(runs):
    tmp = runs["tmp"]
    out = run_cpp(tmp, STEPS, resume=tmp / "py-half.safetensors",
                  save=tmp / "cpp-from-py.safetensors")
    assert out["start"] == STEPS_BEFORE
    assert out["losses"] == runs["py_full"][STEPS_BEFORE:]  # bit for bit
    assert_same_state(tmp / "cpp-from-py.safetensors", tmp / "py-full.safetensors")
