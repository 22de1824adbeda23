"""The serving minimum comes from the session, which reads each unit's chunk groups from the
tensors the binding names it (TensorSpec.units; runtime/layout.h UnitsOf):

- on a device, a budget below the largest unit's compute chunks is refused naming the bytes
  (Session::ServingMinimum), and that many bytes serve;
- in host mode with NVMe, the host keeps room for the most chunk groups one unit pins at once
  (host_floor.h HostReserveChunks). Before, the room was kMinResidentChunks +
  kPrefetchedChunks = 6 chunks whatever the units: an fp32 Llama at the auto chunk size, whose
  decoder layer spans 7 chunk groups, failed its first forward with "host tier: ... nothing
  is evictable", and the floor the refusal named did not serve.
"""
import copy
import re

import pytest
import torch

import tiermem
from test_inference import llama, prompts

transformers = pytest.importorskip("transformers")


def serve(ref, host, tmp_path):
    return tiermem.inference(copy.deepcopy(ref), {
        "device_kind": "host", "host": host,
        "nvme": {"size": "64MiB", "path": str(tmp_path / f"nvme-{host}")}})


def floor_of(ref, tmp_path) -> int:
    """The host floor the refusal names ("a host budget of X (N bytes) is enough")."""
    with pytest.raises(MemoryError) as e:
        serve(ref, 4096, tmp_path)
    return int(re.search(r"\((\d+) bytes\) is enough", str(e.value)).group(1))


def assert_serves_exactly(model, ref, **kwargs):
    ids = prompts(2)
    with torch.no_grad():
        want = ref(ids, **kwargs).logits
        for _ in range(2):  # the second forward reads what the first evicted
            torch.testing.assert_close(model(ids, **kwargs).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("host,split", [(460_800, True), (640_000, False), (819_200, False)])
def test_a_unit_of_seven_groups_serves_at_the_auto_chunk_size(host, split, tmp_path):
    ref = llama(width=128)
    model = serve(ref, host, tmp_path)
    rt = tiermem.runtime_of(model)
    # Whole tensors: a decoder layer pins 7 groups (q, k+v, o, gate, up, down, the norms), one
    # more than the 6 chunks of room held before. At 460,800 bytes the 9 chunks of room it
    # needs now do not fit whole: tensors larger than a chunk are split (pinned one piece at a
    # time), where before the layout kept them whole and the first forward failed.
    assert any(r.split for r in rt.params) == split
    if not split:
        assert max(len(u.pin_groups) for u in rt.units) == 7
    assert_serves_exactly(model, ref)
    tiermem.close(model)


def test_serves_at_its_host_floor_and_not_a_byte_below(tmp_path):
    ref = llama(width=128)
    floor = floor_of(ref, tmp_path)
    model = serve(ref, floor, tmp_path)
    # The floor is the weights' (a KV cache takes host_reserve: docs/host-mode.md).
    assert_serves_exactly(model, ref, use_cache=False)
    tiermem.close(model)
    with pytest.raises(MemoryError, match=rf"host budget of .* \({floor - 1} bytes\) is below "
                                          rf"the minimum of .*\({floor} bytes\) is enough"):
        serve(ref, floor - 1, tmp_path)


def serve_on_device(ref, device):
    return tiermem.inference(copy.deepcopy(ref), {
        "device_kind": "sim", "device": device, "host": "64MiB", "chunk_size": 16384})


def test_the_device_minimum_is_the_sessions_and_serves(tmp_path):
    ref = llama(width=128)
    # At 16,384 elements a chunk, a decoder layer is 7 groups (q, k+v, o, gate, up, down, the
    # norms) of 64 KiB fp32 compute chunks: the largest unit.
    need = 7 * 16384 * 4
    model = serve_on_device(ref, need)
    rt = tiermem.runtime_of(model)
    assert rt.session.serving_minimum.bytes == need
    assert rt.units[rt.session.serving_minimum.unit].name == "model.layers.0"
    # The minimum is the weights' (docs/inference.md: the KV cache comes on top of it).
    assert_serves_exactly(model, ref, use_cache=False)
    tiermem.close(model)
    with pytest.raises(MemoryError, match=rf"below the {need} bytes the chunks of unit "
                                          rf"'model.layers.0' need at once"):
        serve_on_device(ref, need - 1)


class _Tied(torch.nn.Module):
    """Unit 1 computes with unit 0's weight (tied) and four of its own, 128 x 128 each."""

    def __init__(self):
        super().__init__()
        first = torch.nn.Linear(128, 128, bias=False)
        tied = torch.nn.Linear(128, 128, bias=False)
        tied.weight = first.weight
        second = torch.nn.Sequential(tied, *(torch.nn.Linear(128, 128, bias=False)
                                             for _ in range(4)))
        self.layers = torch.nn.ModuleList([first, second])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def test_a_tied_weight_counts_in_every_unit_that_computes_with_it():
    torch.manual_seed(0)
    ref = _Tied()
    # 16,384 elements a chunk: one group per weight; unit 1 pins its 4 and the tied one.
    need = 5 * 16384 * 4
    model = serve_on_device(ref, need)
    assert tiermem.runtime_of(model).session.serving_minimum.bytes == need
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    tiermem.close(model)
    with pytest.raises(MemoryError, match=rf"below the {need} bytes the chunks of unit "
                                          "'layers.1' need at once"):
        serve_on_device(ref, need - 1)
