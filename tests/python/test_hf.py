"""Hugging Face models (random init from configs; nothing is downloaded): GPT-2 and Llama
training, generate() in the middle of training, and transformers.Trainer with clipping and
an LR schedule, against the same code on the plain model."""
import copy

import pytest
import torch

import tiermem
from conftest import KernelAdamW, assert_close_rel

transformers = pytest.importorskip("transformers")

VOCAB = 96


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=3,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def batches(steps, batch=4, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (64,), generator=g)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, 64 - seq, (batch,), generator=g)
        out.append(torch.stack([base[s:s + seq] for s in starts.tolist()]))
    return out


def data_bytes(m):
    return sum(p.numel() for p in m.parameters()) * 16


def budget(m, frac=0.3):
    largest = max(p.numel() for p in m.parameters())
    return max(int(data_bytes(m) * frac), 32 * largest)


def train(model, opt, data):
    losses = []
    for ids in data:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("frac", [0.3, 4.0], ids=["moving", "resident"])
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_hf_causal_lm_trains_exactly(make, frac):
    torch.manual_seed(0)
    ref = make()
    ours = copy.deepcopy(ref)
    data = batches(10)
    ref_losses = train(ref, KernelAdamW(ref.parameters(), lr=2e-3, weight_decay=0.01), data)
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": budget(ours, frac), "host": "256MiB",
                                           "optimizer": {"lr": 2e-3, "weight_decay": 0.01}})
    assert tiermem.runtime_of(model)._resident == (frac > 1)
    assert train(model, opt, data) == ref_losses
    assert ref_losses[-1] < ref_losses[0]
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_generate_equals_plain_and_does_not_disturb_training():
    torch.manual_seed(0)
    ref = gpt2()
    ours = copy.deepcopy(ref)
    data = batches(8)
    ropt = KernelAdamW(ref.parameters(), lr=2e-3, weight_decay=0.01)
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": budget(ours), "host": "256MiB",
                                           "optimizer": {"lr": 2e-3, "weight_decay": 0.01}})
    rt = tiermem.runtime_of(model)
    assert train(model, opt, data[:4]) == train(ref, ropt, data[:4])
    diverged = rt.stats()["diverged"]
    prompt = data[0][:2, :5]
    for m in (model, ref):
        m.eval()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    out, ref_out = model.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert torch.equal(out, ref_out)
    for m in (model, ref):
        m.train()
    assert train(model, opt, data[4:]) == train(ref, ropt, data[4:])
    # generate() ran the last step's deferred updates (docs/python.md "When the optimizer
    # runs"): the next training forward skips them in the recorded order, without diverging.
    assert rt.stats()["diverged"] == diverged
    assert rt.stats()["resynced"] > 0


class _Ids(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _trainer(model, optimizer, out_dir, rows):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=10, per_device_train_batch_size=4,
        max_grad_norm=0.5, learning_rate=2e-3, lr_scheduler_type="linear", warmup_steps=3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    sched = transformers.get_linear_schedule_with_warmup(optimizer, 3, 10)
    return transformers.Trainer(model=model, args=args, train_dataset=_Ids(rows),
                                optimizers=(optimizer, sched))


def test_trainer_with_clipping_and_lr_schedule_equals_plain_and_its_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    ref = gpt2()
    ours = copy.deepcopy(ref)
    rows = list(torch.cat(batches(10)))
    plain_tr = _trainer(ref, KernelAdamW(ref.parameters(), lr=2e-3, weight_decay=0.0),
                        tmp_path / "plain", rows)
    plain_tr.train()
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": budget(ours), "host": "256MiB",
                                           "optimizer": {"lr": 2e-3, "weight_decay": 0.0}})
    tr = _trainer(model, opt, tmp_path / "ours", rows)
    tr.train()
    get = lambda t, k: [h[k] for h in t.state.log_history if k in h]
    losses, ref_losses = get(tr, "loss"), get(plain_tr, "loss")
    assert len(losses) == 10
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, 1e-5, f"Trainer loss {i}")
    assert get(tr, "learning_rate") == get(plain_tr, "learning_rate")
    norms, ref_norms = get(tr, "grad_norm"), get(plain_tr, "grad_norm")
    assert norms and max(ref_norms) > 0.5, "clipping must be active for this test to bite"
    for a, b in zip(norms, ref_norms):
        assert_close_rel(a, b, 1e-5, "grad norm")
    # The saved checkpoint is an ordinary HF checkpoint: a plain model loads it.
    tr.save_model(str(tmp_path / "ckpt"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "ckpt"))
    ids = rows[0][None]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_hf_gradient_checkpointing_equals_plain(make, reentrant):
    # The user's own activation checkpointing (HF gradient_checkpointing_enable, both of
    # torch.utils.checkpoint's schemes) inside tiermem's units, activations counted in the
    # budget: the recomputed blocks re-enter their units inside the backward.
    torch.manual_seed(0)
    ref = make()
    ref.config.use_cache = False
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ref.train()
    ours = copy.deepcopy(ref)
    data = batches(5)
    want = train(ref, KernelAdamW(ref.parameters(), lr=2e-3, weight_decay=0.01), data)
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": budget(ours) + 2_000_000, "host": "256MiB",
                                           "activations": "budget",
                                           "optimizer": {"lr": 2e-3, "weight_decay": 0.01}})
    assert train(model, opt, data) == want
