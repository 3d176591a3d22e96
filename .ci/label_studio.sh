#!/usr/bin/env bash
# Installs Label Studio (for the labelling round-trip tests) into its own virtual environment,
# apart from visionloop's: it pins its own Django stack and an older numpy. The versions are
# locked in .ci/label-studio.lock (a `pip freeze` of a working install of label-studio 1.23.2),
# so pip resolves nothing and the install takes about a minute. Prints the executable's path,
# for VISIONLOOP_TEST_LABEL_STUDIO. Idempotent: an existing install is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.ci/venvs/label-studio}"
if [ ! -x "$dir/bin/label-studio" ]; then
  python3 -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip >&2
  "$dir/bin/python" -m pip install --quiet --no-deps -r .ci/label-studio.lock >&2
fi
echo "$(cd "$dir" && pwd)/bin/label-studio"
