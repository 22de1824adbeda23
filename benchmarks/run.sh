#!/usr/bin/env bash
# Runs one of tiermem's Python benchmarks (benchmarks/NAME.py) with the venv of
# scripts/setup.sh and the tiermem package installed in it (README command 1, scripts/train.sh,
# installs it). Relative paths in ARGS are taken from the directory you run it in.
#
#   benchmarks/run.sh NAME [ARGS]        e.g. benchmarks/run.sh bench_engine --rounds 2
#   benchmarks/run.sh                    lists the benchmarks
#
# To measure a build tree instead of the installed package, put its package first:
#   PYTHONPATH=build/python-tree benchmarks/run.sh NAME [ARGS]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
list() { (cd "$here" && ls bench_*.py | sed 's/\.py$//' | sed 's/^/  /'); }
if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  echo "usage: benchmarks/run.sh NAME [ARGS]   (ARGS --help: the benchmark's options)"
  echo "benchmarks (benchmarks/README.md, docs/benchmarks.md):"
  list
  exit 0
fi
name="${1%.py}"
shift
if [ ! -f "$here/$name.py" ] || [[ "$name" != bench_* ]]; then
  echo "benchmarks/run.sh: no benchmark '$name' in $here; there are:" >&2
  list >&2
  exit 2
fi
source "$root/scripts/setup.sh"
# The repository root first, so `benchmarks` is importable from any directory (and by the
# benchmarks' child processes, which inherit PYTHONPATH); the caller's entries after it.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if ! err="$("$TIERMEM_PY" -c 'import tiermem._C' 2>&1)"; then
  echo "benchmarks/run.sh: $TIERMEM_PY cannot import the tiermem package ($(tail -1 <<<"$err")):" \
       "run scripts/train.sh (README command 1) to install it, or put a build's package first:" \
       "PYTHONPATH=build/python-tree benchmarks/run.sh $name ..." >&2
  exit 1
fi
exec "$TIERMEM_PY" -m "benchmarks.$name" "$@"
