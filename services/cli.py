"""The `zeroqueue` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli_billing import add_billing_commands
from services.cli_quantize import add_quantize
from services.cli_serve import add_serve
from services.logs import configure_logging
from services.pulse.cli import add_pulse


def add_health(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="check a replica's gRPC health; exit 0 SERVING, 1 NOT_SERVING, 2 unreachable")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--service", default="zeroqueue.inference.v1.Inference")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--tls-ca", metavar="PEM", default=None, help="check over TLS, trusting these CA certificates")
    p.set_defaults(run=run_health)


def run_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if args.tls_ca:
        channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as error:
            print(f"{args.address} {args.service or '(server)'}: {error.code().name}", file=sys.stderr)
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroqueue", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    add_serve(sub)
    add_health(sub)
    add_billing_commands(sub)
    add_pulse(sub)
    add_quantize(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "json_logs", False))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
