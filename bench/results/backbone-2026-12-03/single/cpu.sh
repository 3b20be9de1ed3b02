#!/usr/bin/env bash
# CPU seconds of the replica's server process and its engine child over 12 s of a FIFO overload, per tree
PY=/work/main/.venv/bin/python
cpu() { awk '{print $14+$15}' /proc/$1/stat 2>/dev/null; }
for round in 1 2; do for tree in /work/wt/base /work/main; do
  tag=$([ $tree = /work/main ] && echo after || echo before)
  out=/tmp/ab/cpu-$tag-$round; rm -rf $out
  (cd $tree && PYTHONPATH=$tree:$tree/protos $PY -m services.cli pulse --admission fifo --serve-args "--pace-tokens 64" \
    --qps 67.2 --duration 15 --shape fixed --prompt-tokens 64 --max-tokens 256 --deadline-ms 4000 --seed 1 \
    --no-progress --out $out > $out.txt 2>&1) &
  until grep -q "SERVING on" $out.txt 2>/dev/null; do sleep 0.2; done
  server=$(pgrep -f "services.cli serve" | head -1); engine=$(pgrep -P $server -f python | tail -1)
  pulse=$(pgrep -f "services.cli pulse" | head -1)
  sleep 1; s0=$(cpu $server); e0=$(cpu $engine); p0=$(cpu $pulse); sleep 12
  s1=$(cpu $server); e1=$(cpu $engine); p1=$(cpu $pulse)
  echo "$tag $round server $(( (s1-s0) )) engine $(( (e1-e0) )) pulse $(( (p1-p0) )) ticks/12s ; $(grep -E 'goodput, req/s' $out.txt | tr -s ' ')" 
  wait
done; done
