"""`zeroqueue pulse` end to end against fake replicas: schedule, SDK, report, JSON, traces and plots."""

from __future__ import annotations

import json

import grpc

from services.cli import main
from tests.client.fakes import Fail, FakeReplicas, Reject, Serve


def test_pulse_against_named_endpoints_writes_its_report(tmp_path, capsys):
    script = [Reject(20), Serve(), Fail(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_INFEASIBLE")] + [Serve()] * 50
    with FakeReplicas([script]) as fakes:
        code = main(
            [
                "pulse",
                "--endpoint",
                fakes.addresses[0],
                "--api-key",
                "k",
                "--qps",
                "10",
                "--duration",
                "2",
                "--arrival",
                "constant",
                "--prompt-tokens",
                "5",
                "--max-tokens",
                "2",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        calls = fakes[0].calls
    assert code == 0
    doc = json.loads((tmp_path / "pulse.json").read_text())
    summary = doc["runs"]["run"]["summary"]
    assert summary["num_sent"] == 20 and len(calls) == 21  # one hinted retry
    assert summary["outcomes"] == {"ok": 19, "infeasible": 1}
    assert summary["rejection_rate"] == 1 / 20 and summary["first_retry_success_rate"] == 1.0
    assert doc["config"]["load"]["qps"] == 10 and sum(doc["runs"]["run"]["time_series"]["arrivals"]) == 20
    assert all(len(c.request.prompt_token_ids) == 5 and c.request.max_tokens == 2 for c in calls)
    assert len({c.request.request_id for c in calls}) == 20
    assert len((tmp_path / "trace-run.jsonl").read_text().splitlines()) == 20
    assert all((tmp_path / name).stat().st_size > 0 for name in ("latency.png", "scatter.png", "timeseries.png"))
    assert "first-retry success" in capsys.readouterr().out


def test_capacity_against_a_named_endpoint_writes_capacity_json(tmp_path):
    with FakeReplicas([[]]) as fakes:
        code = main(
            [
                "pulse",
                "--capacity",
                "--endpoint",
                fakes.addresses[0],
                "--api-key",
                "k",
                "--duration",
                "0.5",
                "--knee-probes",
                "1",
                "--probe-duration",
                "0.5",
                "--confirm-duration",
                "0",
                "--prompt-tokens",
                "3",
                "--max-tokens",
                "2",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
    assert code == 0
    doc = json.loads((tmp_path / "capacity.json").read_text())
    assert doc["concurrency"] == 4  # the fake's max_batch: one closed-loop caller per slot
    assert doc["saturation_qps"] > 0 and doc["capacity_qps"] == doc["saturation_qps"] / 2  # the one probe passed
    assert len(doc["probes"]) == 1 and doc["confirmations"] == [] and doc["confirmed"] is None


def test_pulse_with_one_attempt_makes_no_retries(tmp_path):
    script = [Reject(20), Serve(), Fail(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_INFEASIBLE")] + [Serve()] * 50
    with FakeReplicas([script]) as fakes:
        args = ["pulse", "--endpoint", fakes.addresses[0], "--api-key", "k", "--qps", "10", "--duration", "2"]
        args += ["--arrival", "constant", "--max-attempts", "1", "--out", str(tmp_path), "--no-progress", "--no-plots"]
        assert main(args) == 0
        calls = fakes[0].calls
    summary = json.loads((tmp_path / "pulse.json").read_text())["runs"]["run"]["summary"]
    assert len(calls) == summary["num_sent"] == 20  # the refused call was not tried again
    assert summary["outcomes"] == {"ok": 18, "rejected": 1, "infeasible": 1}


def test_a_started_replica_gets_a_private_data_dir_so_nothing_warns(tmp_path, monkeypatch):
    """start_replica makes the replica's directory 0700 (narrowing one a run before left wider), so neither pulse
    nor the replica finds its ledger's directory open to others (the README's tour printed that warning)."""
    from structlog.testing import capture_logs

    from services.pulse import replicas

    class StartedAndServing:
        def __init__(self, cmd, stdout, **_kwargs):
            stdout.write("zeroqueue: SERVING on 127.0.0.1:1\n")
            stdout.flush()
            self.cmd, self.returncode = cmd, None

        def poll(self):
            return self.returncode

    monkeypatch.setattr(replicas.subprocess, "Popen", StartedAndServing)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "replica-deadline").mkdir(mode=0o755)
    (out_dir / "replica-deadline").chmod(0o755)  # as an earlier version of pulse left it
    with capture_logs() as logs:
        replica = replicas.start_replica(tmp_path / "model", "deadline", out_dir, timeout_s=30)
        replicas.start_replica(tmp_path / "model", "fifo", out_dir, timeout_s=30)
    for name in ("replica-deadline", "replica-fifo"):
        assert (out_dir / name).stat().st_mode & 0o777 == 0o700
    assert "directory_open_to_others" not in [entry["event"] for entry in logs]
    assert replica.log_path.parent == out_dir / "replica-deadline"
