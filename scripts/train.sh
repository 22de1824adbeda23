#!/usr/bin/env bash
# The main job (README command 1): builds/installs the tiermem package (incremental), then
# trains the repo's GPT-style decoder with a device budget ~4x smaller than its params + grads
# + AdamW state, with a progress bar and an end-of-run summary. Extra args go to the trainer
# (python -m tiermem.examples.train_gpt --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export PATH="$TIERMEM_VENV/bin:$PATH"
echo "train.sh: building/installing the tiermem package (incremental)" >&2
"$TIERMEM_PY" -m pip install -q --no-build-isolation . >&2
exec "$TIERMEM_PY" -m tiermem.examples.train_gpt "$@"
