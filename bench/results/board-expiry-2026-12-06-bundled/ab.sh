#!/bin/bash
# run from each tree in turn (main at 36fc31e as "after", a worktree of 3cacda6 as "before"), alternating; 2026-12-06 22:46-22:57 UTC, Zen 4
# bundled model, deadline replica only: NAME QPS SEED
name=$1; qps=$2; seed=$3
out=/tmp/bund-$name-$qps-$seed; rm -rf $out
.venv/bin/python -m services.cli pulse --admission deadline --serve-args= --qps $qps --deadline-ms 2000.0 --arrival poisson --duration 20 --seed $seed --out $out --no-plots --no-progress > /dev/null 2>&1
python3 - $out $name $qps $seed <<'PY'
import sys, json, collections
out, name, qps, seed = sys.argv[1:]
rows = [json.loads(l[l.index('{'):]) for l in open(out + '/replica-deadline/replica.log') if 'request_done' in l]
c = collections.Counter(r['outcome'] for r in rows)
cl = [json.loads(l) for l in open(out + '/trace-deadline.jsonl')]
ok = [r for r in cl if r['outcome'] == 'ok' and r['finished_s'] - r['sent_s'] <= r['deadline_ms'] / 1000]
refused_first = sum(1 for r in cl if r['attempts'] and r['attempts'][0][1] != 'admitted') / len(cl)
print(name, qps, 'seed', seed, 'replica:', len(rows), dict(c), 'goodput', round(len(ok) / 20, 2), 'refused first', round(refused_first, 3))
PY
