"""pulse's chat and constrained calls: request templates read from --templates and --request-file, drawn by weight
into a seeded plan, the report split by kind of call, and a run against a fake replica that sends all of them."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from services.cli import main
from services.client import Message, ModelInfo
from services.pulse.report import RunReport, print_table
from services.pulse.schedule import LoadSpec, ShapeSpec, plan
from services.pulse.stats import RequestTrace, summarize, summarize_by_kind
from services.pulse.templates import BUILT_INS, check_served, parse_templates, read_request_file
from tests.client.fakes import FakeReplicas

LINES = [
    {"messages": [{"role": "user", "content": "parse argv"}], "max_tokens": 24, "weight": 2},
    {"prompt": "config = ", "response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 2},
    {
        "messages": [{"role": "system", "content": "Helpers."}, {"role": "user", "content": "a parser"}],
        "response_format": {"type": "regex", "regex": "def [a-z]+"},
        "deadline_ms": 3000,
        "temperature": 0.8,
    },
    {"weight": 0.5},
]


def write_lines(path: Path, docs: list, blank: bool = True) -> str:
    text = "\n".join(json.dumps(d) for d in docs)
    path.write_text(("\n" + text + "\n\n") if blank else text)
    return str(path)


def test_a_request_file_reads_each_line_as_a_template_of_its_kind(tmp_path):
    chat, constrained, both, plain = read_request_file(write_lines(tmp_path / "calls.jsonl", LINES))
    assert [t.kind for t in (chat, constrained, both, plain)] == ["chat", "constrained", "chat_constrained", "plain"]
    assert chat.messages == (Message("user", "parse argv"),) and chat.max_tokens == 24 and chat.weight == 2
    assert chat.name.endswith("calls.jsonl:2")  # the blank first line counts
    assert constrained.call((5, 6)) == {
        "prompt": "config = ",
        "messages": None,
        "response_format": {"type": "json_object"},
        "logprobs": True,
        "top_logprobs": 2,
        "temperature": 0.0,
    }
    assert both.deadline_ms == 3000 and both.temperature == 0.8 and both.call((5,))["prompt"] is None
    assert plain.uses_token_ids and plain.call((5, 6))["prompt"] == (5, 6) and plain.weight == 0.5


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"messages": [{"role": "user", "content": "a"}], "prompt": "b"}, "give prompt or messages, not both"),
        ({"promt": "b"}, "unknown field 'promt'"),
        ({"messages": [{"role": "bot", "content": "a"}]}, "messages[0]: role must be one of"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"response_format": {"type": "yaml"}}, "type must be one of"),
        ({"response_format": {"type": "json_schema"}}, "json_schema needs exactly one of"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs needs logprobs"),
        ({"max_tokens": "32"}, "max_tokens has the wrong type"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"logprobs": 1}, "logprobs has the wrong type"),
        ({"weight": 0}, "weight must be a number > 0"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"deadline_ms": -5}, "deadline_ms must be > 0"),
        ([1, 2], "a JSON object"),
    ],
)
def test_a_bad_line_is_refused_naming_its_line_and_field(tmp_path, doc, says):
    path = write_lines(tmp_path / "calls.jsonl", [{"weight": 1}, doc], blank=False)
    with pytest.raises(argparse.ArgumentTypeError, match=rf"calls\.jsonl:2: (.*: )?{re.escape(says)}"):
        read_request_file(path)


def test_a_request_file_that_is_not_json_lines_or_is_empty_is_refused(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"weight": 1}\n{"weight": \n')
    with pytest.raises(argparse.ArgumentTypeError, match="bad.jsonl:2: not JSON"):
        read_request_file(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(argparse.ArgumentTypeError, match="no templates"):
        read_request_file(str(tmp_path / "empty.jsonl"))
    with pytest.raises(argparse.ArgumentTypeError, match="missing.jsonl"):
        read_request_file(str(tmp_path / "missing.jsonl"))


def test_built_ins_are_named_with_weights():
    plain, chat, json_ = parse_templates("plain=2,chat,json=0.5")
    assert (plain.weight, chat.weight, json_.weight) == (2.0, 1.0, 0.5)
    assert [t.kind for t in (plain, chat, json_)] == ["plain", "chat", "constrained"]
    assert BUILT_INS["chat_json"].kind == "chat_constrained" and BUILT_INS["json"].weight == 1.0  # not changed
    for bad, says in (("plain,yaml=1", "no such template"), ("chat,chat", "given twice"), ("json=0", "weight must")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse_templates(bad)


def test_built_in_formats_compile_and_the_chat_renders_on_the_bundled_model():
    """The built-ins are what the server accepts: its grammar engine compiles them for the bundled model's
    vocabulary, and the model's chat template renders the conversation."""
    from tokenizers import Tokenizer

    from services.client.request import response_format_pb
    from services.inference.bundled_model import BUNDLED_MODEL
    from services.inference.chat import ChatMessage, ChatTemplate
    from services.inference.grammar import (
        ConstraintKind,
        GrammarLimits,
        compile_matcher,
        grammar_tokenizer,
        make_constraint,
    )

    model = Path(BUNDLED_MODEL)
    vocabulary = grammar_tokenizer(Tokenizer.from_file(str(model / "tokenizer.json")), [0])
    formats = [t.response_format for t in BUILT_INS.values() if t.response_format is not None]
    assert len(formats) == 3
    for response_format in formats:
        sent = response_format_pb(response_format)
        field = sent.WhichOneof("format")
        constraint = make_constraint(ConstraintKind(field), getattr(sent, field), GrammarLimits())
        assert compile_matcher(vocabulary, constraint, GrammarLimits()).error == ""
    prompt = ChatTemplate.from_dir(model).render([ChatMessage(m.role, m.content) for m in BUILT_INS["chat"].messages])
    assert "# User: Write a function" in prompt and prompt.endswith("\n\n\n")


def test_a_plan_draws_templates_by_weight_seeded_and_keeps_the_plain_calls_of_a_plain_plan():
    load, shape = LoadSpec(qps=400, duration_s=10, seed=3), ShapeSpec("fixed", 12, 8)
    templates = parse_templates("plain=2,chat=1,json=1")
    mixed = plan(load, shape, vocab_size=300, deadline_ms=900, deadline_per_token_ms=10, templates=templates)
    assert mixed == plan(load, shape, vocab_size=300, deadline_ms=900, deadline_per_token_ms=10, templates=templates)
    counts = Counter(r.kind for r in mixed)
    assert len(mixed) > 3_500 and set(counts) == {"plain", "chat", "constrained"}
    assert counts["plain"] / len(mixed) == pytest.approx(0.5, abs=0.03)
    assert counts["chat"] / len(mixed) == pytest.approx(0.25, abs=0.03)
    assert counts["constrained"] / len(mixed) == pytest.approx(0.25, abs=0.03)
    other_seed = plan(LoadSpec(qps=400, duration_s=10, seed=4), shape, 300, 900, templates=templates)
    assert [r.kind for r in other_seed[:200]] != [r.kind for r in mixed[:200]]

    alone = plan(load, shape, vocab_size=300, deadline_ms=900, deadline_per_token_ms=10)
    assert [r.at_s for r in mixed] == [r.at_s for r in alone]
    for m, a in zip(mixed, alone, strict=True):
        if m.kind == "chat":  # a conversation sends no token ids
            assert m.prompt_token_ids == () and m.template.messages
        else:  # plain, and the schema on the plain shape's ids
            assert m.prompt_token_ids == a.prompt_token_ids
        assert (m.max_tokens, m.deadline_ms) == (a.max_tokens, a.deadline_ms) == (8, 980)


def test_a_template_sets_its_own_max_tokens_and_deadline(tmp_path):
    templates = read_request_file(write_lines(tmp_path / "calls.jsonl", [LINES[0], LINES[2]]))
    requests = plan(
        LoadSpec(qps=50, duration_s=2, seed=1), ShapeSpec("fixed", 12, 8), 300, 900, 10, templates=templates
    )
    chat = [r for r in requests if r.kind == "chat"]
    both = [r for r in requests if r.kind == "chat_constrained"]
    assert chat and both
    assert all(r.max_tokens == 24 and r.deadline_ms == 900 + 240 for r in chat)
    assert all(r.max_tokens == 8 and r.deadline_ms == 3000 + 80 for r in both)


def _trace(i: int, kind: str, ok: bool, in_deadline: bool = True, compile_us: int | None = None) -> RequestTrace:
    return RequestTrace(
        index=i,
        planned_s=float(i),
        deadline_ms=1000,
        prompt_tokens=8,
        max_tokens=4,
        sent_s=float(i),
        outcome="ok" if ok else "rejected",
        attempts=[(float(i), "admitted" if ok else "RESOURCE_EXHAUSTED")],
        finished_s=float(i) + (0.5 if in_deadline else 1.5),
        server_deadline_met=in_deadline if ok else None,
        kind=kind,
        compile_us=compile_us,
        finish_reason="stop" if kind != "plain" and ok else ("length" if ok else ""),
    )


def test_the_summary_splits_by_kind_and_the_table_shows_each_kind_beside_plain():
    traces = [
        _trace(0, "plain", True),
        _trace(1, "plain", True),
        _trace(2, "plain", True, in_deadline=False),
        _trace(3, "constrained", True, compile_us=40_000),
        _trace(4, "constrained", True, compile_us=0),
        _trace(5, "chat", False),
        _trace(6, "chat", True),
    ]
    by_kind = summarize_by_kind(list(reversed(traces)), duration_s=10.0)
    assert list(by_kind) == ["plain", "chat", "constrained"]
    assert by_kind["plain"].goodput_rps == pytest.approx(0.2) and by_kind["plain"].admitted_miss_rate == 1 / 3
    assert by_kind["chat"].num_sent == 2 and by_kind["chat"].rejection_rate == 0.5
    assert by_kind["constrained"].compile_ms.count == 1 and by_kind["constrained"].compile_ms.p50 == 40.0
    assert by_kind["constrained"].num_stopped == 2 and by_kind["plain"].num_stopped == 0
    total = summarize(traces, 10.0)
    assert sum(s.goodput_rps for s in by_kind.values()) == pytest.approx(total.goodput_rps)

    console = Console(record=True, width=250)
    print_table([RunReport("deadline", ["e"], total, traces, by_kind=by_kind)], "t", console)
    text = console.export_text()
    assert "by kind of call" in text and "deadline: plain" in text and "deadline: constrained" in text
    attainment = next(line for line in text.splitlines() if "attainment of admitted" in line)
    assert "66.67 %" in attainment and "100.00 %" in attainment
    fifo = [t for t in traces if t.kind == "plain"]
    side_by_side = Console(record=True, width=250)
    runs = [
        RunReport("deadline", ["e"], total, traces, by_kind=by_kind),
        RunReport("fifo", ["e"], summarize(fifo, 10), fifo, by_kind=summarize_by_kind(fifo, 10)),
    ]
    print_table(runs, "t", side_by_side)
    header = next(line for line in side_by_side.export_text().splitlines() if "deadline: plain" in line)
    order = ["deadline: plain", "fifo: plain", "deadline: chat", "fifo: chat", "deadline: constrained"]
    assert [header.index(h) for h in order] == sorted(header.index(h) for h in order)  # each kind's runs together
    plain_only = Console(record=True, width=250)
    plain = [t for t in traces if t.kind == "plain"]
    print_table(
        [RunReport("run", ["e"], summarize(plain, 10), plain, by_kind=summarize_by_kind(plain, 10))], "t", plain_only
    )
    assert "by kind of call" not in plain_only.export_text()


def test_a_model_that_cannot_serve_a_template_is_refused_before_the_run():
    bare = ModelInfo("m", 256, 300, 4, "cpu", True, response_formats=("regex",))
    with pytest.raises(ValueError, match="template chat: model 'm' has no chat template"):
        check_served([BUILT_INS["chat"]], bare)
    with pytest.raises(ValueError, match="serves no json_schema response_format \\(regex\\)"):
        check_served([BUILT_INS["regex"], BUILT_INS["json"]], bare)
    check_served([BUILT_INS["plain"], BUILT_INS["regex"]], bare)


def test_pulse_sends_chat_and_constrained_calls_and_reports_each_kind(tmp_path, capsys):
    request_file = write_lines(tmp_path / "calls.jsonl", [LINES[1]])
    with FakeReplicas([[]]) as fakes:
        args = ["pulse", "--endpoint", fakes.addresses[0], "--api-key", "k", "--qps", "20", "--duration", "2"]
        args += ["--arrival", "constant", "--prompt-tokens", "5", "--max-tokens", "2", "--seed", "2"]
        args += ["--templates", "plain=1,chat=1,chat_json=1", "--request-file", request_file]
        args += ["--out", str(tmp_path / "out"), "--no-progress", "--no-plots"]
        assert main(args) == 0
        calls = fakes[0].calls
    doc = json.loads((tmp_path / "out/pulse.json").read_text())
    run = doc["runs"]["run"]
    kinds = {kind: s["num_sent"] for kind, s in run["by_kind"].items()}
    assert set(kinds) == {"plain", "chat", "constrained", "chat_constrained"} and sum(kinds.values()) == 40
    assert [t["name"] for t in doc["config"]["templates"]] == ["plain", "chat", "chat_json", request_file + ":2"]
    seen = Counter((bool(c.request.messages), c.request.response_format.WhichOneof("format")) for c in calls)
    assert seen == {
        (False, None): kinds["plain"],
        (True, None): kinds["chat"],
        (False, "json_object"): kinds["constrained"],
        (True, "json_schema"): kinds["chat_constrained"],
    }
    assert all(c.request.top_logprobs == 2 for c in calls if c.request.prompt == "config = ")
    assert all(len(c.request.prompt_token_ids) == 5 for c in calls if not c.request.messages and not c.request.prompt)
    traces = [json.loads(line) for line in (tmp_path / "out/trace-run.jsonl").read_text().splitlines()]
    assert Counter(t["kind"] for t in traces) == Counter(kinds)
    assert all(t["compile_us"] == (1500 if t["kind"] in ("constrained", "chat_constrained") else 0) for t in traces)
    assert run["by_kind"]["constrained"]["compile_ms"]["count"] == kinds["constrained"]
    out = capsys.readouterr().out
    assert "by kind of call" in out and "run: chat_constrained" in out and "chat_json 1" in out


def test_capacity_measures_plain_calls_only(tmp_path):
    with pytest.raises(SystemExit, match="--capacity measures plain calls"):
        main(
            [
                "pulse",
                "--capacity",
                "--endpoint",
                "127.0.0.1:1",
                "--api-key",
                "k",
                "--templates",
                "chat",
                "--out",
                str(tmp_path),
            ]
        )
