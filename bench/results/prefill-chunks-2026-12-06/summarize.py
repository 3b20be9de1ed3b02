"""The A/B's table: per tree, prompt length and alone/pair, the predicted and actual finish (ms) of every call and
the median of actual / predicted (refused calls: their prediction, marked R)."""

import collections
import json
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
print("| tree | call | prompt tokens | predicted ms | actual ms | actual / predicted, median |")
print("|---|---|---|---|---|---|")
for tree, name in (("before", "before (marginal row)"), ("main", "after (chunks, step in flight)")):
    agg = collections.defaultdict(list)
    for path in sorted(here.glob(f"prediction-{tree}-*.json")):
        for c in json.loads(path.read_text())["calls"]:
            agg[(c["call"], c["prompt_tokens"])].append(c)
    for (call, n), cs in sorted(agg.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        pred = ", ".join(f"{c['predicted_ms']}" + ("R" if c.get("refused") else "") for c in cs)
        actual = ", ".join(str(c["actual_ms"]) for c in cs if not c.get("refused"))
        ratios = [c["ratio"] for c in cs if not c.get("refused")]
        med = f"{statistics.median(ratios):.2f}" if ratios else "—"
        print(f"| {name} | {call} | {n} | {pred} | {actual} | {med} |")
