"""Serving straight from the checkpoint (docs/inference.md, "Serving in place";
runtime/weights.h): ``tiermem.inference(model, config, weights=DIR)`` with the weights homed on
NVMe reads each NVMe-homed compute chunk from the checkpoint's own files — no copy written, a
load that reads nothing for it — and generates the same tokens as the copied load
(``in_place: off``) and as the plain model, for GPT-2 and Llama, from fp32 and bf16
checkpoints, in host mode and on SimDevice. The file is never written; a file modified or
truncated under a serving session is a clear error; anything that would write an in-place
home (a training load with ``in_place: on``, ``load_state_dict`` into the served model) is
refused."""
import copy
import hashlib
import os

import pytest
import torch

import tiermem

transformers = pytest.importorskip("transformers")

import test_inference  # noqa: E402
from test_inference import VOCAB  # noqa: E402


def gpt2(layers=8):
    return test_inference.gpt2(layers, width=128)


def llama(layers=8):
    return test_inference.llama(layers, width=128)


def weight_bytes(m):
    return sum(p.numel() * p.element_size() for p in m.parameters())


def prompts(batch=2, seq=7, seed=3):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, n=8):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, pad_token_id=0)


def checkpoint(make, dtype, tmp_path):
    """The plain model with `dtype` parameters (its buffers as they are, as tiermem keeps them)
    and its checkpoint directory (transformers' own writer)."""
    ref = make()
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    d = tmp_path / f"ckpt-{make.__name__}-{str(dtype)[6:]}"
    ref.save_pretrained(d, safe_serialization=True)
    return ref, d


def cfg(tmp_path, device, dtype, wb, in_place="auto", **kw):
    """Host budget below the compute weights' `wb` bytes (NVMe homes in the loop)."""
    c = {"device_kind": device, "host": int(wb * 0.8), "in_place": in_place,
         "precision": "bf16" if dtype == torch.bfloat16 else "fp32",
         "nvme": {"size": "32MiB", "path": str(tmp_path / "nvme")}}
    if device == "sim":
        c["device"] = int(wb * 0.6)
    c.update(kw)
    return c


def file_state(d):
    f = d / "model.safetensors"
    return f.stat().st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest()


def on_meta(make):
    with torch.device("meta"):
        return make()


@pytest.mark.parametrize("device", ["host", "sim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("make", [gpt2, llama])
def test_tokens_equal_the_copied_load_and_plain_torch(make, dtype, device, tmp_path):
    ref, d = checkpoint(make, dtype, tmp_path)
    wb = weight_bytes(ref)
    before = file_state(d)
    ids = prompts()
    (tmp_path / "nvme").mkdir()
    # (This Llama in host mode with the automatic chunk size runs out of host room for its
    # units, copied or in place alike: a chunk size is given.)
    kw = {"chunk_size": 32768} if make is llama else {}
    model = tiermem.inference(make(), cfg(tmp_path, device, dtype, wb, **kw), weights=d)
    rt = tiermem.runtime_of(model)
    report = rt._weights.report
    assert report["chunks_in_place"] > 0, report
    st = rt.stats()
    if dtype == torch.float32:
        # fp32 in place: the load wrote nothing to NVMe.
        assert st["bytes_moved"].get("host->nvme", 0) == 0, st["bytes_moved"]
    got = generate(model, ids)
    with torch.no_grad():
        logits = model(ids).logits
    copied = rt.timeline_peaks()["copied"]
    assert sum(v for k, v in copied.items() if k.startswith("nvme->")) > 0, copied
    if dtype == torch.float32:
        assert not any(k.endswith("->nvme") for k in copied), copied  # nothing ever written
    rt.close()
    # The copied load (in_place: off): the same tokens, the same logits bit for bit.
    model2 = tiermem.inference(make(), cfg(tmp_path, device, dtype, wb, "off", **kw), weights=d)
    rt2 = tiermem.runtime_of(model2)
    assert rt2._weights.report["chunks_in_place"] == 0
    assert torch.equal(generate(model2, ids), got)
    with torch.no_grad():
        assert torch.equal(model2(ids).logits, logits)
    rt2.close()
    # Plain torch, the same tokens and logits: in bf16 too (Llama's rotary frequencies stay
    # fp32, as transformers' own bf16 model keeps them; they were once rounded to bf16).
    assert torch.equal(got, generate(ref, ids))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, logits)
    assert file_state(d) == before  # the checkpoint was never written


def test_a_meta_model_served_in_place_reads_no_bytes_for_nvme_homes(tmp_path):
    ref, d = checkpoint(gpt2, torch.float32, tmp_path)
    wb = weight_bytes(ref)
    (tmp_path / "nvme").mkdir()
    model = tiermem.inference(on_meta(gpt2), cfg(tmp_path, "host", torch.float32, wb,
                                                  in_place="on"), weights=d)
    rt = tiermem.runtime_of(model)
    report = rt._weights.report
    # The NVMe-homed chunks are the file's: nothing written to NVMe, nothing read back.
    assert report["bytes_in_place"] > wb // 3
    assert rt.stats()["bytes_moved"].get("host->nvme", 0) == 0
    ids = prompts()
    assert torch.equal(generate(model, ids), generate(ref, ids))
    rt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_nvme_room_is_held_for_what_is_read_in_place(tmp_path, dtype):
    """The session holds no NVMe room for the chunks it reads from the checkpoint
    (TensorSpec.read_in_place): an NVMe tier far smaller than the NVMe-homed weights serves
    them, and nothing of the tier is used (a model larger than the disk's free room beside its
    checkpoint is served from it). Copied (``in_place: off``), the same tier is refused."""
    ref, d = checkpoint(gpt2, dtype, tmp_path)
    wb = weight_bytes(ref)
    (tmp_path / "nvme").mkdir()
    small = {"size": "64KiB", "path": str(tmp_path / "nvme")}
    model = tiermem.inference(on_meta(gpt2), cfg(tmp_path, "host", dtype, wb, nvme=small),
                              weights=d)
    rt = tiermem.runtime_of(model)
    assert rt._weights.report["bytes_in_place"] > 4 * 64 * 1024, rt._weights.report
    assert rt.stats()["tiers"]["nvme"]["used"] == 0, rt.stats()["tiers"]["nvme"]
    ids = prompts()
    assert torch.equal(generate(model, ids), generate(ref, ids))
    rt.close()
    with pytest.raises(MemoryError, match="nvme tier: need"):
        tiermem.inference(on_meta(gpt2), cfg(tmp_path, "host", dtype, wb, "off", nvme=small),
                          weights=d)


def serve_then(tmp_path, change):
    ref, d = checkpoint(gpt2, torch.float32, tmp_path)
    wb = weight_bytes(ref)
    (tmp_path / "nvme").mkdir()
    model = tiermem.inference(copy.deepcopy(ref), cfg(tmp_path, "host", torch.float32, wb),
                              weights=d)
    rt = tiermem.runtime_of(model)
    assert rt._weights.report["chunks_in_place"] > 0
    ids = prompts()
    assert torch.equal(generate(model, ids, 3), generate(ref, ids, 3))
    change(d / "model.safetensors")
    return model, rt, ids


def test_a_file_modified_under_serving_is_a_clear_error(tmp_path):
    def modify(f):
        with open(f, "r+b") as fh:  # a byte in the middle of the tensors, new mtime
            fh.seek(f.stat().st_size // 2)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0xFF]))
    model, rt, ids = serve_then(tmp_path, modify)
    with pytest.raises(OSError, match=r"model\.safetensors, read in place, was modified"):
        generate(model, ids, 3)
    with pytest.raises(OSError, match=r"was modified"):  # its values are gone
        rt.close()
    rt.close(keep_values=False)


def test_a_file_truncated_under_serving_is_a_clear_error(tmp_path):
    model, rt, ids = serve_then(tmp_path, lambda f: os.truncate(f, f.stat().st_size - 4096))
    with pytest.raises(OSError, match=r"read in place, changed size"):
        generate(model, ids, 3)
    rt.close(keep_values=False)


def test_writing_an_in_place_home_is_refused(tmp_path):
    ref, d = checkpoint(gpt2, torch.float32, tmp_path)
    wb = weight_bytes(ref)
    (tmp_path / "nvme").mkdir()
    before = file_state(d)
    # A training load never reads in place: in_place 'on' is refused, nothing changes.
    with pytest.raises(ValueError, match=r"in_place 'on' reads a served checkpoint in place, "
                                         r"but this session trains"):
        tiermem.initialize(on_meta(gpt2), cfg(tmp_path, "host", torch.float32, wb, "on"),
                           weights=d)
    model = tiermem.inference(copy.deepcopy(ref), cfg(tmp_path, "host", torch.float32, wb),
                              weights=d)
    rt = tiermem.runtime_of(model)
    assert rt._weights.report["chunks_in_place"] > 0
    sd = {k: torch.zeros_like(v) for k, v in ref.state_dict().items()}
    with pytest.raises(Exception, match=r"read in place \(read-only"):
        model.load_state_dict(sd)
    ids = prompts()
    rt.close()
    assert file_state(d) == before


def test_in_place_on_names_a_chunk_that_cannot_be(tmp_path):
    # A bf16 checkpoint served in fp32: the dtypes differ, so 'on' is an error naming why,
    # and 'auto' copies (converting) with the same tokens as plain fp32 torch.
    ref, d = checkpoint(gpt2, torch.bfloat16, tmp_path)
    wb = weight_bytes(ref) * 2
    (tmp_path / "nvme").mkdir()
    with pytest.raises(ValueError, match=r"in_place 'on'.*is bf16, the compute dtype f32"):
        tiermem.inference(on_meta(gpt2), cfg(tmp_path, "host", torch.float32, wb, "on"),
                          weights=d)
    model = tiermem.inference(on_meta(gpt2), cfg(tmp_path, "host", torch.float32, wb),
                              weights=d)
    rt = tiermem.runtime_of(model)
    assert rt._weights.report["chunks_in_place"] == 0
    ids = prompts()
    plain = gpt2()  # fp32, holding the file's bf16 values
    for p, q in zip(plain.parameters(), ref.parameters()):
        p.data = q.data.float()
    assert torch.equal(generate(model, ids), generate(plain, ids))
    rt.close()
