#!/bin/bash
# Serve the bundled model from the tree $1 (its own code: python -m, cwd the tree), pulse it at $2 req/s (Poisson,
# 64 + 32 tokens, 4-s budgets, 20 s, seed 1) and print the reservation events from its /metrics.
# usage: bash events.sh TREE QPS TAG
# $1 tree, $2 qps, $3 tag: serve from the tree, pulse at qps, scrape reservation events
set -u
cd $1
H=$(mktemp -d); export ZEROQUEUE_HOME=$H
.venv/bin/python -m services.cli migrate > /dev/null 2>&1

.venv/bin/python -m services.cli serve --port 50071 --metrics-port 9471 --http-port 0 --demo-tenant demo > $H/serve.out 2> $H/serve.err &
SP=$!
for i in $(seq 60); do grep -q SERVING $H/serve.out 2>/dev/null && break; sleep 1; done
KEY=$(cat $H/demo.key)
.venv/bin/python -m services.cli pulse --endpoint 127.0.0.1:50071 --api-key "$KEY" --qps $2 --shape fixed --prompt-tokens 64 --max-tokens 32 --deadline-ms 4000 --arrival poisson --duration 20 --seed 1 --no-plots --no-progress --out $H/pulse > /dev/null 2> $H/pulse.err
echo "== $3"
curl -s localhost:9471/metrics | grep -E "^zeroqueue_reservation_events_total|^zeroqueue_deadline_misses_total"
python3 - $H/pulse/pulse.json <<'PY'
import json,sys
p=json.load(open(sys.argv[1])); r=list(p['runs'].values())[0]; s=r['summary']
print({k: s.get(k) for k in ('goodput_rps','first_retry_success_rate','avg_retries_per_rejected','rejected_share')})
PY
kill $SP; wait $SP 2>/dev/null
