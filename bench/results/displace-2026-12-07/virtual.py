"""On the virtual replica: reserved retries refused again on arrival, the bundled model at 2x and 4x, 4-s budgets,
seed 1, clients retrying at the hint up to 8 times (as tests/inference/test_burst_prompts.py), judging the admission
of the tree named on the command line (a worktree of main, or one with displace.patch applied).

    python virtual.py TREE
"""

import sys
from pathlib import Path

tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/protos"]
from services.inference.admission import AdmissionConfig, AdmissionController, AdmissionSettings  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[3])]
from tests.inference.steady_device import run  # noqa: E402
from tests.inference.test_burst_prompts import DEVICES, cost  # noqa: E402

for load in (2.0, 4.0):
    c = AdmissionController(cost("bundled"), AdmissionConfig(32, 256), AdmissionSettings())
    t = run(c, load * DEVICES["bundled"][2], 20.0, seed=1, max_attempts=8, budget_ms=4000)
    events = c.events
    print(
        load,
        f"taken {events['taken']} taken_refused {events['taken_refused']} displaced {events.get('displaced', 0)}",
        f"misses {len(t.misses)} goodput {t.goodput(20.0):.2f}",
    )
