#!/usr/bin/env bash
# Fails when a tracked C++ source outside tests/ is off .clang-format (Debian 12's clang-format
# 14, which scripts/setup.sh installs: other versions format some constructs differently).
#   scripts/check_format.sh        check, naming each file that is off
#   scripts/check_format.sh --fix  format them in place
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | grep -v '^tests/')
if [ "${1:-}" = --fix ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
# One clang-format over every file (a process per file cost seconds); only when it fails, one
# per file to name those that are off.
clang-format --dry-run --Werror "${files[@]}" >/dev/null 2>&1 && exit 0
off=()
for f in "${files[@]}"; do
  clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || off+=("$f")
done
if [ ${#off[@]} -gt 0 ]; then
  echo "check_format: ${#off[@]} file(s) off .clang-format (scripts/check_format.sh --fix):" >&2
  printf '  %s\n' "${off[@]}" >&2
  exit 1
fi
