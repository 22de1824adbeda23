#!/usr/bin/env python3
"""Checks that every #include between top-level folders points down the layers of
docs/architecture.md (or sideways within one layer), and that only integrations/torch
includes torch and only the CUDA / io_uring folders include those headers. Run by ctest
(test `layering`); exits 1 naming each offending line.

    python3 scripts/check_layers.py [REPO_ROOT]
"""
from __future__ import annotations

import pathlib
import re
import sys

# Layer of each top-level source folder (docs/architecture.md, "Folders are layers").
LAYERS = {
    "base": 0,
    "tiers": 1, "kernels": 1, "layout": 1, "planners": 1, "prof": 1, "weights": 1,
    "chunks": 2,
    "runtime": 3,
    "integrations": 4, "tools": 4,
}
# Folders held to a narrower rule than their layer's: layout/ sits under the engine and the
# planners (both include it), so it includes nothing of its layer but itself.
ONLY = {"layout": ("base", "layout")}
# Where the platform headers may appear (DESIGN.md: CUDA and io_uring stay in their folders).
CONFINED = {
    "cuda": (re.compile(r"^(cuda|cuda_runtime|cuda_runtime_api|nccl|cublas)\w*\.h$"),
             ("tiers/cuda/", "kernels/cuda/", "integrations/preload/", "tests/")),
    "io_uring": (re.compile(r"^liburing(\.h|/)"), ("tiers/nvme/", "tests/")),
    "torch": (re.compile(r"^(torch|ATen|c10|pybind11)/"), ("integrations/torch/",
                                                            "tests/integrations/torch/")),
}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def folder_of(rel: str) -> str | None:
    top = rel.split("/", 1)[0]
    return top if top in LAYERS else None


def check(root: pathlib.Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cc", ".cu", ".inc") or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("build", ".git", "gpu-bundle")):
            continue
        src = folder_of(rel)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            kind, target = m.groups()
            if kind == '"':
                dst = folder_of(target)
                if src and dst and LAYERS[dst] > LAYERS[src]:
                    problems.append(f"{rel}:{n}: {src}/ (L{LAYERS[src]}) includes {target} "
                                    f"(L{LAYERS[dst]}): an include may not point up")
                elif src in ONLY and dst and dst not in ONLY[src]:
                    problems.append(f"{rel}:{n}: {src}/ includes {target}: it may include only "
                                    f"{', '.join(d + '/' for d in ONLY[src])}")
            for what, (pattern, allowed) in CONFINED.items():
                if pattern.match(target) and not rel.startswith(allowed):
                    problems.append(f"{rel}:{n}: includes {what} header <{target}> outside "
                                    f"{', '.join(allowed)}")
    return problems


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else
                        pathlib.Path(__file__).resolve().parent.parent)
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} include(s) break the layering "
              "(docs/architecture.md)")
        return 1
    print("check_layers: every include points down the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
