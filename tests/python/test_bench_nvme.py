"""`tiermem bench nvme` against the fair fio: alternating rounds with a ratio per round and
both sides' CPU seconds per GB, fio on huge-page buffers the bench leases for the run (as root
it raises vm.nr_hugepages and mounts a hugetlbfs where the machine lacks them) and gives back,
also when a signal ends it."""
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")

NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"
LEASE_LOCK = "/tmp/tiermem-bench-hugepages.lock"  # tools/bench/hugepage_lease.cc


@contextlib.contextmanager
def no_lease_held():
    """While no bench holds a lease (they restore what they set up before letting go)."""
    fd = os.open(LEASE_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def machine_state():
    with no_lease_held():
        with open(NR_HUGEPAGES) as f:
            pages = int(f.read())
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[2] == "hugetlbfs"]
    return pages, mounts


def bench(tmp_path, *args):
    return [sys.executable, "-m", "tiermem", "bench", "nvme", "--file", str(tmp_path / "fio.dat"),
            *args]


def test_rounds_alternate_with_ratios_and_cpu_per_gb_and_the_machine_is_left_as_found(tmp_path):
    before = machine_state()
    out = subprocess.run(bench(tmp_path, "--size", "64MiB", "--rounds", "3", "--json"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    j = json.loads(out.stdout.strip().splitlines()[-1])
    assert j["rounds"] == 3 and j["depth"] == 8 and j["block_bytes"] == 1 << 20
    assert j["first"] == ["ours", "fio", "ours"]  # alternating, so drift hits both alike
    for d in ("write", "read"):
        assert len(j["ratio"][d]) == 3 and all(r > 0 for r in j["ratio"][d]), j["ratio"]
        assert all(v > 0 for v in j["ours"][d]["cpu_s_per_gb"]), j["ours"]
        assert all(v >= 0 for v in j["fio"][d]["cpu_s_per_gb"]), j["fio"]
    # Ours copies from fio's buffer footprint: depth x block.
    assert j["ours_host_buffers"]["bytes"] == 8 << 20
    hp = j["hugepages"]
    if hp["leased"]:
        assert "--iomem=mmaphuge" in j["fio_flags"], j
        assert j["ours_host_buffers"]["kind"] == "hugetlb", j
    else:
        # Not the fair fio, and the report says so and why.
        assert "--iomem=malloc" in j["fio_flags"] and "no huge pages" in hp["note"], j
    if os.geteuid() == 0:
        assert hp["leased"], hp  # root can always set them up (unless memory is fragmented)
    assert machine_state() == before, hp
    if hp["mounted"]:
        assert not os.path.exists(hp["mounted"])
    assert not (tmp_path / "fio.dat").exists()


def test_a_signal_mid_run_gives_back_what_the_bench_set_up(tmp_path):
    before = machine_state()
    # SIGINT's default disposition whatever this process inherited: a job started in the
    # background of a non-interactive shell ignores it, and the bench then keeps ignoring it
    # (the next test).
    proc = subprocess.Popen(["env", "--default-signal=INT",
                             *bench(tmp_path, "--size", "256MiB", "--rounds", "5")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()  # what fio gets, printed before the first round
    assert first.startswith("fio: --iomem="), first
    second = proc.stdout.readline()  # round 1 done; round 2 starts with fio
    assert second.startswith("round 1"), second
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT, proc.returncode
    assert machine_state() == before, first
    if "mounted at " in first:
        assert not os.path.exists(first.split("mounted at ")[1].split()[0])
    assert not (tmp_path / "fio.dat").exists()
    # No fio of this bench outlives it.
    ps = subprocess.run(["pgrep", "-f", f"--filename={tmp_path}/fio.dat"], capture_output=True,
                        text=True)
    assert ps.stdout.strip() == "", ps.stdout


def test_a_signal_ignored_when_the_bench_started_stays_ignored(tmp_path):
    """SIGINT ignored on entry (a background job of a non-interactive shell): the bench does not
    catch it, so a SIGINT mid-run neither ends the run nor undoes its huge pages under it (it
    did: the handler undid the lease, restored the ignore and the run went on to fail with
    "fio failed ... open mmap file" and exit 1 — the CI flake of the test above)."""
    before = machine_state()
    proc = subprocess.Popen(["env", "--ignore-signal=INT",
                             *bench(tmp_path, "--size", "64MiB", "--rounds", "2")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()
    assert first.startswith("fio: --iomem="), first
    second = proc.stdout.readline()
    assert second.startswith("round 1"), second
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, first + second + rest
    assert "round 2" in rest, rest
    assert machine_state() == before
