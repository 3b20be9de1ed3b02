"""How well admission predicts a cold prompt's call: predicted against actual finish, from the replica's own
`request_done` lines, for prompts of several lengths sent alone and two at once, with the prefix cache off so
every prompt is prefilled from token 0 (issue 33: a cold 1k-token prompt was predicted 26 % short on a 4-slot
replica, its prompt rows priced at the marginal row of the small batch).

Runs the tree it is in: to compare two trees, run it from each in turn (alternating), as bench/results/*/ab.sh do.
The model is bench/decode.py's SmolLM2-135M shape, `zeroqueue serve --max-seq-len 2048 --max-batch 4
--no-prefix-cache`. stdout: one JSON document (a row per call: length, alone or pair, predicted and actual ms).

    python bench/prefill_prediction.py --lengths 256,1000,1900 --rounds 2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from decode import SHAPE, make_model  # noqa: E402

from services.client import Client, Rejected  # noqa: E402
from services.client.retry import RetryConfig  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402

SERVE_ARGS = ["--max-seq-len", "2048", "--max-batch", "4", "--no-prefix-cache"]
MAX_TOKENS = 8
BUDGET_MS = 20_000  # generous: every call is admitted, so each is measured


def prompt(rng: random.Random, num_tokens: int) -> list[int]:
    """Token ids no earlier call began with (the cache is off anyway): a cold prompt."""
    return [rng.randrange(10, SHAPE["vocab_size"]) for _ in range(num_tokens)]


def send(client: Client, ids: list[int], request_id: str, refused: dict[str, int]) -> None:
    """One call; a refusal (its prediction past the generous budget) is kept with its predicted finish (ms)."""
    try:
        client.generate(ids, BUDGET_MS, max_tokens=MAX_TOKENS, temperature=0.0, request_id=request_id).collect()
    except Rejected as refusal:
        refused[request_id] = int(refusal.failure.error_metadata.get("predicted_finish_ms", -1))


def calls(replica, lengths: list[int], rounds: int, seed: int, refused: dict[str, int]) -> list[str]:
    """Each length alone, then two at once, `rounds` times; returns the request ids sent."""
    rng, sent = random.Random(seed), []
    with Client([replica.address], api_key=replica.api_key, retry=RetryConfig(max_attempts=1)) as client:
        send(client, prompt(rng, 16), "warm", refused)  # first-call costs out of the way
        for r in range(rounds):
            for n in lengths:
                send(client, prompt(rng, n), f"alone-{n}-{r}", refused)
                sent.append(f"alone-{n}-{r}")
                pair = [f"pair{i}-{n}-{r}" for i in (0, 1)]
                threads = [threading.Thread(target=send, args=(client, prompt(rng, n), rid, refused)) for rid in pair]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                sent += pair
    return sent


def rows(log_path: Path, sent: list[str], refused: dict[str, int]) -> list[dict]:
    """The replica's request_done lines for `sent`: predicted and actual finish from arrival (ms); a refused call
    has its predicted finish and no actual."""
    found = {}
    for line in log_path.read_text().splitlines():
        if '"request_done"' not in line:
            continue
        event = json.loads(line[line.index("{") :])
        if event.get("request_id") in sent:
            found[event["request_id"]] = event
    out = []
    for rid in sent:
        kind, n, _ = rid.split("-")
        if rid in refused:
            out.append(
                {"call": kind.rstrip("01"), "prompt_tokens": int(n), "predicted_ms": refused[rid], "refused": True}
            )
            continue
        e = found[rid]
        out.append(
            {
                "call": kind.rstrip("01"),
                "prompt_tokens": int(n),
                "predicted_ms": e["predicted_finish_ms"],
                "actual_ms": e["actual_finish_ms"],
                "ratio": round(e["actual_finish_ms"] / max(e["predicted_finish_ms"], 1), 3),
                "deadline_met": e["deadline_met"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,1000,1900")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    replica = start_replica(make_model(), "deadline", args.out, SERVE_ARGS, name="prefill")
    try:
        refused: dict[str, int] = {}
        sent = calls(replica, [int(n) for n in args.lengths.split(",")], args.rounds, args.seed, refused)
        end, num_logged = time.monotonic() + 30, len(sent) + 1 - len(refused)  # a line comes after its last message
        while time.monotonic() < end and replica.log_path.read_text().count('"request_done"') < num_logged:
            time.sleep(0.1)
    finally:
        replica.stop()
    result = {"serve_args": SERVE_ARGS, "max_tokens": MAX_TOKENS, "calls": rows(replica.log_path, sent, refused)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
