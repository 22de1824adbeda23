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
