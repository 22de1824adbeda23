"""Mixture-of-experts models (docs/moe.md): tensors larger than a chunk, experts that move alone.

Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 and GPT-OSS (transformers 5.x: fused 3-D experts run
through the experts-implementation hook) and a model whose experts are an ``nn.ModuleList``
train exactly like plain torch — losses and parameters bit-equal to the same AdamW math
(KernelAdamW), within 1e-5 of torch.optim.AdamW — at a device budget below what a chunk
holding a whole fused tensor needs (the budget that refuses them without splitting), serve
``generate()`` tokens equal to the plain model's, and move only the experts the router picks.
Small sizes, CPU, SimDevice.
"""
import copy
import re

import pytest
import torch
from torch import nn

import tiermem
from conftest import KernelAdamW, assert_close_rel

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 12
LOSS_REL = 1e-5


def qwen3_moe(layers=2, experts=8, top_k=2, impl=None):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=None, pad_token_id=0)
    if impl is not None:
        cfg._experts_implementation = impl
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


def mixtral(layers=2, experts=4, top_k=2):
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def olmoe(layers=2, experts=8, top_k=2):
    cfg = transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.OlmoeForCausalLM(cfg)


def deepseek_v3(layers=2, experts=8, top_k=2):
    """Multi-head latent attention, a shared expert beside the routed ones, a sigmoid router
    with a bias correction."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1,
        first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg)


def gpt_oss(layers=2, experts=8, top_k=2):
    """Transposed fused experts ([E, H, 2I]) with biases and a clamped gate; attention sinks."""
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(cfg)


FUSED = [qwen3_moe, mixtral, olmoe, deepseek_v3, gpt_oss]
FUSED_IDS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]


class ExpertMLP(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)))


class ListMoE(nn.Module):
    """Top-k routing over an ``nn.ModuleList`` of experts, each called for its tokens only.
    The router never picks expert `dead` (its logit is pushed down): that expert has no
    gradient (``p.grad`` None) and AdamW leaves it, as in torch."""

    def __init__(self, width, hidden, experts, top_k, dead):
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(width, hidden) for _ in range(experts))
        self.top_k, self.dead = top_k, dead

    def forward(self, x):
        b, t, w = x.shape
        h = x.reshape(-1, w)
        logits = self.router(h)
        if self.dead is not None:
            logits = logits.index_fill(1, torch.tensor([self.dead]), -1e4)
        probs = torch.softmax(logits, dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        out = torch.zeros_like(h)
        for e in torch.unique(top_i).tolist():
            tok, k = torch.where(top_i == e)
            out = out.index_add(0, tok, self.experts[e](h[tok]) * top_w[tok, k, None])
        return out.reshape(b, t, w)


class ListBlock(nn.Module):
    def __init__(self, width, experts, top_k, dead):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.Linear(width, width)
        self.moe = ListMoE(width, 48, experts, top_k, dead)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.moe(self.norm(x))


class ListLM(nn.Module):
    def __init__(self, layers=2, width=32, experts=6, top_k=2, dead=5):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(ListBlock(width, experts, top_k, dead) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def data(steps, batch=4, seed=1, vary=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append((x, (x + 1) % VOCAB))
    return out


def logits_of(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def train(model, opt, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        logits = logits_of(model, x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def largest(model):
    return max(p.numel() for p in model.parameters())


def refused_budget(model):
    """Below this device budget a layout whose chunks hold whole tensors is refused: four
    chunks holding the largest tensor, params and grads in fp32."""
    return 4 * 8 * largest(model)


def train_three(make, steps=6, frac=0.5, experts=True, **cfg):
    torch.manual_seed(0)
    ref = make()
    exact, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    batches = data(steps)
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01),
                       batches)
    exact_losses = train(exact, KernelAdamW(exact.parameters(), lr=3e-3, weight_decay=0.01),
                         batches)
    budget = int(frac * refused_budget(ours))
    config = {"device_kind": "sim", "device": budget, "host": "256MiB",
              "optimizer": {"lr": 3e-3, "weight_decay": 0.01}}
    config.update(cfg)
    model, opt = tiermem.initialize(ours, config, experts=experts)
    losses = train(model, opt, batches)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, LOSS_REL, f"loss at step {i} vs torch.optim.AdamW")
    assert losses == exact_losses, "losses must equal the same AdamW math on plain torch"
    sd, exact_sd = model.state_dict(), exact.state_dict()
    for k in exact_sd:
        torch.testing.assert_close(sd[k], exact_sd[k], rtol=0, atol=0, msg=k)
    rt = tiermem.runtime_of(model)
    assert not rt.timeline_peaks()["over_budget"]
    return model, opt, rt, exact


@pytest.mark.parametrize("make", FUSED, ids=FUSED_IDS)
def test_fused_experts_train_exactly_below_the_budget_that_refuses_whole_tensors(make):
    model, opt, rt, exact = train_three(make)
    assert rt.expert_sets and all(s.kind == "fused" for s in rt.expert_sets)
    assert model.config._experts_implementation == "tiermem"
    # The experts computed through tiermem's implementation, one call per routed expert.
    s = rt.experts.stats
    per_forward = sum(len(es.groups) for es in rt.expert_sets)  # every expert of every layer
    assert 0 < s["expert_calls"] <= 6 * per_forward
    # p.grad of a fused tensor is the whole tensor, as torch's.
    for (n, p), (_, q) in zip(model.named_parameters(), exact.named_parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    rt.close()
    assert model.config._experts_implementation == "grouped_mm"


def test_eager_experts_train_exactly():
    model, opt, rt, exact = train_three(lambda: qwen3_moe(impl="eager"), steps=4)
    assert rt.expert_sets[0].impl == "eager"


def test_module_list_experts_train_exactly_and_an_unrouted_expert_has_no_grad():
    model, opt, rt, exact = train_three(ListLM)
    assert rt.expert_sets and all(s.kind == "list" for s in rt.expert_sets)
    dead = model.blocks[0].moe.experts[5]
    assert dead.w1.weight.grad is None and exact.blocks[0].moe.experts[5].w1.weight.grad is None
    live = model.blocks[0].moe.experts[0]
    torch.testing.assert_close(live.w1.weight.grad, exact.blocks[0].moe.experts[0].w1.weight.grad,
                               rtol=0, atol=0)
    assert rt.experts.routed.get((0, 5), 0) == 0
    assert rt.experts.routed.get((0, 0), 0) > 0


def _never_seven(module, args, out):
    """A router hook: tokens routed to expert 7 go to expert 0 instead."""
    logits, scores, idx = out
    return logits, scores, torch.where(idx == 7, torch.zeros_like(idx), idx)


def test_a_fused_expert_no_token_reaches_has_zero_grad_and_adamw_steps_it_as_torch():
    """Expert 7 of every layer is never routed (a router hook sends its tokens elsewhere): torch gives
    the fused tensor a gradient with zero rows there, and AdamW still decays those rows."""
    def make():
        m = qwen3_moe(experts=8)
        for layer in m.model.layers:
            layer.mlp.gate.register_forward_hook(_never_seven)
        return m
    torch.manual_seed(0)
    before = make().model.layers[0].mlp.experts.gate_up_proj[7].detach().clone()
    model, opt, rt, exact = train_three(make, steps=3)
    after = model.model.layers[0].mlp.experts.gate_up_proj[7]
    assert not torch.equal(after, before)  # weight decay and momentum moved it, as in torch
    for layer, ref in zip(model.model.layers, exact.model.layers):
        g = layer.mlp.experts.gate_up_proj.grad
        assert torch.count_nonzero(g[7]) == 0
        assert torch.count_nonzero(g[:7]) > 0
        torch.testing.assert_close(g, ref.mlp.experts.gate_up_proj.grad, rtol=0, atol=0)
    assert all(rt.experts.routed.get((s.index, 7), 0) == 0 for s in rt.expert_sets)


def test_routing_that_changes_every_step_with_accumulation_and_clipping():
    """Two micro-batches per step with different routings (gradients of a fused tensor added
    piece by piece across them), clipped: exact."""
    torch.manual_seed(0)
    ref = qwen3_moe(experts=8)
    ours = copy.deepcopy(ref)
    batches = data(6, seed=7)
    ropt = KernelAdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    model, opt = tiermem.initialize(ours, {
        "device_kind": "sim", "device": refused_budget(ref) // 2, "host": "256MiB",
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01}})

    def run(m, o, plain):
        losses = []
        for i, (x, y) in enumerate(batches):
            logits = logits_of(m, x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / 2
            loss.backward()
            losses.append(loss.item())
            if not plain:  # tiermem counts micro-steps: step() applies every 2nd
                o.step()
                o.zero_grad()
            elif i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                o.step()
                o.zero_grad()
        return losses
    ref_l = run(ref, ropt, True)
    our_l = run(model, opt, False)
    assert our_l == ref_l
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0, msg=k)


def test_fused_experts_in_bf16_equal_experts_trained_as_any_weights():
    """bf16 compute copies, fp32 masters: experts moved alone (each computed on its own)
    train bit for bit like the same model with experts=False (grouped_mm / eager over the
    whole fused tensors, at a budget that holds them whole)."""
    for impl in (None, "eager"):
        ref = qwen3_moe(impl=impl)
        a, b = copy.deepcopy(ref), copy.deepcopy(ref)
        batches = data(4)

        def cfg(device):
            return {"device_kind": "sim", "device": device, "host": "256MiB",
                    "precision": "bf16", "optimizer": {"lr": 3e-3, "weight_decay": 0.01}}
        ma, oa = tiermem.initialize(a, cfg(refused_budget(ref) // 2))
        mb, ob = tiermem.initialize(b, cfg(4 * refused_budget(ref)), experts=False)
        assert tiermem.runtime_of(ma).expert_sets and not tiermem.runtime_of(mb).expert_sets
        assert train(ma, oa, batches) == train(mb, ob, batches)
        sa, sb = ma.state_dict(), mb.state_dict()
        for k, v in sb.items():
            torch.testing.assert_close(sa[k], v, rtol=0, atol=0, msg=k)
        for m in (ma, mb):
            tiermem.runtime_of(m).close()
            # Closed: plain fp32 parameters (the masters) with their gradients in fp32.
            p = m.model.layers[0].mlp.experts.gate_up_proj
            assert type(p) is nn.Parameter and p.dtype == p.grad.dtype == torch.float32


def test_experts_as_weights_below_the_whole_tensor_budget_are_split_and_exact():
    """experts=False below the budget that refuses whole tensors: the fused tensors are split
    into pieces of whole rows, their unit computes with a contiguous copy, and training (fp32)
    and generate() equal plain torch."""
    model, opt, rt, exact = train_three(qwen3_moe, steps=4, experts=False)
    assert not rt.expert_sets
    split = [r.name for r in rt.params if r.split]
    assert "model.layers.0.mlp.experts.gate_up_proj" in split
    rt.close()
    ref = qwen3_moe(layers=3, experts=16).eval()
    ours = copy.deepcopy(ref)
    weights = sum(p.numel() for p in ref.parameters()) * 4
    served = tiermem.inference(ours, {"device_kind": "sim", "device": weights // 2,
                                      "host": "256MiB"}, experts=False)
    assert weights // 2 < 4 * 4 * largest(ref)
    assert any(r.split for r in tiermem.runtime_of(served).params)
    x = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    assert torch.equal(served.generate(x, max_new_tokens=6, do_sample=False),
                       ref.generate(x, max_new_tokens=6, do_sample=False))


def test_fused_experts_in_host_mode_with_nvme(tmp_path):
    torch.manual_seed(0)
    ref = qwen3_moe()
    ours = copy.deepcopy(ref)
    batches = data(3)
    exact = train(ref, KernelAdamW(ref.parameters(), lr=3e-3, weight_decay=0.01), batches)
    total = sum(p.numel() for p in ours.parameters()) * 16
    model, opt = tiermem.initialize(ours, {
        "device_kind": "host", "host": total // 2,
        "nvme": {"path": str(tmp_path), "size": "64MiB"},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01}})
    assert train(model, opt, batches) == exact
    rt = tiermem.runtime_of(model)
    assert rt.session.host_compute and rt.expert_sets


def test_checkpoint_and_state_dict_see_whole_fused_tensors(tmp_path):
    model, opt, rt, exact = train_three(qwen3_moe, steps=2)
    sd = model.state_dict()
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    path = tmp_path / "ck.safetensors"
    tiermem.save_checkpoint(model, opt, path)
    fresh = qwen3_moe()
    m2, o2 = tiermem.initialize(fresh, {"device_kind": "sim", "device": "16MiB",
                                        "host": "256MiB"}, experts=False)
    assert not tiermem.runtime_of(m2).expert_sets
    tiermem.load_checkpoint(m2, o2, path)
    for k, v in sd.items():
        torch.testing.assert_close(m2.state_dict()[k], v, rtol=0, atol=0, msg=k)
    # A read and an in-place write of a fused parameter outside its unit see the whole tensor.
    p = model.model.layers[1].mlp.experts.down_proj
    with torch.no_grad():
        p[3].mul_(2.0)
    torch.testing.assert_close(model.state_dict()["model.layers.1.mlp.experts.down_proj"][3],
                               sd["model.layers.1.mlp.experts.down_proj"][3] * 2)


def test_serving_moves_only_routed_experts_and_generates_the_plain_tokens():
    ref = qwen3_moe(layers=3, experts=16).eval()
    ours = copy.deepcopy(ref)
    weights = sum(p.numel() for p in ref.parameters()) * 4
    budget = weights // 4
    assert budget < 4 * 4 * largest(ref)  # refused when chunks hold whole tensors
    model = tiermem.inference(ours, {"device_kind": "sim", "device": budget, "host": "256MiB"})
    x = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    want = ref.generate(x, max_new_tokens=8, do_sample=False)
    got = model.generate(x, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    rt = tiermem.runtime_of(model)
    # Far fewer expert computations than every expert of every layer per forward.
    forwards = rt.forwards
    assert rt.experts.stats["expert_calls"] < 16 * 3 * forwards
    assert not rt.timeline_peaks()["over_budget"]
    rt.close()
    assert ours.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("make", [mixtral, olmoe, deepseek_v3, gpt_oss],
                         ids=["mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
def test_other_fused_models_serve_the_plain_tokens_moving_only_routed_experts(make):
    ref = make(experts=16).eval()
    ours = copy.deepcopy(ref)
    weights = sum(p.numel() for p in ref.parameters()) * 4
    assert weights // 2 < 4 * 4 * largest(ref)  # refused when chunks hold whole tensors
    model = tiermem.inference(ours, {"device_kind": "sim", "device": weights // 2,
                                     "host": "256MiB"})
    rt = tiermem.runtime_of(model)
    assert len(rt.expert_sets) == 2 and all(s.router is not None for s in rt.expert_sets)
    x = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model.generate(x, max_new_tokens=6, do_sample=False),
                       ref.generate(x, max_new_tokens=6, do_sample=False))
    assert rt.experts.stats["expert_calls"] < 16 * 2 * rt.forwards
    rt.close()


def test_a_module_list_model_serves_the_plain_outputs():
    ref = ListLM(layers=3).eval()
    ours = copy.deepcopy(ref)
    weights = sum(p.numel() for p in ref.parameters()) * 4
    model = tiermem.inference(ours, {"device_kind": "sim", "device": weights // 3,
                                     "host": "256MiB"})
    rt = tiermem.runtime_of(model)
    assert rt.expert_sets and all(s.kind == "list" for s in rt.expert_sets)
    for seed in range(3):
        x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    assert rt.experts.routed.get((0, 5), 0) == 0  # never called, so never acquired
    assert not rt.timeline_peaks()["over_budget"]
    rt.close()


def test_a_budget_below_one_expert_names_the_piece():
    model = qwen3_moe()
    params = list(model.parameters())
    with pytest.raises(MemoryError, match=r"largest piece a unit needs at once"):
        tiermem.initialize(model, {"device_kind": "sim", "device": 2000})
    assert list(model.parameters()) == params and not hasattr(model, "_tiermem_runtime")
    assert model.config._experts_implementation == "grouped_mm"


def test_a_training_forward_of_experts_outside_their_unit_is_refused():
    model, opt = tiermem.initialize(qwen3_moe(), {"device_kind": "sim", "device": "4MiB"})
    ex = model.model.layers[0].mlp.experts
    h = torch.randn(5, 64)
    idx = torch.randint(0, 8, (5, 2))
    with pytest.raises(RuntimeError, match="outside the forward of their unit"):
        ex(h, idx, torch.rand(5, 2))
    with torch.no_grad():
        out = ex(h, idx, torch.rand(5, 2))  # serving-like call outside: fine, no grads
    assert out.shape == (5, 64)


def test_serving_beyond_ram_homes_experts_on_nvme_and_caches_them_on_the_host(tmp_path):
    """Host mode with a host budget of half the weights: the dense chunks are homed on the
    host, the experts on NVMe, cached on the host by use; tokens equal the plain model's."""
    ref = qwen3_moe(layers=3, experts=16).eval()
    ours = copy.deepcopy(ref)
    weights = sum(p.numel() for p in ref.parameters()) * 4
    model = tiermem.inference(ours, {"device_kind": "host", "host": weights // 2,
                                     "nvme": {"path": str(tmp_path), "size": "64MiB"}})
    x = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model.generate(x, max_new_tokens=6, do_sample=False),
                       ref.generate(x, max_new_tokens=6, do_sample=False))
    rt = tiermem.runtime_of(model)
    s = rt.session
    experts = {g for es in rt.expert_sets for gs in es.groups for g in gs}
    k = rt._compute_kind
    homes = {g: s.home(g, k) for g in range(s.num_groups)}
    assert all(h == tiermem._C.Tier.host for g, h in homes.items() if g not in experts)
    assert any(h == tiermem._C.Tier.nvme for g, h in homes.items() if g in experts)
    st = rt.stats()
    assert st["bytes_moved"].get("nvme->host", 0) > 0
    assert st["bytes_moved"].get("host->nvme", 0) == 0  # weights are never written


def test_a_gradient_hook_on_a_fused_experts_parameter_is_refused():
    """A fused tensor's gradient is accumulated expert by expert from per-expert leaves: a hook
    would never run, so registering one is refused (nothing changed); experts=False runs it."""
    model, opt = tiermem.initialize(qwen3_moe(), {"device_kind": "sim", "device": "4MiB"})
    p = model.model.layers[0].mlp.experts.gate_up_proj
    for register in (p.register_hook, p.register_post_accumulate_grad_hook):
        with pytest.raises(RuntimeError, match="not supported: its experts move alone"):
            register(lambda *a: None)
    # A dense parameter of the same model still takes hooks.
    seen = []
    model.model.layers[0].mlp.gate.weight.register_hook(lambda g: seen.append(g.shape))
    x, y = data(1)[0]
    logits = logits_of(model, x)
    nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
    assert seen == [torch.Size([8, 64])]
    tiermem.runtime_of(model).close()
    m2, _ = tiermem.initialize(qwen3_moe(), {"device_kind": "sim", "device": "4MiB"},
                               experts=False)
    q = m2.model.layers[0].mlp.experts.gate_up_proj
    got = []
    q.register_hook(lambda g: got.append(g.shape))
    logits = logits_of(m2, x)
    nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
    assert got == [q.shape]


def test_int8_state_compresses_whole_dense_tensors_and_experts_keep_fp32(capfd):
    """optimizer.state_dtype int8 with experts that move alone: the dense tensors that stay
    whole take int8 m and v, the experts (and any split tensor) keep fp32 state, warned once;
    training equals the same AdamW math with that split of formats, bit for bit."""
    torch.manual_seed(0)
    ref = qwen3_moe()
    ours = copy.deepcopy(ref)
    min_elems = 1024
    budget = int(0.5 * refused_budget(ours))
    model, opt = tiermem.initialize(ours, {
        "device_kind": "sim", "device": budget, "host": "256MiB",
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "state_dtype": "int8",
                      "state_min_elems": min_elems}})
    assert "keep fp32 optimizer state" in capfd.readouterr().err
    rt = tiermem.runtime_of(model)
    fp32_names = {r.name for r in rt.params if r.expert_set >= 0 or r.split}
    assert any(r.expert_set >= 0 for r in rt.params)
    by_name = dict(ref.named_parameters())
    int8 = [p for n, p in by_name.items() if n not in fp32_names and p.numel() >= min_elems]
    assert int8, "some dense tensor must take the int8 format"
    rest = [p for n, p in by_name.items() if n in fp32_names or p.numel() < min_elems]
    ref_opts = [KernelAdamW(int8, lr=3e-3, weight_decay=0.01, state_dtype="int8",
                            min_elems=min_elems),
                KernelAdamW(rest, lr=3e-3, weight_decay=0.01)]

    class Both:
        def zero_grad(self):
            for o in ref_opts:
                o.zero_grad()

        def step(self):
            for o in ref_opts:
                o.step()

    batches = data(5)
    assert train(model, opt, batches) == train(ref, Both(), batches)
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0, msg=k)
