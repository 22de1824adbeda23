"""The benchmarks live outside the package (benchmarks/, docs/benchmarks.md): the package holds
no benchmark, and benchmarks/run.sh lists them, refuses an unknown name and runs one from any
directory. (The benchmarks themselves are run at tiny sizes by the tests of what they measure:
test_baselines.py, test_activations.py, test_distributed.py, test_optimizer_placement.py.)"""
import os
import pathlib
import subprocess
import sys

import pytest

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
