"""The model a replica serves when given none: the small Python model shipped inside the package
(bench/train_default_model.py trains it), found beside this module, so that it is there in a checkout and in an
installed wheel alike."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parent / "bundled" / "zq-python-tiny"


def default_model() -> Path:
    """The bundled model's directory; FileNotFoundError saying what to do when it is not there."""
    if not (BUNDLED_MODEL / "config.json").exists():
        raise FileNotFoundError(
            f"the bundled model is not at {BUNDLED_MODEL} (train it with bench/train_default_model.py), so pass "
            "--model DIR"
        )
    return BUNDLED_MODEL
