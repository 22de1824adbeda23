"""The side-by-side benchmark against DeepSpeed keeps running: without DeepSpeed at hand (CI)
its rows are skipped and plain torch and tiermem still train the same losses."""
from tiermem.examples import bench_deepspeed


def test_the_deepspeed_benchmark_runs_without_deepspeed(capsys, tmp_path):
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

    from tiermem.examples import bench_nvme_step
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
