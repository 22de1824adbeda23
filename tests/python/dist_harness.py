"""Runs a function on N processes of one torch.distributed (Gloo) job on this machine, for the
sharded-session tests (test_distributed.py) and benchmark. Each rank calls `fn(rank, world,
*args)` after init_process_group; what rank r returns is saved with torch.save and handed back
as results[r]. A rank that raises is reported with its traceback; a job past `timeout` seconds
is killed."""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def _context():
    """Ranks are forked from a forkserver that imported torch and tiermem once (per test
    process), not spawned as fresh interpreters that each import torch: a two-rank job then
    starts in well under a second instead of seconds, and the tests start about 30 ranks.
    Each rank is still its own process with its own runtime and Gloo group (created after the
    fork). The server starts on first use, with this process's sys.path."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tiermem"])
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, collective_timeout, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()}, path)
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world, fn, *args, collective_timeout=60, allow_failure=False, timeout=600):
    """Results of fn on every rank, in rank order. Raises with every failing rank's traceback
    unless `allow_failure` (then a failed rank's entry is {"error": ..., "traceback": ...}).
    Each rank runs to its own end (a failure elsewhere shows up as its collective timeout)."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="tiermem-dist-") as out:
        port = free_port()
        procs = [ctx.Process(target=_entry,
                             args=(r, world, port, out, collective_timeout, fn, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r in range(world):
            path = os.path.join(out, f"rank{r}.pt")
            rec = torch.load(path, weights_only=False) if os.path.exists(path) else \
                {"ok": False, "error": f"no result (exit code {procs[r].exitcode})",
                 "traceback": ""}
            results.append(rec)
    failed = [(r, rec) for r, rec in enumerate(results) if not rec["ok"]]
    if failed and not allow_failure:
        raise AssertionError("\n".join(f"rank {r}: {rec['traceback'] or rec['error']}"
                                       for r, rec in failed))
    return [rec["result"] if rec["ok"] else rec for rec in results]
