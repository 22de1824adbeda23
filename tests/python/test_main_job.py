"""The main job (README command 1) at --size tiny: NVMe in the loop, the loss goes down, the
timeline report and HTML are written, the temporary NVMe directory is removed, and the
command it tells the user to run next exists."""
import glob
import os
import subprocess
import sys
import tempfile

import pytest


def test_tiny_main_job_end_to_end(tmp_path):
    tl = tmp_path / "run.tmt"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "tiermem-nvme-*")))
    out = subprocess.run([sys.executable, "-m", "tiermem.examples.train_gpt", "--size", "tiny",
                          "--steps", "12", "--timeline", str(tl)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "params+grads+AdamW" in text and "NVMe" in text
    import torch
    if not torch.cuda.is_available():  # auto without a GPU: host mode, said so, no device tier
        assert "mode: host" in text and "host budget of" in text, text
        assert "device " not in text.split("Memory per tier")[1].split("Bytes moved")[0]
    first, last = [float(v) for v in text.split("loss ")[-1].split()[0:3:2]]
    assert last < first
    assert "tiermem prof report:" in text  # the report itself is printed
    # The run executed a plan made from its warm-up (--plan auto is the default).
    plan = [l for l in text.splitlines() if l.startswith("plan: ")]
    assert plan and "made from a recorded warm-up iteration" in plan[0], text
    assert " 0 diverged" in plan[0] and "executed in 9 iterations" in plan[0], plan[0]  # 4..12: warm-up 2-3
    assert "nvme" in text.split("Bytes moved")[1].split("Stalls")[0]  # NVMe was in the loop
    html = tmp_path / "run.html"
    assert tl.exists() and html.exists() and html.stat().st_size > 1000
    assert not glob.glob(str(tmp_path / "tiermem-nvme-*")), "the temporary NVMe dir stays"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "tiermem-nvme-*"))) <= before
    # The command it prints exists and works.
    cmd = [l for l in text.splitlines() if l.startswith("reopen them with:")][0]
    argv = cmd.split("reopen them with:")[1].split()
    again = subprocess.run(argv, capture_output=True, text=True)
    assert again.returncode == 0 and "tiermem prof report" in again.stdout, again.stderr
    # The warm-up trace of two iterations, next to the timeline, and the planner over it:
    # every policy ran (no "cannot run"), and the printed command works.
    trace = tmp_path / "run.tmtrace"
    assert trace.exists() and "warm-up trace (2 iterations)" in text
    table = text.split("warm-up trace (2 iterations)")[1].split("rerun with:")[0]
    for policy in ("lru", "patrickstar", "deepspeed", "engine", "planned", "opt"):
        row = [l for l in table.splitlines() if l.startswith(policy + " ")]
        assert row and "cannot run" not in row[0], table
    argv = [l for l in text.splitlines() if l.startswith("rerun with:")][0].split(":", 1)[1]
    again = subprocess.run(argv.split(), capture_output=True, text=True)
    assert again.returncode == 0 and "planned" in again.stdout, again.stderr


def test_tiny_main_job_with_activation_offload_and_nothing_on_nvme(tmp_path):
    # Activations offloaded to host memory (28 MiB of them next to a 12 MiB device budget),
    # and a host budget so large nothing goes to NVMe: the trace then has no host->NVMe copy
    # rate, and the planner comparison it prints still runs (assumed rates, noted). The model
    # is built on the meta device (--meta, as --size xl does): tiermem makes its values.
    tl = tmp_path / "run.tmt"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "tiermem.examples.train_gpt", "--size", "tiny",
                          "--steps", "6", "--timeline", str(tl), "--activations", "offload",
                          "--device", "sim", "--device-budget", "12MiB", "--host-budget", "96MiB",
                          "--meta"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "built on the meta device: values made in the chunks" in text, text
    line = [l for l in text.splitlines() if l.startswith("activations: offload")]
    assert line and "MiB per step moved to host memory" in line[0], text
    first, last = [float(v) for v in text.split("loss ")[-1].split()[0:3:2]]
    assert last < first
    table = text.split("warm-up trace (2 iterations)")[1].split("rerun with:")[0]
    row = [l for l in table.splitlines() if l.startswith("planned ")]
    assert row and "cannot run" not in row[0], text + out.stderr


@pytest.mark.slow
def test_default_size_main_job_end_to_end(tmp_path):
    # README command 1 at its own size (85 M params, state 10x the device budget, part of the
    # optimizer state on NVMe) for a few steps: the benchmark-sized twin of the tiny test.
    tl = tmp_path / "run.tmt"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "tiermem.examples.train_gpt", "--steps", "6",
                          "--timeline", str(tl)],
                         capture_output=True, text=True, env=env, timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "params+grads+AdamW" in text and "NVMe" in text
    first, last = [float(v) for v in text.split("loss ")[-1].split()[0:3:2]]
    assert last < first
    assert "tiermem prof report:" in text
    plan = [l for l in text.splitlines() if l.startswith("plan: ")]
    assert plan and " 0 diverged" in plan[0], text
    assert "nvme" in text.split("Bytes moved")[1].split("Stalls")[0]
    assert not glob.glob(str(tmp_path / "tiermem-nvme-*")), "the temporary NVMe dir stays"
