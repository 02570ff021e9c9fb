#!/usr/bin/env bash
# The main job: installs what Stockade needs, then runs the offline end-to-end demo.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/bootstrap.sh
exec .venv/bin/stockade demo "$@"
