"""What became of the retries that came for a promise (a reservation, or a held turn for the step budget) over the
32 cells of bench/burst_virtual.py (seeds 1 and 2, clients retrying up to 8 times), on the virtual replica of this
checkout's tests/inference/steady_device.py, judging the admission of the tree named on the command line.

    python promises.py TREE      (stdout: one line of totals, then why promised retries were refused)
"""

import itertools
import sys
from collections import Counter
from pathlib import Path

tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/protos"]
from services.inference.admission import AdmissionConfig, AdmissionController, AdmissionSettings  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[3])]
from tests.inference.steady_device import run  # noqa: E402
from tests.inference.test_burst_prompts import DEVICES, cost  # noqa: E402

total: Counter[str] = Counter()
cells = itertools.product(DEVICES, (2000, 4000), (None, 1.0), (0.7, 1.0, 2.0, 4.0), (1, 2))
for device, budget_ms, every, load, seed in cells:
    c = AdmissionController(cost(device), AdmissionConfig(32, 256), AdmissionSettings())
    rate = load * DEVICES[device][2]
    t = run(c, rate, 20.0, seed=seed, max_attempts=8, budget_ms=budget_ms, burst_every_s=every)
    total.update(t.outcomes)
    total.update({f"event_{k}": v for k, v in c.events.items()})
    total["misses"] += len(t.misses)
p_ok, p_all = total["retry_on_time_admit"], total["retry_on_time_admit"] + total["retry_on_time_reject"]
u_ok, u_all = total["retry_admit"], total["retry_admit"] + total["retry_reject"]
first = total["first_admit"] + total["first_reject"]
print(
    f"promised retries admitted {p_ok}/{p_all} ({p_ok / p_all:.1%}); reservations taken {total['event_taken']}, "
    f"refused {total['event_taken_refused']}; turn retries {total['event_turn_retry']}; unbacked retries admitted "
    f"{u_ok}/{u_all}; first attempts admitted {total['first_admit']}/{first}; admitted misses {total['misses']}; "
    f"held later {total['event_retry_held_later']}"
)
print({k.removeprefix("retry_on_time_refused_"): v for k, v in total.items() if k.startswith("retry_on_time_refused_")})
