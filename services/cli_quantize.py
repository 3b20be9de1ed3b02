"""`zeroqueue quantize`: an ordinary checkpoint -> a pre-quantized int8 one (services/inference/device/
int8_checkpoint.py), which a replica serves as `--quantize int8` on the original, without the original. Its stdout is
the new directory's path; what went wrong goes to stderr with exit status 2."""

from __future__ import annotations

import argparse
import sys


def add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize", help="write an int8 copy of a checkpoint (compressed-tensors int-quantized, per output channel)"
    )
    p.add_argument("model", metavar="MODEL_DIR", help="a Hugging Face checkpoint directory zeroqueue serves")
    p.add_argument("out", metavar="OUT_DIR", help="the new directory (must not exist)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the dtype it will be served in: the weights are quantized from their values in it, and the rest saved "
        "in it (auto: the checkpoint's)",
    )
    p.set_defaults(run=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    from services.inference.device.checkpoint import CheckpointError
    from services.inference.device.int8_writer import write_int8_checkpoint

    try:
        out = write_int8_checkpoint(args.model, args.out, args.dtype)
    except (CheckpointError, FileExistsError, OSError) as exc:
        print(f"zeroqueue quantize: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
