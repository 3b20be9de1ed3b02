#!/bin/bash
# Poisson at 2x on the SmolLM2-135M shape (11.4 calls/s against a closed-loop capacity of 5.7), the deadline replica
# only, 64-token prompts, 32 new tokens, 2-s budgets, 20 s: outcomes of admitted calls by the replica's request_done
# lines and by the client's trace. Run from the root of the tree to measure (a worktree of the revision before, then
# main, alternating seeds); the model is bench/out/smollm2-135m-random (bench/decode.py make_model).
# usage: bash bench/results/expiry-2026-12-06/run.sh NAME "SEEDS" [serve args]
name=$1; seeds=$2; shift 2
root=${OUT:-/tmp/expiry}
for seed in $seeds; do
  out=$root/$name-seed$seed; rm -rf $out
  .venv/bin/python -m services.cli pulse --admission deadline --serve-args="$*" --qps 11.400 --shape fixed \
    --prompt-tokens 64 --max-tokens 32 --deadline-ms 2000.0 --arrival poisson --model bench/out/smollm2-135m-random \
    --duration 20 --seed $seed --out $out --no-plots --no-progress > /dev/null 2>&1
  python3 - $out $name $seed <<'PY'
import sys, json, collections
out, name, seed = sys.argv[1:]
rows = [json.loads(l[l.index('{'):]) for l in open(out + '/replica-deadline/replica.log') if 'request_done' in l]
c = collections.Counter(r['outcome'] for r in rows)
cl = [json.loads(l) for l in open(out + '/trace-deadline.jsonl')]
cc = collections.Counter(r['outcome'] for r in cl)
ok = [r for r in cl if r['outcome'] == 'ok' and r['finished_s'] - r['sent_s'] <= r['deadline_ms'] / 1000]
print(name, 'seed', seed, 'replica:', len(rows), dict(c), 'client:', dict(cc), 'goodput', round(len(ok) / 20, 2))
for r in rows:  # each admitted call that did not end ok: budget, predicted and actual finish (ms), tokens made
    if r['outcome'] != 'ok':
        print('   ', r['outcome'], 'budget', r['budget_ms'], 'predicted', r['predicted_finish_ms'],
              'actual', r['actual_finish_ms'], 'tokens', r['completion_tokens'])
PY
done
