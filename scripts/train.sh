#!/usr/bin/env bash
# The main job (README command 1): builds/installs the tiermem package (incremental), then
# trains the repo's GPT-style decoder — by default 85 M params whose params + grads + AdamW
# state are 2.6x the host budget (host mode without a GPU; a GPU's device budget with one),
# the rest on NVMe (a temporary directory, removed at exit) — with a progress bar, then prints
# the timeline report, writes the HTML timeline, records the second and third iterations as a
# warm-up trace and prints the planner's simulated schedules over it (tiermem plan compare).
# Extra args go to the trainer: --size tiny|default|xl, --steps N, --plan auto|always|off,
# ... (python -m tiermem.examples.train_gpt --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export PATH="$TIERMEM_VENV/bin:$PATH"
echo "train.sh: building/installing the tiermem package (incremental)" >&2
"$TIERMEM_PY" -m pip install -q --no-build-isolation . >&2
exec "$TIERMEM_PY" -m tiermem.examples.train_gpt "$@"
