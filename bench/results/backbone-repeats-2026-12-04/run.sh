#!/usr/bin/env bash
# Issue 30's owed repeats: bench/fair_share.py and bench/class_priority.py, before (d568266) and after (main),
# three rounds each in the order after, before, before, after, after, before (so drift favours neither), one
# repeat (seed 0) a round, so both trees see the same schedules. Each bench starts its replicas one after another.
# This host (Zen 3, AVX2) paces a step at ~15 ms (64 pace tokens), so issue 22's 256-token calls cannot finish in
# 4 s here (every call was infeasible): the calls are 64 + 128 tokens, and the capacity is measured once, first.
set -uo pipefail
BEFORE=/work/wt/base; AFTER=/work/wt/after; OUT=/work/main/bench/results/backbone-repeats-2026-12-04; PY=/work/main/.venv/bin/python
in_tree() { local tree=$1; shift; (cd "$tree" && PYTHONPATH=$tree:$tree/protos "$PY" "$@"); }
{ date -u; lscpu | grep -E 'Model name|Flags' | cut -c1-400; uptime; git -C "$AFTER" rev-parse HEAD; git -C "$BEFORE" rev-parse HEAD; } > "$OUT/host.txt"
SHAPE="--max-tokens 128 --deadline-ms 4000 --duration 15 --repeats 1"
in_tree "$AFTER" bench/fair_share.py $SHAPE --out "$OUT/capacity" > "$OUT/capacity.txt" 2> "$OUT/capacity.err"
CAP=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['capacity_qps'])" "$OUT/capacity/fair_share.json")
echo "capacity $CAP req/s" >> "$OUT/host.txt"
i=0
for tag in after before before after after before; do
  i=$((i+1)); tree=$AFTER; [ $tag = before ] && tree=$BEFORE
  in_tree "$tree" bench/fair_share.py --capacity-qps "$CAP" $SHAPE --out "$OUT/fair_share-$tag-$i" \
    > "$OUT/fair_share-$tag-$i.txt" 2> "$OUT/fair_share-$tag-$i.err"
  in_tree "$tree" bench/class_priority.py --capacity-qps "$CAP" $SHAPE --out "$OUT/class_priority-$tag-$i" \
    > "$OUT/class_priority-$tag-$i.txt" 2> "$OUT/class_priority-$tag-$i.err"
  echo "round $i $tag done $(date -u +%T)" >> "$OUT/host.txt"
done
uptime >> "$OUT/host.txt"
