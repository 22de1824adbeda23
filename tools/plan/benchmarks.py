#!/usr/bin/env python3
"""Planner benchmark table for docs/benchmarks.md (standard library only).

For every canonical trace in tests/data/ at device budgets of 25/50/75% of the model data
(host 64 GiB, no NVMe), runs `tiermem plan compare TRACE --device P% --host 64GiB --json`
and prints a markdown table: bytes into the device tier and stall per iteration for every
policy, the OPT bound, and the issue's ratios (planned / OPT bytes, planned stall /
patrickstar and / lru).

    python3 tools/plan/benchmarks.py [path/to/tiermem [COMPARE-OPTION...]]
                                      (default: build/tools/tiermem; options are passed to
                                      every `plan compare`, e.g. --lookahead room)
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = ["gpt", "gpt-ckpt", "gpt-tied", "moe"]
BUDGETS = [25, 50, 75]
POLICIES = ["lru", "patrickstar", "deepspeed", "engine", "planned"]
GIB = float(1 << 30)


def cell(r, key, scale, fmt):
    if "error" in r:
        return "OOM"
    return fmt % (r[key] / scale)


def ratio(a, b):
    return "—" if a is None or b is None or b == 0 else "%.2f" % (a / b)


def main():
    tiermem = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build/tools/tiermem")
    extra = sys.argv[2:]
    print("| trace | device | " + " | ".join(POLICIES) + " | OPT | planned/OPT bytes "
          "| planned/patrickstar stall | planned/lru stall |")
    print("|---|---|" + "---|" * (len(POLICIES) + 4))
    for t in TRACES:
        path = os.path.join(ROOT, "tests/data", t + ".tmtrace")
        for b in BUDGETS:
            out = subprocess.run([tiermem, "plan", "compare", path, "--device", "%d%%" % b,
                                  "--host", "64GiB", "--json"] + extra, check=True,
                                 capture_output=True, text=True).stdout
            rs = {r["policy"]: r for r in json.loads(out)}
            cells = []
            for p in POLICIES:
                r = rs[p]
                if "error" in r:
                    cells.append("OOM")
                else:
                    cells.append("%.2f / %.1f" % (r["device_in_bytes_per_iteration"] / GIB,
                                                  r["stall_ns"] / 1e6))
            opt = rs["opt"]
            cells.append("%.2f" % (opt["device_in_bytes_per_iteration"] / GIB)
                         if "error" not in opt else "—")
            pl = rs["planned"]
            get = lambda name, key: None if "error" in rs[name] else rs[name][key]
            cells.append(ratio(get("planned", "device_in_bytes_per_iteration"),
                               get("opt", "device_in_bytes_per_iteration")))
            cells.append(ratio(get("planned", "stall_ns"), get("patrickstar", "stall_ns")))
            cells.append(ratio(get("planned", "stall_ns"), get("lru", "stall_ns")))
            print("| %s | %d%% | %s |" % (t, b, " | ".join(cells)))


if __name__ == "__main__":
    main()
