#!/usr/bin/env bash
# The test command: installs what the tests need, then runs lint, rule checks and the whole suite.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/stockade rules lint rules/
.venv/bin/stockade rules test rules/
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$rc"
