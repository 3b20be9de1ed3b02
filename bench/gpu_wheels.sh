#!/usr/bin/env bash
# Downloads bench/gpu_wheels.txt into .whl/ for the lent H200 (no network there; Python 3.12, x86-64), to be
# carried by the device call that runs bench/gpu_run.sh. Run here, with PyPI reachable: `make gpu-wheels`.
# .whl/ is emptied first: gpu_run.sh installs every wheel in it, and two versions of one package stop that install.
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=bench/gpu_wheels.txt
LIMIT_MIB=48  # the device call carries 64 MiB in all, and the working tree travels in it too

mkdir -p .whl
rm -f .whl/*.whl
${PYTHON:-python3} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r "$LIST"

# pip names wheels with underscores and either case (SQLAlchemy-, mako-); compare normalised names.
missing=0
while read -r pin; do
  name=${pin%%==*} version=${pin#*==}
  pattern="$(tr 'A-Z.-' 'a-z__' <<<"$name")-$version-"
  if ! ls .whl | tr 'A-Z' 'a-z' | grep -q "^$pattern"; then echo "gpu_wheels: no wheel for $pin" >&2; missing=1; fi
done < <(grep -v '^\s*#' "$LIST" | grep .)
[ "$missing" = 0 ] || exit 1

ls -l .whl/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}'
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total $(awk "BEGIN {printf \"%.2f\", $total / 1048576}") MiB in $(ls .whl/*.whl | wc -l) wheels"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then echo "gpu_wheels: over $LIMIT_MIB MiB" >&2; exit 1; fi
