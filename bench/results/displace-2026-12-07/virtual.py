# On the virtual replica: reserved retries refused on arrival, the bundled model at 2x and 4x, 4-s budgets, seed 1,
# clients retrying at the hint up to 8 times (as tests/inference/test_burst_prompts.py). python virtual.py TREE
import sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/protos"]
from services.inference.admission import AdmissionConfig, AdmissionController, AdmissionSettings
sys.path[:0] = ["/work/main"]
from tests.inference.steady_device import run
from tests.inference.test_burst_prompts import DEVICES, cost
for load in (2.0, 4.0):
    c = AdmissionController(cost("bundled"), AdmissionConfig(32, 256), AdmissionSettings())
    t = run(c, load * DEVICES["bundled"][2], 20.0, seed=1, max_attempts=8, budget_ms=4000)
    print(load, "taken", c.events["taken"], "taken_refused", c.events["taken_refused"], "displaced", c.events.get("displaced", 0), "misses", len(t.misses), "goodput", round(t.goodput(20.0), 2))
