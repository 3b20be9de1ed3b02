#!/bin/bash
# Issue 35, promises kept late (2026-12-07): the virtual replica before (a worktree of 43feee3) and after.
# usage: bash bench/results/promises-2026-12-07/run.sh BEFORE_TREE   (a checkout of 43feee3 with .venv linked)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../../.." && pwd); before=$1
(cd "$before" && .venv/bin/python bench/burst_virtual.py --variants "default=") > "$here/virtual-before.md"
(cd "$root" && .venv/bin/python bench/burst_virtual.py --variants "default=") > "$here/virtual-after.md"
"$root/.venv/bin/python" "$here/promises.py" "$before" > "$here/promises-before.txt"
"$root/.venv/bin/python" "$here/promises.py" "$root" > "$here/promises-after.txt"
