#!/usr/bin/env bash
# Installs Label Studio (for the labelling round-trip tests) into its own virtual environment,
# apart from visionloop's: it pins its own Django stack and an older numpy. The versions are
# locked in .ci/label-studio.lock (a `pip freeze` of a working install of label-studio 1.23.2),
# so pip resolves nothing and the install takes about a minute. Prints the executable's path,
# for VISIONLOOP_TEST_LABEL_STUDIO. Idempotent: an existing install is reused.
# It also leaves a migrated data folder beside the executable (data-template/): a fresh server
# spends ~50 CPU-s migrating its database at its first start, which the tests would otherwise pay
# inside their run; they copy this folder instead (a start on it takes ~6 s).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.ci/venvs/label-studio}"
if [ ! -x "$dir/bin/label-studio" ]; then
  python3 -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip >&2
  "$dir/bin/python" -m pip install --quiet --no-compile --no-deps -r .ci/label-studio.lock >&2
fi
template="$dir/data-template"
if [ ! -f "$template/label_studio.sqlite3" ]; then
  rm -rf "$template.partial" && mkdir -p "$template.partial"
  # A throwaway owner: the tests start the server with their own user and token. The
  # organisation it makes must allow legacy tokens, which the tests use.
  LABEL_STUDIO_BASE_DATA_DIR="$template.partial" "$dir/bin/label-studio" init \
    --username template@localhost --password "template-$RANDOM$RANDOM" \
    --enable-legacy-api-token >&2
  mv "$template.partial" "$template"
fi
echo "$(cd "$dir" && pwd)/bin/label-studio"
