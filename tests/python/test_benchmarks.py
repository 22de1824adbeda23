"""The benchmarks live outside the package (benchmarks/, docs/benchmarks.md): the package holds
no benchmark, and benchmarks/run.sh lists them, refuses an unknown name and runs one from any
directory. (The benchmarks themselves are run at tiny sizes by the tests of what they measure:
test_baselines.py, test_activations.py, test_distributed.py, test_optimizer_placement.py;
the pretrained-weights benchmark and demonstrations, which have no other home, here.)"""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import tiermem

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "run.sh"
BENCHES = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


def run_sh(args, cwd):
    """benchmarks/run.sh ARGS in `cwd`, with this interpreter's venv (run.sh takes its Python
    from scripts/setup.sh, which must find that venv already set up: no apt, no pip)."""
    venv = os.environ.get("TIERMEM_VENV")
    if not venv or pathlib.Path(sys.prefix).resolve() != pathlib.Path(venv).resolve():
        pytest.skip("run.sh needs this Python to be the TIERMEM_VENV of scripts/setup.sh")
    env = dict(os.environ, TIERMEM_SKIP_APT="1")
    return subprocess.run(["bash", str(RUN), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_package_ships_no_benchmark():
    assert BENCHES, "no benchmarks/bench_*.py"
    pkg = pathlib.Path(tiermem.__file__).resolve().parent
    shipped = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                     if p.name.startswith("bench_") or p.name == "fio.py")
    assert shipped == [], shipped


def test_the_runner_lists_every_benchmark_and_refuses_an_unknown_one(tmp_path):
    listed = run_sh([], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split()[-len(BENCHES):] == BENCHES, listed.stdout
    bad = run_sh(["bench_nope", "--rounds", "1"], tmp_path)
    assert bad.returncode == 2
    assert "no benchmark 'bench_nope'" in bad.stderr and "bench_engine" in bad.stderr, bad.stderr


def test_the_runner_runs_a_benchmark_from_another_directory(tmp_path):
    out = run_sh(["bench_engine", "--rounds", "1", "--steps", "1", "--warmup", "1",
                  "--layers", "1", "--width", "64", "--fractions", "2.0"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| tiermem, device budget 200% |" in out.stdout, out.stdout


# ---- pretrained weights: bench_weights and the demonstrations (docs/benchmarks.md) -----------
def test_bench_weights_quick_measures_every_system_and_prints_its_goal_rows(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from benchmarks import bench_weights
    bench_weights.main(["--quick"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    rows = {r["system"]: r for r in result["table"]}
    assert sorted(rows) == ["accelerate", "hf", "meta", "tiermem"], out
    # tiermem reads the checkpoint with O_DIRECT: every byte of it comes from the disk
    assert rows["tiermem"]["read GB"] * 1e9 >= result["checkpoint_bytes"], out
    assert "export s" in rows["tiermem"] and "export s" in rows["hf"], out
    assert result["rss_limit_mib"] == pytest.approx(
        result["host"] / 2**20 + 256 + rows["tiermem"]["runtime MiB"])
    assert "RSS goal: growth" in out and "| tiermem |" in out, out
    if result["fio"][0] is not None:  # fio installed: the bound ratios
        assert rows["tiermem"]["load / bound"] > 0 and rows["tiermem"]["export / bound"] > 0


def test_the_demo_checkpoint_is_written_shard_by_shard_and_loads_in_transformers(tmp_path,
                                                                                 monkeypatch):
    transformers = pytest.importorskip("transformers")
    import safetensors.torch as st

    from benchmarks import demo_pretrained as demo
    config = demo.llama_config(*demo.SHAPES["small"])
    held = []  # the bytes of values each save_file call was handed: one shard at a time
    real = st.save_file
    monkeypatch.setattr(st, "save_file", lambda values, *a, **k: (
        held.append(sum(v.numel() * v.element_size() for v in values.values())),
        real(values, *a, **k))[1])
    total = demo.write_checkpoint(config, tmp_path / "ckpt", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    assert len(shards) == len(held) > 1 and index["metadata"]["total_size"] == total == sum(held)
    assert shards == sorted(set(index["weight_map"].values()))
    largest_tensor = max(2 * math.prod(s) for _, s in demo.checkpoint_tensors(config))
    assert max(held) <= max(200_000, largest_tensor)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert model.dtype == torch.bfloat16
    w = model.model.layers[0].mlp.up_proj.weight.float()
    assert 0.015 < w.std().item() < 0.025 and torch.equal(
        model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight,
                           model.model.layers[1].self_attn.q_proj.weight)


@pytest.mark.parametrize("what", ["lora", "full"])
def test_the_pretrained_demos_run_small(what, tmp_path, capsys):
    pytest.importorskip("transformers")
    if what == "lora":
        pytest.importorskip("peft")
    from benchmarks import demo_pretrained
    demo_pretrained.main([what, "--small", "--host", "2MiB", "--work", str(tmp_path)])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    losses = result["losses"]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], out
    assert [p["phase"] for p in result["phases"]] == ["write", "load", "steps", "save", "probe",
                                                      "close", "reload"]
    if what == "lora":
        assert result["max_abs_diff"] == 0.0, out
    else:
        assert result["max_abs_diff"] <= 1e-5, out
