"""TIERMEM_* environment variables override config keys; a bad value names the variable."""
import pytest

tiermem = pytest.importorskip("tiermem")
from tiermem.config import parse_config  # noqa: E402


def test_env_overrides_config_sizes_nvme_and_timeline(tmp_path):
    env = {"TIERMEM_DEVICE_BUDGET": "3MiB", "TIERMEM_HOST_BUDGET": "1GiB",
           "TIERMEM_NVME_SIZE": "64MiB", "TIERMEM_NVME_PATH": str(tmp_path),
           "TIERMEM_TIMELINE": str(tmp_path / "t.tmt")}
    c = parse_config({"device": "1GiB", "host": "2GiB"}, env=env)
    assert c.device_budget == 3 << 20
    assert c.host_budget == 1 << 30
    assert c.nvme_size == 64 << 20 and c.nvme_path == str(tmp_path)
    assert c.timeline == str(tmp_path / "t.tmt")


def test_unset_env_keeps_config():
    c = parse_config({"device": "5MiB"}, env={})
    assert c.device_budget == 5 << 20
    assert c.nvme_size == 0 and c.timeline is None


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="TIERMEM_DEVICE_BUDGET"):
        parse_config({}, env={"TIERMEM_DEVICE_BUDGET": "lots"})
    with pytest.raises(ValueError, match="TIERMEM_NVME_SIZE"):
        parse_config({}, env={"TIERMEM_NVME_PATH": "/tmp"})
    with pytest.raises(ValueError, match="nvme.path"):
        parse_config({}, env={"TIERMEM_NVME_SIZE": "1MiB", "TIERMEM_NVME_PATH": "/proc/nope"})
    with pytest.raises(ValueError, match="TIERMEM_DEVICE"):
        parse_config({}, env={"TIERMEM_DEVICE": "tpu"})


def test_runtime_knobs_from_env_fail_cleanly_before_anything_is_built(monkeypatch):
    """TIERMEM_IO_DEPTH / _NVME_ENGINE / _LOG_LEVEL / _CPU_THREADS / _KERNEL_ISA are read by the
    C++ runtime stack (runtime/base/options.h); a bad one is an error naming it, and the model
    is left untouched."""
    import torch
    model = torch.nn.Linear(8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    for var, value in [("TIERMEM_IO_DEPTH", "0"), ("TIERMEM_NVME_ENGINE", "spdk"),
                       ("TIERMEM_LOG_LEVEL", "loud"), ("TIERMEM_CPU_THREADS", "-1"),
                       ("TIERMEM_KERNEL_ISA", "neon")]:
        monkeypatch.setenv(var, value)
        with pytest.raises(Exception, match=var):
            tiermem.initialize(model, {"device": "1MiB", "host": "16MiB"})
        monkeypatch.delenv(var)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    m, opt = tiermem.initialize(model, {"device": "1MiB", "host": "16MiB"})  # clean env: fine
    tiermem.runtime_of(m).close()
