"""Split parameters' compute copies (docs/host-mode.md "Chunk size and the host room"): below
the whole-tensor floor an embedding and a head larger than a chunk are pieces of rows, and a
unit computes with one contiguous copy of each. A copy autograd saves for the backward (a
Linear's weight, for its input's gradient) is packed as a reference to its pieces and
assembled again in the backward (saved.py ``_SplitRef``): no copy lives from the forward to the
backward, whether the tensor trains or is frozen, and the gradients equal plain torch's."""
import copy

import pytest
import torch
from torch import nn

import tiermem
from conftest import KernelAdamW

OPT = {"lr": 2e-3, "weight_decay": 0.01}
MiB = 1 << 20
VOCAB, HIDDEN = 32000, 64
SPLIT_BYTES = VOCAB * HIDDEN * 4  # each of the embedding and the head, fp32


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def cfg(tmp_path):
    return {"device_kind": "host", "host": 32 * MiB, "optimizer": OPT,
            "nvme": {"size": "256MiB", "path": str(tmp_path / "nvme")}}


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_saved_split_copies_are_pieces_between_forward_and_backward(tmp_path, frozen):
    torch.manual_seed(0)
    ref = Net()
    if frozen:  # a LoRA-like base: the embedding and the head do not train
        ref.embed.weight.requires_grad_(False)
        ref.head.weight.requires_grad_(False)
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(3)]
    ropt = KernelAdamW([p for p in ref.parameters() if p.requires_grad], **OPT)
    model, opt = tiermem.initialize(ours, cfg(tmp_path))
    rt = tiermem.runtime_of(model)
    assert {r.name for r in rt.params if r.split} == {"embed.weight", "head.weight"}
    for ids in data:
        ropt.zero_grad()
        ref_loss = ref(ids)
        ref_loss.backward()
        opt.zero_grad()
        loss = model(ids)
        # The forward is over: the head's weight is saved for the backward, as pieces.
        assert rt.stats()["split_copies"]["live_bytes"] == 0
        loss.backward()
        assert loss.item() == ref_loss.item()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), name
        ropt.step()
        opt.step()
        assert rt.stats()["split_copies"]["live_bytes"] == 0
    # One copy at a time: the forward's, or the backward's assembled again.
    assert rt.stats()["split_copies"]["peak_bytes"] == SPLIT_BYTES
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
