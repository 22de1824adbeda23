#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine: Debian packages (apt) and a Python venv
# outside the repository holding torch and friends (requirements.txt). Each part is skipped
# when already present, so running it again costs a second or two.
#
# Usage: scripts/setup.sh            (or `source` it to get TIERMEM_PY exported)
# Env:   TIERMEM_VENV   venv location (default ~/.cache/tiermem/venv)
#        TIERMEM_SKIP_APT=1   don't touch apt (e.g. without root)
set -euo pipefail
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

APT_PACKAGES=(build-essential cmake pkg-config git
  liburing-dev libnuma-dev libhwloc-dev libtbb-dev libgtest-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev fio chromium python3-venv ninja-build ccache
  clang libclang-rt-14-dev lld clang-format)  # clang: the ASan+UBSan/fuzzer and TSan
                              # (-Wthread-safety) builds; clang-format: test.sh's format check;
                              # lld: the linker of every build (CMakeLists.txt TIERMEM_LINKER)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${TIERMEM_SKIP_APT:-0}" = 1 ]; then
    echo "setup: missing Debian packages (TIERMEM_SKIP_APT=1, not installing): ${missing[*]}" >&2
  else
    echo "setup: installing Debian packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

TIERMEM_VENV="${TIERMEM_VENV:-$HOME/.cache/tiermem/venv}"
stamp="$TIERMEM_VENV/.tiermem-requirements"
want="$(sha256sum "$_here/requirements.txt" | cut -d' ' -f1)"
if [ ! -x "$TIERMEM_VENV/bin/python" ]; then
  echo "setup: creating venv $TIERMEM_VENV"
  mkdir -p "$(dirname "$TIERMEM_VENV")"
  python3 -m venv "$TIERMEM_VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if "$TIERMEM_VENV/bin/python" - "$_here/requirements.txt" <<'PY' 2>/dev/null
import sys, importlib.metadata as md, re
for line in open(sys.argv[1]):
    line = line.split('#')[0].strip()
    if not line: continue
    m = re.match(r'([A-Za-z0-9_.-]+)\s*(==|>=)?\s*([^\s]*)', line)
    name, op, ver = m.groups()
    have = md.version(name)
    if op == '==' and have.split('+')[0] != ver: sys.exit(1)
PY
  then
    echo "$want" > "$stamp"
  else
    echo "setup: installing Python packages into $TIERMEM_VENV (torch is a large download, once)"
    "$TIERMEM_VENV/bin/python" -m pip install -q --upgrade pip
    "$TIERMEM_VENV/bin/python" -m pip install -q -r "$_here/requirements.txt"
    echo "$want" > "$stamp"
  fi
fi
export TIERMEM_VENV
export TIERMEM_PY="$TIERMEM_VENV/bin/python"
