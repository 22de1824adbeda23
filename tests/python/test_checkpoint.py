"""Streaming checkpoints (tiermem.save_checkpoint / load_checkpoint, docs/checkpoints.md):
exact resume in a fresh process, a safetensors file that loads without tiermem, loads at
another budget and precision, a killed save that leaves the previous checkpoint intact, and
bad files that change nothing."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tiermem
from conftest import batches, make_pair, model_bytes, small_config, train_steps

safetensors = pytest.importorskip("safetensors.torch")

STEPS_BEFORE, STEPS_AFTER = 3, 3


def tiny_budget(model):
    return {"device_kind": "sim", "device": model_bytes(model) // 4, "host": "64MiB"}


def trained_and_saved(seed, tmp_path, steps):
    """A tiermem model (and its plain twin) trained `steps` steps at a quarter of its data
    size, and the checkpoint it saved then."""
    ref, ours = make_pair(seed=seed)
    model, opt = tiermem.initialize(ours, tiny_budget(ref))
    train_steps(model, opt, batches(steps))
    path = tmp_path / "c.safetensors"
    tiermem.save_checkpoint(model, opt, path)
    return ref, model, opt, path


def _resume_script(path, data_path, cfg):
    return textwrap.dedent(f"""
        import sys, torch, tiermem
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import small_config, train_steps
        from tiermem.examples.gpt import GPT
        torch.manual_seed(123)  # a different init: everything must come from the checkpoint
        model, opt = tiermem.initialize(GPT(small_config()), {cfg!r})
        extra = tiermem.load_checkpoint(model, opt, {path!r})
        data = torch.load({data_path!r})
        losses = train_steps(model, opt, data)
        print(repr((extra, opt.param_groups[0]["lr"], torch.rand(1).item(), losses)))
        print(repr([p.detach().clone().tolist() for p in model.parameters()]))
    """)


def test_resume_in_a_fresh_process_is_bit_exact(tmp_path):
    ref, ours = make_pair()
    data = batches(STEPS_BEFORE + STEPS_AFTER)
    cfg = tiny_budget(ref)
    model, opt = tiermem.initialize(ours, cfg)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = []
    for x, y in data[:STEPS_BEFORE]:
        before += train_steps(model, opt, [(x, y)])
        sched.step()
    path = tmp_path / "ckpt.safetensors"
    torch.manual_seed(99)  # the RNG state at the save must come back at the load
    tiermem.save_checkpoint(model, opt, path, extra={"epoch": 2})
    assert not os.path.exists(str(path) + ".tmp")
    # The uninterrupted run: the same M more steps in this process.
    expected_rand = torch.rand(1).item()
    torch.manual_seed(99)
    torch.rand(1)
    after = train_steps(model, opt, data[STEPS_BEFORE:])
    expected_params = [p.detach().clone().tolist() for p in model.parameters()]
    data_path = tmp_path / "data.pt"
    torch.save(data[STEPS_BEFORE:], data_path)
    out = subprocess.run([sys.executable, "-c", _resume_script(str(path), str(data_path), cfg)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    extra, lr, rand, losses = eval(lines[-2])
    assert extra == {"epoch": 2}
    assert lr == pytest.approx(1e-3 * 0.5 ** STEPS_BEFORE, rel=0, abs=0)  # the schedule's lr
    assert rand == expected_rand
    assert losses == after  # bit for bit
    assert eval(lines[-1]) == expected_params
    assert len(before) == STEPS_BEFORE
    tiermem.runtime_of(model).close()


def test_file_loads_with_safetensors_and_into_a_plain_model(tmp_path):
    ref, model, opt, path = trained_and_saved(4, tmp_path, steps=2)
    sd = safetensors.load_file(str(path))
    msd, osd = model.state_dict(), opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    for i, n in enumerate(names):
        assert sd[n].shape == msd[n].shape and torch.equal(sd[n], msd[n]), n
        assert torch.equal(sd[f"exp_avg/{n}"], osd["state"][i]["exp_avg"]), n
        assert torch.equal(sd[f"exp_avg_sq/{n}"], osd["state"][i]["exp_avg_sq"]), n
    ref.load_state_dict({k: v for k, v in sd.items() if "/" not in k}, strict=False)
    for n, p in ref.named_parameters():
        assert torch.equal(p, msd[n]), n
    tiermem.runtime_of(model).close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loads_at_another_budget_and_precision(tmp_path, precision):
    ref, model, opt, path = trained_and_saved(5, tmp_path, steps=2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    torch.manual_seed(77)
    from tiermem.examples.gpt import GPT
    m2, o2 = tiermem.initialize(GPT(small_config()), {"device_kind": "sim", "device": 4 * model_bytes(ref),
                                                      "precision": precision})
    tiermem.load_checkpoint(m2, o2, path)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, saved[k]), k  # fp32 masters, exactly
    for i, st in o2.state_dict()["state"].items():
        assert torch.equal(st["exp_avg"], saved_opt["state"][i]["exp_avg"])
    for r in (model, m2):
        tiermem.runtime_of(r).close()


def test_bad_files_and_mismatched_models_change_nothing(tmp_path):
    _, model, opt, path = trained_and_saved(6, tmp_path, steps=1)
    train_steps(model, opt, batches(1, seed=9))
    now = {k: v.clone() for k, v in model.state_dict().items()}
    raw = path.read_bytes()
    (tmp_path / "torn.safetensors").write_bytes(raw[:-1000])
    with pytest.raises(OSError, match="torn"):
        tiermem.load_checkpoint(model, opt, tmp_path / "torn.safetensors")
    flipped = bytearray(raw)
    flipped[len(raw) - 5000] ^= 0x10
    (tmp_path / "flip.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(OSError, match="checksum mismatch"):
        tiermem.load_checkpoint(model, opt, tmp_path / "flip.safetensors")
    safetensors.save_file({"x": torch.zeros(3)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ValueError, match="without tiermem's metadata"):
        tiermem.load_checkpoint(model, opt, tmp_path / "foreign.safetensors")
    with pytest.raises(OSError):
        tiermem.load_checkpoint(model, opt, tmp_path / "missing.safetensors")
    _, other = make_pair(seed=6, n_embd=48)
    m2, o2 = tiermem.initialize(other, {"device_kind": "sim", "device": "4MiB"})
    with pytest.raises(ValueError, match="nothing was loaded"):
        tiermem.load_checkpoint(m2, o2, path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, now[k]), k
    # Inside an accumulation window a save is refused (the gradients would be lost).
    m3, o3 = tiermem.initialize(make_pair(seed=6)[1], {"device_kind": "sim", "device": "4MiB",
                                                       "gradient_accumulation_steps": 2})
    train_steps(m3, o3, batches(1))
    with pytest.raises(Exception, match="accumulation"):
        tiermem.save_checkpoint(m3, o3, tmp_path / "acc.safetensors")
    assert not (tmp_path / "acc.safetensors").exists()
    for r in (model, m2, m3):
        tiermem.runtime_of(r).close()


def test_a_killed_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "c.safetensors"
    script = textwrap.dedent(f"""
        import sys, torch, tiermem
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import batches, small_config, train_steps
        from tiermem.examples.gpt import GPT
        model, opt = tiermem.initialize(GPT(small_config(n_embd=256, n_layer=4, vocab_size=256)),
                                        {{"device_kind": "sim", "device": "64MiB"}})
        tiermem.save_checkpoint(model, opt, {str(path)!r})
        print("saved", flush=True)
        while True:  # keep saving new states until killed
            train_steps(model, opt, batches(1, vocab_size=256))
            tiermem.save_checkpoint(model, opt, {str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        tmp = str(path) + ".tmp"
        deadline = time.time() + 120
        while not os.path.exists(tmp) and time.time() < deadline:
            time.sleep(0.0005)
        assert os.path.exists(tmp), "no save in progress seen"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    from tiermem.examples.gpt import GPT
    model, opt = tiermem.initialize(GPT(small_config(n_embd=256, n_layer=4, vocab_size=256)),
                                    {"device_kind": "sim", "device": "64MiB"})
    tiermem.load_checkpoint(model, opt, path)  # the last complete save: verifies and loads
    tiermem.runtime_of(model).close()


# ---- files of earlier builds (tests/data/README.md) and metadata tiermem cannot read --------

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
TINY = {"device_kind": "sim", "device": "1MiB", "host": "16MiB"}


def _crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _with_metadata(src, dst, edit):
    """`src` with its safetensors metadata edited by `edit(dict)`, the header checksum made
    right again (over the padded header text with its own value zeroed, as the writer does)."""
    import struct
    raw = open(src, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header["__metadata__"])
    header["__metadata__"]["header_crc32c"] = "00000000"
    text = json.dumps(header, separators=(",", ":"), sort_keys=True)
    text += " " * (-(8 + len(text)) % 4096)
    crc = "%08x" % _crc32c(text.encode())
    text = text.replace('"header_crc32c":"00000000"', f'"header_crc32c":"{crc}"')
    open(dst, "wb").write(struct.pack("<Q", len(text)) + text.encode() + raw[8 + n:])


def test_a_version_2_file_of_save_checkpoint_still_loads():
    path = os.path.join(DATA, "legacy-python.safetensors")
    torch.manual_seed(11)  # the values must come from the file
    model, opt = tiermem.initialize(
        torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)), TINY)
    assert tiermem.load_checkpoint(model, opt, path) == {"epoch": 7}
    drawn = torch.rand(3)
    torch.manual_seed(5)  # the state the file holds
    assert torch.equal(drawn, torch.rand(3))
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (2e-3, (0.9, 0.999), 1e-8, 0.01)
    sd = safetensors.load_file(path)
    osd = opt.state_dict()["state"]
    for i, (n, v) in enumerate(model.state_dict().items()):
        assert torch.equal(v, sd[n]), n
        assert torch.equal(osd[i]["exp_avg_sq"], sd[f"exp_avg_sq/{n}"]), n
        assert int(osd[i]["step"]) == 2, n
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # and it trains on
    tiermem.runtime_of(model).close()


def test_a_version_2_file_of_the_libtorch_api_loads_here_too():
    """ChunkedModel::Save's earlier shape ({"param_groups": [...]}, no RNG state, no extra)
    loads into a torch Linear with the same names (weight, bias)."""
    model, opt = tiermem.initialize(torch.nn.Linear(3, 2), TINY)
    torch.manual_seed(4)
    assert tiermem.load_checkpoint(model, opt,
                                   os.path.join(DATA, "legacy-libtorch.safetensors")) is None
    drawn = torch.rand(2)
    torch.manual_seed(4)
    assert torch.equal(drawn, torch.rand(2))  # no RNG state saved: the generator is untouched
    assert opt.param_groups[0]["lr"] == 5e-4
    assert torch.equal(model.state_dict()["weight"], torch.arange(6.0).view(2, 3) / 8)
    tiermem.runtime_of(model).close()


def test_metadata_of_neither_earlier_shape_or_other_groups_is_refused_and_changes_nothing(
        tmp_path):
    src = os.path.join(DATA, "legacy-libtorch.safetensors")
    model, opt = tiermem.initialize(torch.nn.Linear(3, 2), TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = tmp_path / "bad.safetensors"
    _with_metadata(src, bad, lambda m: m.update(binding='{"groups": 1}'))
    with pytest.raises(ValueError,
                       match=re.escape(f"checkpoint {bad}: ") + ".*no optimizer param groups"):
        tiermem.load_checkpoint(model, opt, bad)
    v3 = tmp_path / "v3.safetensors"  # a version-3 file without its param_groups entry
    _with_metadata(src, v3, lambda m: m.update(version="3", rng_state="", extra="null"))
    with pytest.raises(ValueError, match="no 'param_groups' entry"):
        tiermem.load_checkpoint(model, opt, v3)
    two = tmp_path / "two.safetensors"
    _with_metadata(src, two, lambda m: m.update(binding=json.dumps(
        {"param_groups": 2 * [{"lr": 1, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0}]})))
    with pytest.raises(ValueError, match="2 optimizer param groups, the optimizer has 1: "
                                         "nothing was loaded"):
        tiermem.load_checkpoint(model, opt, two)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert opt.param_groups[0]["lr"] == 1e-3
    tiermem.runtime_of(model).close()
