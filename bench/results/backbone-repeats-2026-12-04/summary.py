"""The rounds of run.sh side by side: each figure per round (in run order) and the median per tree."""

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["after", "before", "before", "after", "after", "before"]
CELLS = [
    ("fair share: B's goodput vs alone", "fair_share", "fair share", "b_goodput_vs_alone"),
    ("fair share: total goodput, req/s", "fair_share", "fair share", "total_goodput_rps"),
    ("first-come: B's goodput vs alone", "fair_share", "first-come", "b_goodput_vs_alone"),
    ("first-come: total goodput, req/s", "fair_share", "first-come", "total_goodput_rps"),
    ("FIFO: total goodput, req/s", "fair_share", "fifo", "total_goodput_rps"),
    ("priority: interactive goodput vs alone", "class_priority", "priority", "interactive_goodput_vs_alone"),
    ("priority: total goodput, req/s", "class_priority", "priority", "total_goodput_rps"),
    ("class first-come: interactive vs alone", "class_priority", "first-come", "interactive_goodput_vs_alone"),
    ("class first-come: total goodput, req/s", "class_priority", "first-come", "total_goodput_rps"),
]


def value(bench: str, tag: str, i: int, mode: str, key: str):
    path = HERE / f"{bench}-{tag}-{i}" / f"{bench}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())["median"].get(mode, {}).get(key)


def main() -> None:
    print("| run | before (rounds 2, 3, 6) | after (rounds 1, 4, 5) | median before → after |")
    print("|---|---|---|---|")
    for label, bench, mode, key in CELLS:
        per = {"before": [], "after": []}
        for i, tag in enumerate(ORDER, start=1):
            per[tag].append(value(bench, tag, i, mode, key))
        fmt = lambda xs: ", ".join("–" if x is None else f"{x:.3g}" for x in xs)  # noqa: E731
        med = {t: statistics.median([x for x in xs if x is not None] or [float("nan")]) for t, xs in per.items()}
        print(f"| {label} | {fmt(per['before'])} | {fmt(per['after'])} | {med['before']:.3g} → {med['after']:.3g} |")


if __name__ == "__main__":
    sys.exit(main())
