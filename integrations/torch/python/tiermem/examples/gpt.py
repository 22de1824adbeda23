"""A small GPT-style decoder (pre-norm, causal self-attention, GELU MLP, tied embeddings).

Ordinary nn.Modules only: tiermem manages it unmodified. Sizes are configurable; the defaults
of `GPTConfig` are the main job's (scripts/train.sh).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256      # bytes
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    tie_weights: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q = q.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.out = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        # GPT-2 initialisation (std 0.02), so the first loss is about ln(vocab_size).
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def synthetic_batches(c: GPTConfig, batch: int, steps: int, seed: int = 0):
    """Deterministic byte-level text batches: a repeated pseudo-random corpus (learnable)."""
    g = torch.Generator().manual_seed(seed)
    words = [bytes(torch.randint(97, 123, (int(n),), generator=g).tolist())
             for n in torch.randint(2, 8, (200,), generator=g)]
    order = torch.randint(0, len(words), (20000,), generator=g).tolist()
    corpus = torch.tensor(list(b" ".join(words[i] for i in order)), dtype=torch.long)
    for _ in range(steps):
        starts = torch.randint(0, corpus.numel() - c.block_size - 1, (batch,), generator=g)
        x = torch.stack([corpus[s:s + c.block_size] for s in starts.tolist()])
        y = torch.stack([corpus[s + 1:s + 1 + c.block_size] for s in starts.tolist()])
        yield x, y
