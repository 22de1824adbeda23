"""One unit protocol, two bindings (runtime/unit_protocol.h): the warm-up trace the LibTorch API
records equals the one the Python package records for the same model — the same moments in
the same order, each with the same label, kind and unit, and the same chunk accesses.

The model is the example's gpt.h (integrations/torch/examples/train_gpt.cc, run with
--record-trace) and its Python mirror `MirrorGPT` (test_checkpoint_cross_binding.py: the same
modules, parameter order and units), both on a SimDevice holding half of the training state,
so chunks move every iteration. Both record every iteration of the run.

Accesses are compared as the set of (chunk, mode, tier) of each moment: LibTorch adds a unit's
gradients one parameter at a time, Python a group at a time. They are equal at every
pre-forward and optimizer moment. The backward differs by mechanism, not by protocol, and is
compared as such: LibTorch recomputes each unit in its backward, so its pre-backward moment
re-acquires every chunk of the unit, and it adds each unit's share of the tied embedding's
gradient in that unit's moment; Python acquires only the chunks its saved views need, and
autograd sums the tied gradient before it lands (at the embedding's moment). So each Python
pre-backward touches a subset of the chunks of LibTorch's, and the whole backward the same
chunks. Not compared: the timings and the saved-activation bytes (LibTorch saves nothing the
trace counts).
"""
import os
import subprocess

import torch

import tiermem
from tiermem import _C
from test_checkpoint_cross_binding import (CPP_FLAGS, FRACTION, LR, SEED, STEPS, WD, MirrorGPT,
                                           data, gpt_units, n_params, train_gpt_binary)
from torch.nn import functional as F



def cpp_trace(tmp):
    path = tmp / "cpp.tmtrace"
    cmd = [str(train_gpt_binary()), "--steps", str(STEPS), "--timeline", str(tmp / "cpp.tmt"),
           *map(str, CPP_FLAGS), "--record-trace", str(path)]
    env = dict(os.environ, TIERMEM_DEVICE="sim")  # what the Python side configures
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return _C.read_trace(str(path))


def python_trace(tmp):
    path = tmp / "py.tmtrace"
    torch.manual_seed(SEED)
    model = MirrorGPT()
    config = {"device_kind": "sim", "device": int(n_params(model) * 16 * FRACTION),
              "host": "1GiB", "optimizer": {"lr": LR, "weight_decay": WD}}
    model, opt = tiermem.initialize(model, config, units=gpt_units)
    rt = tiermem.runtime_of(model)
    rt.record_trace(path, iterations=STEPS)
    for x, y in data()[:STEPS]:
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()
        opt.step()
    rt.close()  # writes the trace
    return _C.read_trace(str(path))


def moments(trace):
    return [[(m["label"], m["kind"], m["unit"], sorted(set(m["accesses"]))) for m in it]
            for it in trace]


def test_libtorch_and_python_record_the_same_trace(tmp_path):
    cpp, py = cpp_trace(tmp_path), python_trace(tmp_path)
    assert len(cpp) == len(py) == STEPS
    names = ["embed", "block0", "block1", "head"]
    for it in py:  # every unit's moments carry its kind and index
        units = [(m["label"], m["unit"]) for m in it
                 if m["kind"] in (_C.MomentKind.PRE_FORWARD, _C.MomentKind.PRE_BACKWARD)]
        assert units == [(f"{n}:pre-forward", i) for i, n in enumerate(names)] + \
            [(f"{n}:pre-backward", i) for i, n in reversed(list(enumerate(names)))], units
    for i, (a, b) in enumerate(zip(moments(cpp), moments(py))):
        assert [m[:3] for m in a] == [m[:3] for m in b], f"iteration {i}"
        backward = {"cpp": set(), "py": set()}
        for ma, mb in zip(a, b):
            if ma[1] != _C.MomentKind.PRE_BACKWARD:
                assert ma == mb, f"iteration {i} moment {ma[0]}"
                continue
            chunks_cpp, chunks_py = {c for c, _, _ in ma[3]}, {c for c, _, _ in mb[3]}
            assert chunks_py <= chunks_cpp, f"iteration {i} moment {ma[0]}: {ma[3]} {mb[3]}"
            backward["cpp"] |= chunks_cpp
            backward["py"] |= chunks_py
        assert backward["cpp"] == backward["py"], f"iteration {i}"
    # The second iteration runs the first's deferred updates in its forward, before each
    # unit's moment (optimizer sub-steps between the pre-forwards), the same on both sides.
    kinds = [m["kind"] for m in cpp[1]]
    assert kinds.index(_C.MomentKind.OPTIMIZER_STEP) < kinds.index(_C.MomentKind.PRE_BACKWARD)
