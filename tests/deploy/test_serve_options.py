"""`zeroqueue serve`'s device and admission options, as the replica's config receives them, and its default model."""

from __future__ import annotations

from pathlib import Path

import pytest

import services
from services.cli import build_parser
from services.cli_serve import serve_config
from services.inference.device.checkpoint import read_header
from services.inference.health.faults import Fault, FaultKind
from services.inference.health.watchdog import WatchdogConfig


def config(*options: str):
    return serve_config(build_parser().parse_args(["serve", "--model", "m", *options]))


def test_the_defaults_watch_the_device_inject_nothing_and_reserve_a_slot_per_slot():
    default = config()
    assert default.watchdog == WatchdogConfig() and default.fault is None
    assert default.device_recovery_s == 60.0 and default.max_reservations is None


def test_the_options_reach_the_config():
    chosen = config(
        "--watchdog-period-ms",
        "50",
        "--device-hang-ms",
        "300",
        "--device-recovery-s",
        "5",
        "--inject-fault",
        "hang,after=5,for=3",
        "--max-reservations",
        "0",
    )
    assert chosen.watchdog == WatchdogConfig(period_s=0.05, min_allowance_s=0.3)
    assert chosen.fault == Fault(FaultKind.HANG, after_s=5.0, for_s=3.0)
    assert chosen.device_recovery_s == 5.0 and chosen.max_reservations == 0
    assert config("--watchdog-period-ms", "0").watchdog is None


def test_a_replica_is_alone_unless_told_it_has_others_beside_it():
    """`--elsewhere` (several replicas behind one address or balancer) reaches admission's settings, as `--hold`
    does; without it the replica is alone, and saturation never points its callers at a replica that is not there."""
    alone, with_others = config(), config("--elsewhere", "--hold")
    assert not alone.elsewhere and not alone.admission_settings().elsewhere
    assert with_others.elsewhere and with_others.admission_settings().elsewhere
    assert with_others.admission_settings().hold_in_slack and not alone.admission_settings().hold_in_slack
    assert not config("--elsewhere", "--no-elsewhere").admission_settings().elsewhere
    assert alone.admission_settings().hold_for_prompts  # a burst's prompts are admitted behind those ahead
    assert not config("--no-hold-prompts").admission_settings().hold_for_prompts
    assert alone.admission_settings().hold_for_blocks  # a call whose KV blocks free in its slack is held for them
    assert not config("--no-hold-blocks").admission_settings().hold_for_blocks


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--inject-fault", "melt"], "fault kind 'melt'"),
        (["--max-reservations", "-1"], "must be 0 or more"),
        (["--watchdog-period-ms", "-5"], "must be 0 or more"),
    ],
)
def test_bad_options_are_refused_by_name(option, says, capsys):
    with pytest.raises(SystemExit) as exited:
        config(*option)
    assert exited.value.code == 2 and says in capsys.readouterr().err


def test_without_model_it_serves_the_bundled_model_found_beside_the_package():
    """A pip user's first `zeroqueue serve` names no model: the default is the directory shipped inside the
    package (found from the module's path, so in site-packages too), and it is a checkpoint the server can read."""
    model_dir = Path(serve_config(build_parser().parse_args(["serve"])).model_dir)
    assert model_dir == Path(services.__file__).resolve().parent / "inference" / "bundled" / "zq-python-tiny"
    card = read_header(model_dir)
    assert card.name == "zq-python-tiny" and card.args.vocab_size > 0 and card.eos_token_ids
