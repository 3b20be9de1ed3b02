set -x
cd /work/main
D=/tmp/rc-results; mkdir -p $D
for i in 1 2; do
  .venv/bin/python bench/refusal_cost.py --floor --rounds 2 --out $D/floor-$i > $D/floor-$i.json 2>$D/floor-$i.log
  (cd /tmp/old && /work/main/.venv/bin/python bench/refusal_cost.py --rounds 2 --out $D/before-$i > $D/before-$i.json 2>$D/before-$i.log)
  .venv/bin/python bench/refusal_cost.py --rounds 2 --out $D/after-$i > $D/after-$i.json 2>$D/after-$i.log
done
echo done > $D/DONE
