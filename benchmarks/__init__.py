"""tiermem's Python benchmarks, outside the package (benchmarks/README.md says how to run them:
``benchmarks/run.sh NAME [ARGS]``, or ``python -m benchmarks.NAME`` from the repository root).

The helpers they share: ``timed_step`` is the one training step the benchmarks time,
``bench_gpt`` the model and data they train, ``tier_config`` the budgets part of their
configs, ``objective_bytes`` the bytes a plan minimizes, ``child_env`` the environment of a
child process that imports a benchmark again. The model itself is the package's
(``tiermem.examples.gpt``)."""
import os
import time

# The repository root: the directory that holds this package (benchmarks/ is imported as
# `benchmarks`, so the root must be on a child's sys.path for it to import a benchmark).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(env=None) -> dict:
    """`env` (default os.environ) with the repository root first on PYTHONPATH, for a child
    Python (`python -c`, `python -m benchmarks.X`) that imports a benchmark whatever its
    working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH", "")]))
    return env


def timed_step(model, opt, x, y, clip=0.0):
    """zero_grad, forward (the model returns the loss), backward, step: (loss, seconds).
    `clip` > 0: torch.nn.utils.clip_grad_norm_ before the step (plain torch; tiermem clips
    inside its step through the config)."""
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = model(x, y)
    loss.backward()
    if clip > 0:
        import torch
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.item(), time.perf_counter() - t0


def bench_gpt(layers, width, batch, steps, block=64):
    """The benchmarks' GPT (vocabulary 256, a head per 64 channels; seed 0) and `steps`
    synthetic batches of `batch` x `block` tokens (seed 1): (model, batches)."""
    import torch

    from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches
    c = GPTConfig(vocab_size=256, block_size=block, n_layer=layers, n_head=max(1, width // 64),
                  n_embd=width)
    torch.manual_seed(0)
    model = GPT(c)
    return model, list(synthetic_batches(c, batch, steps, seed=1))


def add_tier_args(ap, device="128MiB", host="512MiB") -> None:
    """The options `tier_config` takes: --device-kind, --device and --host."""
    ap.add_argument("--device-kind", default="auto",
                    choices=["auto", "host", "sim", "sim-async", "cuda"],
                    help="auto: the GPU when there is one, else host mode (compute on the CPU "
                         "against host memory); sim: SimDevice, a simulated device")
    ap.add_argument("--device", default=device, help="device budget (not in host mode)")
    ap.add_argument("--host", default=host)


def tier_config(device_kind: str, device, host) -> dict:
    """The budgets part of a benchmark's config: `device_kind` (auto: the GPU when there is
    one, else host mode) and the host budget, plus the `device` budget unless what runs is
    host mode, which has no device (a budget there is an error; docs/host-mode.md)."""
    import tiermem
    kind = tiermem._C.resolve_device_kind(
        tiermem.parse_config({"device_kind": device_kind}).device_kind)
    c = {"device_kind": device_kind, "host": host}
    if not kind.host_compute:
        c["device"] = device
    return c


def objective_bytes(stats, host_mode: bool) -> int:
    """The bytes the planner minimizes on the CPU, as the engine counted them so far
    (`stats()["bytes_moved"]`; PlanObjectiveBytes in runtime/plan_runner.h): into the device,
    or in host mode (no device) to and from NVMe."""
    moved = stats["bytes_moved"]
    if host_mode:
        return sum(v for k, v in moved.items() if "nvme" in k)
    return moved.get("host->device", 0) + moved.get("nvme->device", 0)
