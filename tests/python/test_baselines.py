"""The side-by-side benchmark against DeepSpeed keeps running: without DeepSpeed at hand (CI)
its rows are skipped and plain torch and tiermem still train the same losses."""
from benchmarks import bench_deepspeed


def test_the_deepspeed_benchmark_runs_without_deepspeed(capsys, tmp_path, monkeypatch):
    # Each system runs in a child Python that imports the benchmark again: from another
    # directory too (the children get the repository root on PYTHONPATH, child_env).
    monkeypatch.chdir(tmp_path)
    bench_deepspeed.main(["--deepspeed", str(tmp_path / "none"), "--rounds", "1", "--steps", "1",
                          "--warmup", "1", "--layers", "1", "--width", "64",
                          "--systems", "plain,tiermem-host,tiermem-main-job"])
    out = capsys.readouterr().out
    assert "no DeepSpeed" in out
    rows = [line for line in out.splitlines() if line.startswith("| plain") or
            line.startswith("| tiermem")]
    assert len(rows) == 3, out
    losses = {row.split("|")[5].strip() for row in rows}
    assert len(losses) == 1, rows  # the same training in every system


def test_the_in_step_nvme_benchmark_measures_real_traffic(capsys, tmp_path):
    """bench_nvme_step on a small model whose optimizer state lives on NVMe: NVMe bytes move
    every step and both rates (ours from the timeline, fio's) are measured."""
    import shutil

    import pytest

    from benchmarks import bench_nvme_step
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    assert bench_nvme_step.main(["--rounds", "1", "--steps", "2", "--warmup", "1",
                                 "--layers", "2", "--width", "128", "--device", "2MiB",
                                 "--host", "3MiB", "--nvme-size", "64MiB", "--fio-size", "16M",
                                 "--dir", str(tmp_path), "--json"]) == 0
    import json
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = res["rows"][0]
    assert row["read GB/step"] > 0 and row["write GB/step"] > 0
    assert row["ours read GB/s"] > 0 and row["fio read GB/s"] > 0
    assert 0 < row["disk efficiency vs fio"] < 10


def test_the_bounce_benchmark_moves_lone_chunks_both_ways_and_refuses_a_bad_config(tmp_path):
    """`tiermem bench bounce`: each configuration's lone moves and the streaming baseline are
    measured (positive rates, one per round), the round trip checked inside; a malformed
    --configs entry is refused with its name."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tiermem", "bench", "bounce", "--dir", str(tmp_path),
           "--chunk", "4MiB", "--moves", "3", "--rounds", "2"]
    out = subprocess.run(cmd + ["--configs", "session,2x2MiB/pool", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    j = json.loads(out.stdout.strip().splitlines()[-1])
    assert [c["config"] for c in j["configs"]] == ["session", "2x2MiB/pool"]
    for c in j["configs"]:
        for key in ("lone_write_bytes_per_s", "lone_read_bytes_per_s",
                    "stream_write_bytes_per_s", "stream_read_bytes_per_s"):
            assert len(c[key]) == 2 and all(v > 0 for v in c[key]), (key, c)
    bad = subprocess.run(cmd + ["--configs", "session,3y1MiB"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0
    assert "'3y1MiB'" in bad.stderr, bad.stderr
