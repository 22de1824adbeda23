"""fio as the benchmarks' disk baseline, given the advantages the NVMe tier has: O_DIRECT
through io_uring with registered buffers and files (``--fixedbufs --registerfiles``), and
huge-page buffers (``--iomem=mmaphuge``) when the kernel has enough free hugetlb pages (the
tier's buffers get transparent huge pages, which fio cannot ask for). Same directory, block
size and queue depth as the tier uses."""
from __future__ import annotations

import json
import os
import shutil
import subprocess


def hugetlb_free_bytes() -> int:
    free = size = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("HugePages_Free:"):
                free = int(line.split()[1])
            elif line.startswith("Hugepagesize:"):
                size = int(line.split()[1]) * 1024
    return free * size


def fio_rates(directory: str, size: str = "1G", block: str = "1M", depth: int = 8,
              block_bytes: int = 1 << 20) -> dict | None:
    """Sequential write then read GB/s of one file in `directory`: {"write", "read", "iomem"};
    None without fio or when it fails."""
    if shutil.which("fio") is None:
        return None
    path = os.path.join(directory, "fio-baseline.dat")
    iomem = "mmaphuge" if hugetlb_free_bytes() >= 2 * block_bytes * depth else "malloc"
    base = ["fio", "--name=t", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
            f"--bs={block}", f"--iodepth={depth}", f"--size={size}", "--fixedbufs",
            "--registerfiles", f"--iomem={iomem}", "--output-format=json"]
    out = {"iomem": iomem}
    try:
        for rw, key in (("write", "write"), ("read", "read")):
            r = subprocess.run(base + [f"--rw={rw}"], check=True, capture_output=True, text=True)
            out[key] = json.loads(r.stdout)["jobs"][0][key]["bw_bytes"] / 1e9
        return out
    except (subprocess.CalledProcessError, KeyError, ValueError, IndexError):
        return None
    finally:
        if os.path.exists(path):
            os.remove(path)


def fio_read_file(path: str, block: str = "1M", depth: int = 8,
                  block_bytes: int = 1 << 20) -> float | None:
    """Sequential read GB/s of the existing file `path` (read-only, O_DIRECT, the advantages
    above); None without fio or when it fails."""
    if shutil.which("fio") is None:
        return None
    iomem = "mmaphuge" if hugetlb_free_bytes() >= 2 * block_bytes * depth else "malloc"
    size = os.path.getsize(path)
    if size < block_bytes:  # a small file (a test's): 4 KiB blocks, O_DIRECT's granule
        block, block_bytes = "4k", 4096
    cmd = ["fio", "--name=r", f"--filename={path}", "--readonly", "--rw=read",
           "--ioengine=io_uring", "--direct=1", f"--bs={block}", f"--iodepth={depth}",
           f"--size={size // block_bytes * block_bytes}", "--fixedbufs",
           "--registerfiles", f"--iomem={iomem}", "--output-format=json"]
    try:
        r = subprocess.run(cmd, check=True, capture_output=True, text=True)
        return json.loads(r.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9
    except (subprocess.CalledProcessError, KeyError, ValueError, IndexError):
        return None
