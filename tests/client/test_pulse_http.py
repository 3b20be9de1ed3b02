"""`zeroqueue pulse --http` and `--doors grpc,http` end to end: fake replicas answer gRPC (ListModels, and Generate
for the gRPC door) and a fake HTTP door answers /v1/completions, so the same seeded schedule goes through each."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from services.cli import main
from services.pulse import cli as pulse_cli
from services.pulse import replicas
from tests.client.fake_http_door import FakeHttpDoor, Refuse
from tests.client.fakes import FakeReplicas

SCHEDULE = ["--qps", "10", "--duration", "2", "--arrival", "constant", "--prompt-tokens", "5", "--max-tokens", "2"]


def pulse(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out"
    assert main(["pulse", "--api-key", "k", *SCHEDULE, "--out", str(out), "--no-progress", "--no-plots", *args]) == 0
    return json.loads((out / "pulse.json").read_text())


def test_http_sends_the_schedule_through_the_door(tmp_path, capsys):
    # the first call refused with a hint (its retry completed), the second infeasible, whichever reaches the door
    # first: on a loaded host the schedule's second call may come before the first's retry
    script = [Refuse(hint_ms=20), Refuse(400, "DEADLINE_INFEASIBLE", None, should_retry=False)]
    with FakeReplicas([[]]) as fakes, FakeHttpDoor(script, retries_complete=True) as door:
        doc = pulse(tmp_path, "--endpoint", fakes.addresses[0], "--http-endpoint", door.url, "--http")
        grpc_calls, seen = fakes[0].calls, door.seen
    assert grpc_calls == []  # only ListModels went over gRPC
    run = doc["runs"]["run-http"]
    assert run["door"] == "http" and run["endpoints"] == [door.url] and doc["config"]["doors"] == ["http"]
    summary = run["summary"]
    assert summary["num_sent"] == 20 and len(seen) == 21  # one hinted retry
    assert summary["outcomes"] == {"ok": 19, "infeasible": 1}
    assert summary["rejection_rate"] == 1 / 20 and summary["first_retry_success_rate"] == 1.0
    assert summary["ttft_ms"]["count"] == 0 and summary["admitted_latency_ms"]["count"] == 19
    assert all(s.path == "/v1/completions" and s.headers["authorization"] == "Bearer k" for s in seen)
    assert all(len(s.body["prompt"]) == 5 and s.body["max_tokens"] == 2 and s.body["stream"] is False for s in seen)
    assert all(s.body["temperature"] == 0 and "model" not in s.body for s in seen)
    # the retry, not the next request in arrival order: on a loaded host the schedule's next call may come first
    first = seen[0]
    (retry,) = [s for s in seen if s.headers["x-stainless-retry-count"] != "0"]
    assert retry.headers["x-request-id"] == first.headers["x-request-id"]
    assert (first.headers["x-stainless-retry-count"], retry.headers["x-stainless-retry-count"]) == ("0", "1")
    assert first.headers["x-budget-ms"] == "2000" or int(first.headers["x-budget-ms"]) >= 1990
    assert int(retry.headers["x-budget-ms"]) <= 2000 - 20
    assert len({s.headers["x-request-id"] for s in seen}) == 20
    traces = [json.loads(line) for line in (tmp_path / "out/trace-run-http.jsonl").read_text().splitlines()]
    assert Counter(t["outcome"] for t in traces) == {"ok": 19, "infeasible": 1}
    out, err = capsys.readouterr()
    assert "through http" in out and "HTTP door answers whole" in out and "wrote" in err and "wrote" not in out


def test_doors_put_http_beside_grpc_on_the_same_schedule(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pulse_cli, "SETTLE_S", 0.0)
    with FakeReplicas([[], []]) as fakes, FakeHttpDoor() as deadline_door, FakeHttpDoor() as fifo_door:
        args = ["--compare", "--doors", "grpc,http", "--deadline-endpoint", fakes.addresses[0]]
        args += ["--fifo-endpoint", fakes.addresses[1], "--deadline-http-endpoint", deadline_door.url]
        args += ["--fifo-http-endpoint", fifo_door.url]
        doc = pulse(tmp_path, *args)
        grpc_prompts = [sorted(tuple(c.request.prompt_token_ids) for c in fakes[i].calls) for i in (0, 1)]
        http_prompts = [sorted(tuple(s.body["prompt"]) for s in door.seen) for door in (deadline_door, fifo_door)]
    assert list(doc["runs"]) == ["deadline-grpc", "deadline-http", "fifo-grpc", "fifo-http"]
    assert [run["door"] for run in doc["runs"].values()] == ["grpc", "http"] * 2
    assert grpc_prompts == http_prompts and len(grpc_prompts[0]) == 20  # the same calls through each door
    assert all(run["summary"]["num_in_deadline"] == 20 for run in doc["runs"].values())
    out = capsys.readouterr().out
    table = out[out.index("doors: the same schedule") :]
    assert "1st retry" in table and "retries/" in table and "goodput" in table
    rows = [[cell.strip() for cell in line.split("│")] for line in table.splitlines() if "│" in line]
    assert [row[:2] for row in rows] == [["deadline", "grpc"], ["deadline", "http"], ["fifo", "grpc"], ["fifo", "http"]]
    assert all(row[2] == "10.00" and row[3] == "100.0%" for row in rows)  # goodput and attainment


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--http-endpoint", "http://127.0.0.1:1", "--http"], "--http-endpoint needs --endpoint too"),
        (["--endpoint", "127.0.0.1:1", "--http"], "needs --http-endpoint"),
        (["--http", "--templates", "plain=1,chat=1"], "takes a prompt: no conversation"),
        (["--doors", "grpc,http", "--capacity"], "several doors is for a run or a compare"),
        (["--doors", "grpc", "--http"], "--http and --doors without http disagree"),
    ],
)
def test_what_the_doors_cannot_do_is_refused_first(tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["pulse", "--api-key", "k", "--qps", "1", "--duration", "1", "--out", str(tmp_path), *args])


def test_doors_is_a_list_of_known_doors(capsys):
    with pytest.raises(SystemExit):
        main(["pulse", "--doors", "grpc,smtp"])
    assert "distinct doors out of grpc, http" in capsys.readouterr().err


def test_a_started_replica_serves_its_http_door_on_a_port_of_its_own(tmp_path, monkeypatch):
    started = []

    class FakeProcess:
        returncode = None

        def __init__(self, cmd, stdout, **kwargs):
            started.append(cmd)
            stdout.write("zeroqueue: SERVING\n")
            stdout.flush()

        def poll(self):
            return 0

    monkeypatch.setattr(replicas.subprocess, "Popen", FakeProcess)
    monkeypatch.setattr(replicas, "_listening", lambda port: True)
    replica = replicas.start_replica(Path("model"), "deadline", tmp_path, ["--max-batch", "4"], http=True)
    plain = replicas.start_replica(Path("model"), "fifo", tmp_path)
    cmd = started[0]
    port = cmd[cmd.index("--http-port") + 1]
    assert replica.http_url == f"http://127.0.0.1:{port}" and cmd[-2:] == ["--max-batch", "4"]
    assert plain.http_url == "" and "--http-port" not in started[1]


def test_tenants_and_capacity_go_through_the_http_door_too(tmp_path):
    with FakeReplicas([[]]) as fakes, FakeHttpDoor() as door:
        named = ["--endpoint", fakes.addresses[0], "--http-endpoint", door.url, "--http", "--no-progress"]
        argv = ["pulse", *named, "--tenant", "name=A,key=secret-a,qps=6,class=batch", "--tenant", "name=B,key=kb,qps=4"]
        argv += ["--duration", "1", "--arrival", "constant", "--prompt-tokens", "5", "--max-tokens", "2"]
        assert main([*argv, "--out", str(tmp_path / "tenants")]) == 0
        tenants = Counter((s.headers["authorization"], s.headers.get("x-service-class")) for s in door.seen)
        argv = ["pulse", *named, "--api-key", "k", "--capacity", "--duration", "0.5", "--knee-probes", "1"]
        argv += ["--probe-duration", "0.5", "--confirm-duration", "0", "--prompt-tokens", "3", "--max-tokens", "2"]
        assert main([*argv, "--out", str(tmp_path / "capacity")]) == 0
        grpc_calls, num_seen = fakes[0].calls, len(door.seen)
    assert tenants == {("Bearer secret-a", "batch"): 6, ("Bearer kb", None): 4}
    assert grpc_calls == [] and num_seen > 10  # the capacity's closed loop and its probe, all over HTTP
    assert json.loads((tmp_path / "capacity/capacity.json").read_text())["capacity_qps"] > 0
