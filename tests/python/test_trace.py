"""The warm-up trace recorded from a real training run (issue 9, runtime side): recording
changes nothing the model computes, the file has one pre-forward and one pre-backward per
unit, the saved-activation bytes the hooks saw, the optimizer sub-steps and measured rates,
and the planner CLI (`tiermem plan show|compare`) reads it. Bad use is refused clearly."""
import copy
import json
import subprocess
import sys

import pytest
import torch

import tiermem
from conftest import batches, make_pair, model_bytes, train_steps as train


def plan(*args):
    out = subprocess.run([sys.executable, "-m", "tiermem", "plan", *map(str, args)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def moving_config(model):
    # A quarter of the data on the device: chunks move every iteration (not resident).
    return {"device_kind": "sim", "device": model_bytes(model) // 4, "host": "256MiB", "chunk_size": 4096}


def test_recorded_trace_matches_the_run_and_the_planner_reads_it(tmp_path):
    ref, ours = make_pair(seed=3)
    plain = copy.deepcopy(ref)
    data = batches(5)
    m0, o0 = tiermem.initialize(plain, moving_config(ref))
    m1, o1 = tiermem.initialize(ours, moving_config(ref))
    path = tmp_path / "warmup.tmtrace"
    rt = tiermem.runtime_of(m1)
    rt.record_trace(path, iterations=2)
    recorded = train(m1, o1, data[:1])
    assert not path.exists()  # 2 iterations asked for: still recording
    recorded += train(m1, o1, data[1:])
    assert rt.written_trace == str(path) and path.exists()
    # Recording changes nothing: the same losses, bit for bit, as the same run unrecorded.
    assert recorded == train(m0, o0, data)

    summary = plan("show", path, "--moments", 1000)
    units = [u for u in rt.units if u.params]
    it0 = summary.split("iteration 1:")[0]
    assert "2 iterations" in plan("compare", path, "--device", "100%")
    for u in units:
        name = u.name or type(u.module).__name__
        assert f"{name}:pre-forward" in it0, name
        assert f"{name}:pre-backward" in it0, name
    # Deferred updates (optimizer_overlap: next-forward): the first recorded iteration follows
    # no step; the second runs the first's step, one sub-step per chunk group, in its forward.
    it1 = summary.split("iteration 1:")[1]
    assert sum("optimizer-substep" in l for l in it0.splitlines()) == 0
    assert sum("optimizer-substep" in l for l in it1.splitlines()) == len(rt.groups)
    # Every block saved activations for its backward (the saved-tensor hooks' bytes).
    for line in it0.splitlines():
        if "blocks." in line and "pre-forward" in line:
            saved = line.split("saved")[1].strip()
            assert saved != "0 B", line

    by = {r["policy"]: r for r in json.loads(plan("compare", path, "--device", "100%",
                                                  "--json"))}
    assert "error" not in by["planned"], by["planned"]
    assert by["planned"]["measured_iterations"] == 1  # the first is the reactive warm-up
    # With room for everything each param chunk comes up once: what the Belady bound says.
    assert by["planned"]["device_in_bytes_per_iteration"] == \
        by["opt"]["device_in_bytes_per_iteration"] > 0
    rt.close()
    tiermem.runtime_of(m0).close()


def test_record_trace_refuses_bad_use_and_close_writes_it(tmp_path):
    ref, ours = make_pair(seed=4)
    m, o = tiermem.initialize(ours, moving_config(ref))
    rt = tiermem.runtime_of(m)
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        rt.record_trace(tmp_path / "x.tmtrace", iterations=0)
    with pytest.raises(ValueError, match="path is empty"):
        rt.record_trace("", iterations=1)
    assert rt.finish_trace() is None  # nothing armed
    rt.record_trace(tmp_path / "a.tmtrace", iterations=3)
    with pytest.raises(RuntimeError, match="already being recorded"):
        rt.record_trace(tmp_path / "b.tmtrace")
    train(m, o, batches(1))
    rt.close()  # one of three iterations recorded: written at close
    assert (tmp_path / "a.tmtrace").exists()
    summary = plan("show", tmp_path / "a.tmtrace")
    assert "iteration 0:" in summary and "iteration 1:" not in summary, summary

    # Resident (everything fits on the SimDevice): nothing moves, nothing to plan.
    ref2, ours2 = make_pair(seed=5)
    m2, _ = tiermem.initialize(ours2, {"device_kind": "sim", "device": 4 * model_bytes(ref2), "host": "256MiB"})
    with pytest.raises(RuntimeError, match="fits in the device budget"):
        tiermem.runtime_of(m2).record_trace(tmp_path / "r.tmtrace")
    tiermem.runtime_of(m2).close()


def test_eval_passes_are_not_recorded(tmp_path):
    ref, ours = make_pair(seed=6)
    m, o = tiermem.initialize(ours, moving_config(ref))
    rt = tiermem.runtime_of(m)
    path = tmp_path / "t.tmtrace"
    rt.record_trace(path, iterations=1)
    data = batches(2)
    train(m, o, data[:1])
    m.eval()
    with torch.no_grad():
        m(data[1][0], data[1][1])
    m.train()
    assert rt.finish_trace() == str(path)
    summary = plan("show", path, "--moments", 1000)
    assert summary.count(":pre-forward") == len([u for u in rt.units if u.params])
    rt.close()
