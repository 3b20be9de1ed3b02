"""The figures of BENCHMARKS.md's issue-22 section, from the virtual replica (tests/inference/steady_device.py):
a modest tenant beside a 4x flood, fair share against first come, and two classes of one tenant under overload.
No clock: every run gives the same numbers.  Run from the repository root:
    .venv/bin/python bench/results/admission-classes-2026-12-03/virtual_replica.py"""

import sys

sys.path.insert(0, ".")
from tests.inference.steady_device import run  # noqa: E402
from tests.inference.test_retry_invitations import CAPACITY_PER_S, replica  # noqa: E402

SEEDS = (1, 2, 3, 4)
alone = {s: run(replica(), {"flood": 4 * CAPACITY_PER_S}, 30.0, seed=s, max_attempts=8).goodput(30.0) for s in SEEDS}
print("modest tenant at B x capacity beside a 4x flood, per seed:")
print("admitted / in deadline of admitted / goodput vs flood alone")
for b in (0.2, 0.3, 0.4, 0.5, 0.7):
    for fair in (False, True):
        row = []
        for seed in SEEDS:
            c = replica()
            c.fair = fair
            t = run(c, {"flood": 4 * CAPACITY_PER_S, "modest": b * CAPACITY_PER_S}, 30.0, seed=seed, max_attempts=8)
            m = t.by_tenant["modest"]
            shares = (m["admitted"] / m["calls"], m["in_deadline"] / max(m["admitted"], 1), t.goodput(30) / alone[seed])
            row.append("/".join(f"{x:.3f}" for x in shares))
        print(f"B={b} {'fair      ' if fair else 'first-come'}", " ".join(row))
print(
    "two classes of one tenant: interactive 0.5x (priority 50, 2 s), batch 3x (priority 0, 4 s); in deadline of offered"
)
streams = {"interactive": ("t", 50, 2000), "batch": ("t", 0, 4000)}
for fair in (False, True):
    row = []
    for seed in SEEDS:
        c = replica()
        c.fair = fair
        rates = {"interactive": 0.5 * CAPACITY_PER_S, "batch": 3 * CAPACITY_PER_S}
        t = run(c, rates, 30.0, seed=seed, max_attempts=8, streams=streams)
        i, b = t.by_tenant["interactive"], t.by_tenant["batch"]
        attained = f"{i['in_deadline'] / i['calls']:.3f}/{b['in_deadline'] / b['calls']:.3f}"
        row.append(f"{attained}/{t.goodput(30):.1f}/{len(t.misses)}")
    print(f"{'by class  ' if fair else 'first-come'} interactive/batch/goodput per s/misses", " ".join(row))
