#!/usr/bin/env bash
# The one prepared command for a lent H200: installs the carried wheels, writes env.txt (machine, driver,
# torch/CUDA, the traced packages and where they load from), then runs bench/gpu_check.py under a time cap.
#
# Here first (PyPI needed, the device has no network):  make gpu-wheels   (or: bash bench/gpu_wheels.sh)
# Then one device-tool call:  run  command="bash bench/gpu_run.sh"  carry=[".whl"]  timeout_s=420
# The script stops itself at LIMIT_S, before the tool's timeout, so $OUT still comes back. A full run is
# ~6.5 min; with the machine's 1-2 min start two fit in the 15 min of device time. give_back when done.
# Results: env.txt, gpu_check.json and gpu_check.log come back under the tool's files_at folder; copy them
# to bench/results/gpu/<date>-h200/, commit, and summarise them in BENCHMARKS.md (bench/GPU_RUN.md).
#
# On CPU, with the packages of .venv:  ZQ_NO_WHEELS=1 PYTHON=.venv/bin/python bash bench/gpu_run.sh --dry-run
# Arguments go to gpu_check.py. Exits with gpu_check's status (124 or 137: stopped at the cap).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/gpu_run}
PYTHON=${PYTHON:-python3}  # on the H200, python3 is the image's, with its CUDA torch
LIMIT_S=390  # the whole script; gpu_check gets what the steps before leave (it is made to need < 360 s)
ENV_TXT=$OUT/env.txt
mkdir -p "$OUT"
: >"$ENV_TXT"

if [ "${ZQ_NO_WHEELS:-0}" != 1 ]; then
  if ! compgen -G '.whl/*.whl' >/dev/null; then
    echo "gpu_run: no .whl/*.whl: run 'make gpu-wheels' here and carry .whl (ZQ_NO_WHEELS=1 skips this)" | tee -a "$ENV_TXT" >&2
    exit 2
  fi
  echo "== wheels into /tmp/site" >>"$ENV_TXT"
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >>"$ENV_TXT" 2>&1; then
    tail -20 "$ENV_TXT" >&2; echo "gpu_run: installing the wheels failed" >&2
    exit 2
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

section() {  # a failing or missing tool is recorded, not fatal: the check itself matters more
  echo "== $1" >>"$ENV_TXT"; shift
  timeout 60 "$@" >>"$ENV_TXT" 2>&1 || echo "(exit $?)" >>"$ENV_TXT"
}
section date date -u
section uname uname -a
section nvidia-smi nvidia-smi
section python "$PYTHON" -VV
section torch "$PYTHON" -c "import torch; c = torch.cuda.is_available(); print('torch', torch.__version__, 'cuda',
  torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'device', torch.cuda.get_device_name() if c else None)"
section "packages (bench/gpu_imports.py)" "$PYTHON" bench/gpu_imports.py
section nproc nproc
section "free -g" free -g

cap=$((LIMIT_S - SECONDS))
PYTHONUNBUFFERED=1 timeout -k 10 "$cap" "$PYTHON" bench/gpu_check.py "$@"
status=$?
note=""; [ "$status" = 124 ] || [ "$status" = 137 ] && note=", stopped at its ${cap} s cap"
echo "== gpu_check: exit $status after ${SECONDS} s in all$note" | tee -a "$ENV_TXT"
exit "$status"
