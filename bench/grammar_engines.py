"""Grammar engines for structured output (issue 31): xgrammar, llguidance and outlines-core side by side on this CPU,
one thread each, at the bundled model's vocabulary (4k) and a 49k byte-level BPE trained on the standard library.

Per engine and vocabulary: the tokenizer-info build (once per model); fresh, uncached compiles of 3 JSON schemas, a
regex, an arithmetic CFG and any JSON object, each followed by its document's walk (cold, then warm); then the cost
of one decode step at batch 1, 8 and 32: every row's matcher walks a valid document token by token, and a step is
the next-token bitmask of every row, the masks applied to fp32 logits [batch, vocab] (one implementation for all
engines, device/sampler.py's) and every matcher taking its row's token. The rows mix the 3 schemas (row i starts
with schema i % 3, and the next call on a row takes the next one) and start at staggered offsets. Each engine goes
its fastest single-threaded way: xgrammar's batch fill (BatchGrammarMatcher, 1 thread) with a loop of accepts,
llguidance's and outlines-core's loops; "llguidance-executor" is llguidance through its LLExecutor (1 thread).
Then: invalid documents (one broken keyword each) that a faithful mask refuses; whether a compile holds the GIL.
The whole comparison runs `--rounds` times, the engine order reversed every other round; the report gives the
median of the rounds and their spread.

The engines are not project dependencies: run it from a scratch venv outside the repo (torch pinned to the CPU
wheel; a looser torch spec would fetch a multi-GB CUDA build). xgrammar requires triton on Linux x86-64 and
transformers, so it goes in with --no-deps and its other requirements by hand:

    python3 -m venv /tmp/gbench
    /tmp/gbench/bin/pip install torch==2.13.0
    /tmp/gbench/bin/pip install tokenizers transformers llguidance outlines-core jsonschema numpy
    /tmp/gbench/bin/pip install --no-deps xgrammar && /tmp/gbench/bin/pip install apache-tvm-ffi pydantic
    /tmp/gbench/bin/python bench/grammar_engines.py --out bench/results/grammar-engines-2026-12-04/results.json

Table on stdout (markdown), logs on stderr, raw numbers in --out. The 49k tokenizer is trained once (~10 s) and
cached in bench/out/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: the other core is someone else's

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from grammar_adapters import (  # noqa: E402  (bench/grammar_adapters.py)
    ENGINES,
    FEATURES,
    Refused,
    apply_mask,
    apply_mask_shifts,
    check_allowed,
    ms_since,
    package_info,
    refuses,
    walk_once,
)
from grammar_cases import BUNDLED, EOS, PROBES, SCHEMAS, cases, probe_text, trained_tokenizer  # noqa: E402

log = logging.getLogger("grammar_engines")


def measure_compile(engine, vocab: int, kind: str, source, ids: list[int], reps: int) -> tuple[dict, object]:
    """Fresh compiles, each followed by the document's walk on a fresh matcher (cold: llguidance builds its
    lexer states lazily there, xgrammar has precomputed) and a second walk on another (warm: the copies share
    what the first learned). ms: compile wall and the process's CPU time (less inflated on a busy host), first
    mask, each walk. The first compile is a warm-up, not counted; a compile of 1 s or more is repeated twice only."""
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    times: dict[str, list] = {k: [] for k in ("compile_ms", "compile_cpu_ms", "first_mask_ms", "cold_ms", "warm_ms")}
    walk_error = None
    while len(times["compile_ms"]) < 1 + (reps if not times["compile_ms"] or times["compile_ms"][0] < 1e3 else 2):
        t0, c0 = time.perf_counter(), time.process_time()
        compiled = engine.compile(kind, source)
        t1, c1 = time.perf_counter(), time.process_time()
        try:
            (first, cold), (_, warm) = (
                walk_once(engine, compiled, ids, bitmask),
                walk_once(engine, compiled, ids, bitmask),
            )
        except Refused as exc:  # the compile time still counts; the walk's failure is reported
            first, cold, warm, walk_error = ms_since(t1), None, None, str(exc)[:300]
        for key, value in zip(times, ((t1 - t0) * 1e3, (c1 - c0) * 1e3, first, cold, warm)):
            times[key].append(value)
    raw = {k: [t if t is None else round(t, 3) for t in v[1:]] for k, v in times.items()}
    figures = {k: statistics.median(v) for k, v in raw.items() if None not in v}
    return figures | {"tokens": len(ids), "walk_error": walk_error, "raw": raw}, compiled


class Row:
    """One batch row: a call walking its document; when it ends, the next call on the row takes the next grammar."""

    def __init__(self, engine, grammars: list[tuple[object, list[int]]], index: int) -> None:
        self.engine, self.grammars, self.calls = engine, grammars, index
        self.start_call()
        for token in self.ids[: (index * 7) % len(self.ids)]:  # staggered: rows are at different points
            engine.advance([self.matcher], [token])
            self.pos += 1

    def start_call(self) -> None:
        compiled, self.ids = self.grammars[self.calls % len(self.grammars)]
        self.matcher, self.pos, self.calls = self.engine.matcher(compiled), 0, self.calls + 1

    @property
    def token(self) -> int:
        return self.ids[self.pos] if self.pos < len(self.ids) else EOS


def walk(engine, vocab: int, grammars: list[tuple[object, list[int]]], batch: int, steps: int) -> dict:
    """`steps` decode steps at `batch` rows: µs to fill all masks, apply them, advance every matcher."""
    rows = [Row(engine, grammars, i) for i in range(batch)]
    bitmask = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int32)
    fresh = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    logits, parts = fresh.clone(), {"fill_us": [], "apply_us": [], "advance_us": []}
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        matchers, tokens = [r.matcher for r in rows], [r.token for r in rows]
        moving = [r for r in rows if r.pos < len(r.ids)]  # a finished row only checks that EOS is allowed
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply_mask(logits, bitmask)
        t2 = time.perf_counter()
        if moving:
            engine.advance([r.matcher for r in moving], [r.token for r in moving])
        for part, (a, b) in zip(parts.values(), ((t0, t1), (t1, t2), (t2, time.perf_counter()))):
            part.append((b - a) * 1e6)
        check_allowed(bitmask, tokens)  # untimed, as is what follows
        for r in rows:
            r.pos += 1
            if r.pos > len(r.ids):
                r.start_call()
        logits.copy_(fresh)
    step_us = [sum(p) for p in zip(*parts.values())]
    engine_us = [f + a for f, a in zip(parts["fill_us"], parts["advance_us"])]  # the engine's part of a step
    # the process's CPU time over the walk's wall time: below 1, the host's other work took the core from it
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    figures = {
        "step_us": statistics.median(step_us),
        "step_us_p99": p99(step_us),
        "batch": batch,
        "cpu_share": cpu_share,
        "engine_us": statistics.median(engine_us),
    }
    return figures | {k: statistics.median(v) for k, v in parts.items()} | {"raw": [round(t, 1) for t in step_us]}


def gil_stall(fn) -> dict:
    """The longest a pure-Python thread went without running while `fn` ran (repeated to 100 ms at least), against
    the time fn took. Python code hands the GIL over every switch interval (5 ms), so a stall of about 5 ms says
    fn let go of it, and a stall as long as fn took says fn held it throughout."""
    state, stop = {"max": 0.0}, threading.Event()

    def spin() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            state["max"], last = max(state["max"], now - last), now

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    state["max"], t0 = 0.0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < 0.1:
        fn()
    time.sleep(0.02)  # the spinner records the gap that ends when fn returns
    stop.set()
    thread.join()
    return {"stall_ms": state["max"] * 1e3, "compile_ms": elapsed * 1e3}


def failed(exc: Exception) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def measure_vocab(engine, tok: Tokenizer, all_cases: dict, args, once: bool, gil: bool) -> dict:
    """One engine at one vocabulary: tokenizer info, compiles, decode steps; `once` the probes, `gil` the GIL
    check (first round, first and last vocabulary). A failure is a result, not a crash."""
    vocab, res = tok.get_vocab_size(), {"setup_ms": [], "compile": {}, "walk": {}}
    for _ in range(3):
        t0 = time.perf_counter()
        engine.setup(tok)
        res["setup_ms"].append(ms_since(t0))
    res["setup_ms"], compiled = statistics.median(res["setup_ms"]), {}
    for name, (kind, source, doc) in all_cases.items():
        try:
            ids = tok.encode(doc).ids
            res["compile"][name], grammar = measure_compile(engine, vocab, kind, source, ids, args.reps)
            compiled[name] = (grammar, ids)
        except Exception as exc:
            res["compile"][name] = failed(exc)
    walks = {f"schemas, batch {b}": ([compiled[n] for n in SCHEMAS if n in compiled], b) for b in args.batches}
    walks |= {f"{n}, batch 1": ([compiled[n]], 1) for n in ("regex", "cfg", "any_json") if n in compiled}
    for key, (grammars, batch) in walks.items():
        try:
            res["walk"][key] = walk(engine, vocab, grammars, batch, args.steps)
        except Exception as exc:
            res["walk"][key] = failed(exc)
        log.info("%s, %d tokens, %s: %s", engine.name, vocab, key, res["walk"][key].get("step_us", "failed"))
    if once:
        res["probes"] = {
            f"{keyword} ({schema})": refuses(
                engine, compiled[schema][0], tok.encode(probe_text(schema, path, bad)).ids, vocab
            )
            for schema, path, bad, keyword in PROBES
            if schema in compiled
        }
    if gil and "issue" in compiled:  # the largest schema at the largest vocabulary: the longest compile
        kind, source, _ = all_cases["issue"]
        res["gil"] = gil_stall(lambda: engine.compile(kind, source))
    return res


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[round(0.99 * (len(ordered) - 1))]


def combine(runs: list):
    """The rounds' figures, same shape -> every number a {median, min, max} across rounds; an error stays."""
    first = runs[0]
    if isinstance(first, dict):
        broken = [r for r in runs if "error" in r]
        return broken[0] if broken else {k: combine([r[k] for r in runs if k in r]) for k in first if k != "raw"}
    if isinstance(first, float):
        return {"median": statistics.median(runs), "min": min(runs), "max": max(runs)}
    return first


def apply_costs(vocabs: dict[str, Tokenizer], batches: list[int], reps: int = 100) -> dict:
    """The mask's application alone, median µs: the code every walk uses (device/sampler.py's), the torch shifts
    it replaced, and xgrammar's C++ CPU kernel, which any engine's bitmask could use (the layout is the same). The
    mask allows 1 token in 16, as sparse as a walk's; a dense random one would be slower (masked_fill_ branches)."""
    from xgrammar import apply_token_bitmask_inplace

    out = {}
    for name, tok in vocabs.items():
        for batch in batches:
            logits = torch.randn(batch, tok.get_vocab_size())
            words = [
                torch.randint(-(2**31), 2**31 - 1, (batch, logits.shape[1] // 32), dtype=torch.int32) for _ in "abcd"
            ]
            bitmask = words[0] & words[1] & words[2] & words[3]  # 1 token in 16 allowed: masks are sparse, as in a walk
            kinds = (("sampler (numpy)", apply_mask), ("torch shifts", apply_mask_shifts))
            for label, fn in (*kinds, ("xgrammar kernel", apply_token_bitmask_inplace)):
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn(logits, bitmask)
                    times.append((time.perf_counter() - t0) * 1e6)
                out.setdefault(f"batch {batch}, {name}", {})[label] = statistics.median(times)
    return out


def spread(s: dict, digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def compile_cell(c: dict) -> str:
    if "error" in c:
        return "failed"
    walks = f"{c['cold_ms']['median']:.2f} / {c['warm_ms']['median']:.2f}" if "cold_ms" in c else "walk failed"
    return f"{spread(c['compile_ms'], 2)}, cpu {c['compile_cpu_ms']['median']:.2f}; {walks}"


def walk_cell(w: dict) -> str:
    if "error" in w:
        return "failed"
    per_row = w["engine_us"]["median"] / w["batch"]
    step = f"{w['step_us']['median']:.0f} (p99 {w['step_us_p99']['median']:.0f})"
    return f"{spread(w['engine_us'], 0)}; {per_row:.1f}/row; step {step}; cpu {w['cpu_share']['median']:.2f}"


def table(title: str, header: list[str], rows: list[tuple[str, list[str]]]) -> str:
    lines = [f"\n### {title}\n", "| | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    return "\n".join(lines + [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]) + "\n"


def render_speed(summary: dict, info: dict, applied: dict) -> str:
    engines, vocabs = list(summary), list(next(iter(summary.values())))
    first = summary[engines[0]][vocabs[0]]
    out = [f"versions: {', '.join(e + ' ' + info[e]['version'] for e in engines)}; median [min–max] of rounds"]
    rows = [(v, [spread(summary[e][v]["setup_ms"]) for e in engines]) for v in vocabs]
    out.append(table("Tokenizer info (once per model), ms", engines, rows))
    cells = [
        [compile_cell(summary[e][v]["compile"][case]) for e in engines] for case in first["compile"] for v in vocabs
    ]
    labels = [f"{case}, {v}" for case in first["compile"] for v in vocabs]
    out.append(
        table(
            "Compile, ms: wall [min–max], CPU; then the document's walk, cold / warm (each compile fresh)",
            engines,
            [*zip(labels, cells)],
        )
    )
    labels = [f"{key}, {v}" for key in first["walk"] for v in vocabs]
    cells = [
        [walk_cell(summary[e][v]["walk"].get(key, {"error": "-"})) for e in engines]
        for key in first["walk"]
        for v in vocabs
    ]
    out.append(
        table(
            "Decode step, µs: the engine's part (fill + advance) [min–max], per row; with the mask applied (p99); CPU",
            engines,
            [*zip(labels, cells)],
        )
    )
    if applied:
        header = list(next(iter(applied.values())))
        rows = [(key, [f"{row[h]:.0f}" for h in header]) for key, row in applied.items()]
        out.append(table("Applying a mask to fp32 logits alone, µs (median of 100)", header, rows))
    return "\n".join(out)


def gil_cell(g: dict | None) -> str:
    return "–" if g is None else f"{g['stall_ms']['median']:.1f} of {g['compile_ms']['median']:.1f}"


def render_support(summary: dict, info: dict) -> str:
    engines, vocab = list(summary), next(iter(next(iter(summary.values()))))

    def ran(engine: str, case: str, walks: str) -> str:
        res = summary[engine].values()
        errors = [r["compile"][case].get("error") or r["compile"][case].get("walk_error") for r in res]
        errors += [w.get("error") for r in res for k, w in r["walk"].items() if k.startswith(walks)]
        return next((f"failed: {e[:150]}" for e in errors if e), "ok")

    kinds = (("any JSON", "any_json", "any_json", "any_json"), ("JSON Schema", "json_schema", "issue", "schemas"))
    kinds += (("regex", "regex", "regex", "regex"), ("CFG", "cfg", "cfg", "cfg"))
    rows = [
        (label, [f"{FEATURES[e][kind]}; {ran(e, case, walks)}" for e in engines]) for label, kind, case, walks in kinds
    ]
    out = [table("Support (and whether this run's case compiled and walked)", engines, rows)]
    probes = [summary[e][vocab].get("probes", {}) for e in engines]
    rows = [(p, ["refused" if found.get(p) else "**let through**" for found in probes]) for p in probes[0]]
    out.append(
        table(f"Invalid documents (one broken keyword each): does the mask refuse them? ({vocab})", engines, rows)
    )
    gil = [next((r["gil"] for r in summary[e].values() if "gil" in r), None) for e in engines]
    rows = [("requires", [", ".join(info[e]["requires"]) or "nothing" for e in engines])]
    rows += [("installed MB", [str(info[e]["installed_mb"]) for e in engines])]
    rows += [
        (
            "import, ms (what it imports)",
            [f"{info[e]['import_ms']} ({', '.join(info[e]['imports']) or '-'})" for e in engines],
        )
    ]
    rows += [("a Python thread's longest stall during compiles (issue, last vocab), ms", [gil_cell(g) for g in gil])]
    return "\n".join(out + [table("Packages", engines, rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the raw numbers")
    parser.add_argument("--engines", default="xgrammar,llguidance,outlines-core,llguidance-executor")
    parser.add_argument("--rounds", type=int, default=3, help="engine order reversed every other round")
    parser.add_argument("--reps", type=int, default=5, help="compiles per case and round")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per walk")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 32])
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    all_cases = cases()
    vocabs = {"vocab 4k (bundled)": Tokenizer.from_file(str(BUNDLED)), "vocab 49k (trained BPE)": trained_tokenizer()}
    engines, info = {}, {}
    for name in args.engines.split(","):
        try:
            engines[name] = ENGINES[name]()
            info[name] = package_info(engines[name])
        except Exception as exc:  # one that cannot be installed or imported is reported; the others run
            info[name] = failed(exc)
            log.warning("%s unavailable: %s", name, info[name]["error"])
    rounds, load, (first_vocab, *_, last_vocab) = [], [os.getloadavg()], vocabs
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        log.info("round %d: %s (load average %s)", r + 1, ", ".join(order), os.getloadavg())
        once = r == 0
        rounds.append(
            {
                e: {
                    v: measure_vocab(
                        engines[e], t, all_cases, args, once and v == first_vocab, once and v == last_vocab
                    )
                    for v, t in vocabs.items()
                }
                for e in order
            }
        )
        load.append(os.getloadavg())
    applied = apply_costs(vocabs, args.batches) if "xgrammar" in engines else {}
    summary = {e: combine([r[e] for r in rounds]) for e in engines}
    print(render_speed(summary, info, applied) + render_support(summary, info))
    host = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    host |= {"cpus": os.cpu_count(), "loadavg_before_and_after_each_round": load}
    raw = {"args": vars(args) | {"out": str(args.out)}, "host": host, "packages": info, "features": FEATURES}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    raw |= {"summary": summary, "apply_us": applied, "rounds": rounds}
    args.out.write_text(json.dumps(raw, indent=1))
    log.info("raw numbers in %s", args.out)


if __name__ == "__main__":
    main()
