"""plan: auto's decision (runtime/plan_runner.h, PlanDecision; docs/planner.md, "Executing
plans"): the plan made from the recorded third step is adopted when its simulated steady step
moves no more NVMe bytes (host mode) and stalls no longer than the reactive engine's moves
simulated on the same trace — the bar the planner ranks its candidates by — and the decision
and both sides' numbers are in stats()["plan"]["decision"]. Values never depend on it: the
adopted plan trains bit for bit as plan: off does."""
import copy

import torch

import tiermem
from conftest import batches, make_pair, train_steps

OPT = {"lr": 2e-3, "weight_decay": 0.01}


def host_cfg(path, host, plan):
    return {"device_kind": "host", "host": host, "optimizer": OPT, "plan": plan,
            "nvme": {"size": "64MiB", "path": str(path)}}


def test_auto_adopts_the_plan_on_a_small_gpt_in_host_mode_and_trains_as_off(tmp_path):
    # The tests' 0.7 MB GPT with 384 KiB of host memory: about half its state on NVMe.
    _, base = make_pair()
    data = batches(8)
    runs = {}
    for plan in ("off", "auto"):
        model, opt = tiermem.initialize(copy.deepcopy(base),
                                        host_cfg(tmp_path / plan, "384KiB", plan))
        losses = train_steps(model, opt, data)
        runs[plan] = (losses, model.state_dict(), tiermem.runtime_of(model).stats()["plan"])
    assert runs["auto"][0] == runs["off"][0]
    for k, v in runs["off"][1].items():
        assert torch.equal(runs["auto"][1][k], v), k
    p = runs["auto"][2]
    d = p["decision"]
    assert p["active"] and p["plans"] == 1 and p["declined"] == "" and p["error"] == "", p
    assert p["followed_iterations"] >= 4 and p["divergences"] == 0, p
    assert d["judged"] and d["adopted"] and d["reason"] == "", d
    # Both sides simulated on the recorded step's trace; the measured bytes beside them.
    assert d["engine_simulated"] and d["measured"], d
    assert d["plan_bytes"] == p["predicted_nvme_bytes"] > 0, (d, p)
    assert d["plan_stall_ns"] == p["predicted_stall_ns"], (d, p)
    assert d["plan_bytes"] <= d["engine_bytes"], d
    assert d["plan_stall_ns"] <= d["engine_stall_ns"], d
    assert d["engine_measured_bytes"] > 0, d
    off = runs["off"][2]
    assert not off["active"] and off["plans"] == 0 and not off["decision"]["judged"], off


def test_a_plan_from_the_users_own_recording_is_judged_too(tmp_path):
    # The main job records its own warm-up trace (steps 2-3): plan: auto plans from it when
    # it completes, with nothing measured over it; the simulated engine is the bar all the
    # same (before, such a plan ran unjudged).
    _, base = make_pair()
    data = batches(7)
    model, opt = tiermem.initialize(copy.deepcopy(base),
                                    host_cfg(tmp_path / "nvme", "384KiB", "auto"))
    rt = tiermem.runtime_of(model)
    train_steps(model, opt, data[:1])
    rt.record_trace(str(tmp_path / "own.tmtrace"), iterations=2)
    train_steps(model, opt, data[1:])
    p = rt.stats()["plan"]
    d = p["decision"]
    assert p["plans"] == 1 and p["active"] and p["declined"] == "", p
    assert d["judged"] and d["adopted"] and d["engine_simulated"], d
    assert not d["measured"] and d["engine_measured_bytes"] == 0, d
    assert d["plan_bytes"] <= d["engine_bytes"] and d["plan_stall_ns"] <= d["engine_stall_ns"], d
