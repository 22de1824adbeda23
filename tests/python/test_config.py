"""The configuration table (tests/runtime/config_cases.json) through the Python
package: the same cases, the same errors as the C++ parser (config_test.cc), since both call
session::ParseConfig. Plus what only the Python shim does (dicts, paths, non-JSON values) and
that a bad TIERMEM_* variable fails initialize before the model is touched."""
import json
import os

import pytest
import torch

tiermem = pytest.importorskip("tiermem")
from tiermem.config import parse_config  # noqa: E402

CASES = os.path.join(os.path.dirname(__file__), "..", "runtime", "config_cases.json")


def _cases():
    with open(CASES) as f:
        return json.load(f)["cases"]


def _sub(v, d):
    if isinstance(v, str):
        return v.replace("$DIR", d)
    if isinstance(v, dict):
        return {k: _sub(x, d) for k, x in v.items()}
    if isinstance(v, list):
        return [_sub(x, d) for x in v]
    return v


def _contains(got, want, at="config"):
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{at}: not an object: {got!r}"
        for k, v in want.items():
            assert k in got, f"{at}.{k} missing in {got!r}"
            _contains(got[k], v, f"{at}.{k}")
    else:
        assert got == want, f"{at}: got {got!r}, want {want!r}"


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["name"])
def test_config_table(case, tmp_path):
    d = str(tmp_path)
    env = {k: _sub(v, d) for k, v in case.get("env", {}).items()}
    config = _sub(case["config"], d)
    if not isinstance(config, dict) and config is not None:
        with pytest.raises(ValueError, match="config must be a dict"):
            parse_config(config, env=env)
        return
    if "error" in case:
        with pytest.raises(ValueError) as e:
            parse_config(config, env=env)
        assert case["error"] in str(e.value)
    else:
        c = parse_config(config, env=env)
        _contains(c.to_dict(), _sub(case["expect"], d))


def test_table_is_big_enough_to_mean_something():
    cases = _cases()
    assert sum("error" in c for c in cases) > 30 and sum("expect" in c for c in cases) > 8


def test_json_file_path_and_bad_files(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"device_kind": "sim", "device": "3MiB", "precision": "bf16"}')
    c = parse_config(str(p), env={})
    assert c.device_budget == 3 << 20 and c.precision == tiermem.Precision.bf16
    assert parse_config(p, env={}).device_budget == 3 << 20  # PathLike
    (tmp_path / "bad.json").write_text('{"device_kind": "sim", "device": ')
    with pytest.raises(ValueError, match="invalid JSON"):
        parse_config(str(tmp_path / "bad.json"), env={})
    with pytest.raises(ValueError, match="No such file"):
        parse_config(str(tmp_path / "none.json"), env={})


def test_values_that_are_not_json_are_a_value_error():
    with pytest.raises(ValueError, match="not JSON-serializable"):
        parse_config({"device_kind": "sim", "device": torch.float32}, env={})
    with pytest.raises(ValueError, match="not JSON-serializable"):
        parse_config({"optimizer": {"lr": float("nan")}}, env={})


def test_attributes_the_runtime_reads():
    c = parse_config({"device_kind": "sim", "device": "5MiB", "optimizer": {"betas": [0.8, 0.9]}}, env={})
    assert c.device_budget == 5 << 20 and c.betas == (0.8, 0.9)
    assert c.nvme_size == 0 and c.nvme_path is None and c.timeline is None
    assert c.chunk_size is None and c.gradient_accumulation_steps == 1


def test_bad_runtime_variable_fails_initialize_and_leaves_the_model_untouched(monkeypatch):
    model = torch.nn.Linear(8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    for var, value in [("TIERMEM_IO_DEPTH", "0"), ("TIERMEM_NVME_ENGINE", "spdk"),
                       ("TIERMEM_LOG_LEVEL", "loud"), ("TIERMEM_CPU_THREADS", "-1"),
                       ("TIERMEM_KERNEL_ISA", "neon"), ("TIERMEM_NVME_SIZE", "0"),
                       ("TIERMEM_DEVICE_BUDGET", "lots")]:
        monkeypatch.setenv(var, value)
        with pytest.raises(ValueError, match=var):
            tiermem.initialize(model, {"device_kind": "sim", "device": "1MiB", "host": "16MiB"})
        monkeypatch.delenv(var)
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.setenv("TIERMEM_DEVICE_BUDGET", "2MiB")  # the process environment applies
    m, opt = tiermem.initialize(model, {"device_kind": "sim", "device": "1MiB", "host": "16MiB"})
    assert tiermem.runtime_of(m).cfg.device_budget == 2 << 20
    tiermem.runtime_of(m).close()
