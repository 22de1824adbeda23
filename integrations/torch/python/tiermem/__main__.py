"""`python -m tiermem …` and the `tiermem` console script: the bundled C++ CLI, and the
subcommands written in Python.

The wheel installs the `tiermem` executable (tools/main.cc: `prof report|html|export|diff`,
`bench …`) into the package's bin/ directory; this runs it with the same arguments.
`tiermem export CKPT DIR` (a training checkpoint to Hugging Face's layout, hf_export.py)
runs here, in Python: it reads transformers' conventions.
"""
from __future__ import annotations

import os
import sys


def cli_path() -> str:
    """The bundled `tiermem` executable (or $TIERMEM_CLI when set, e.g. a build tree's)."""
    override = os.environ.get("TIERMEM_CLI")
    if override:
        return override
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "tiermem")


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["export"]:
        from .hf_export import main as export_main
        return export_main(args[1:])
    exe = cli_path()
    if not os.access(exe, os.X_OK):
        sys.stderr.write(f"tiermem: the CLI is not installed at {exe} (reinstall the package: "
                         "pip install .)\n")
        return 127
    sys.stdout.flush()
    os.execv(exe, [exe] + args)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
