"""Serving in host mode with NVMe keeps host room for the chunk groups the largest unit pins at
once (runtime/layout.h HostRoomFor, host_floor.h HostReserveChunks): the binding tells the
session each tensor's unit. Before, the room was kMinResidentChunks + kPrefetchedChunks = 6
chunks whatever the units: an fp32 Llama at the auto chunk size, whose decoder layer spans 7
chunk groups, failed its first forward with "host tier: ... nothing is evictable"."""
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


@pytest.mark.parametrize("host", [460_800, 640_000, 819_200])
def test_a_unit_of_seven_groups_serves_at_the_auto_chunk_size(host, tmp_path):
    ref = llama(width=128)  # q, k+v, o, gate, up, down, the norms: 7 groups of ~16 Ki elements
    model = serve(ref, host, tmp_path)
    rt = tiermem.runtime_of(model)
    assert max(len(u.groups) for u in rt.units) == 7  # more than the 6 chunks held before
    ids = prompts(2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    tiermem.close(model)


def test_serves_at_its_floor(tmp_path):
    ref = llama(width=128)
    floor = floor_of(ref, tmp_path)
    model = serve(ref, floor, tmp_path)
    ids = prompts(2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    tiermem.close(model)
    with pytest.raises(MemoryError, match="is below the minimum"):
        serve(ref, floor - 1, tmp_path)
