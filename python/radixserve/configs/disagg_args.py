"""ServerArgs' prefill/decode disaggregation flags and their checks (docs/disaggregation.md), kept
apart from server_args.py so that file stays readable. `args` is the ServerArgs being validated."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.configs.arg_field import arg_field

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_TRANSFER_BACKENDS = ("tcp", "fake", "mooncake")

# ServerArgs' disaggregation fields (server_args.py declares each under the same name).
disaggregation_mode = arg_field(
    "null",
    "'prefill' or 'decode' to run one half of a disaggregated pair (a load balancer such as "
    "sglang-router --pd-disaggregation sends each request to both); 'null' serves both phases.",
    choices=DISAGGREGATION_MODES,
)
disaggregation_bootstrap_port = arg_field(
    8998, "Prefill server: port of its bootstrap server, where decode servers look up its KV sender."
)
disaggregation_transfer_backend = arg_field(
    "tcp",
    "How KV moves from prefill to decode: 'tcp' (built in: ZMQ over TCP, CPU or GPU, across "
    "machines), 'mooncake' (the KV bytes by Mooncake's TransferEngine over its TCP transport; "
    "needs mooncake-transfer-engine-non-cuda) or 'fake' (moves nothing: warm-up and health "
    "probes only).",
    choices=DISAGGREGATION_TRANSFER_BACKENDS,
)
disaggregation_bootstrap_timeout = arg_field(
    300.0,
    "Seconds a disaggregated request may wait for its peer (to bootstrap, then to deliver or "
    "acknowledge its KV) before it fails with an error and its KV is freed.",
)


def validate_disaggregation(args: ServerArgs) -> None:
    if not 0 < args.disaggregation_bootstrap_port < 65536:
        raise ValueError(
            f"--disaggregation-bootstrap-port must be a TCP port, got {args.disaggregation_bootstrap_port}"
        )
    if args.disaggregation_bootstrap_timeout <= 0:
        raise ValueError("--disaggregation-bootstrap-timeout must be > 0")
    if args.disaggregation_mode != "null" and args.is_embedding:
        raise ValueError("--disaggregation-mode applies to generation; drop it with --is-embedding")
    if args.disaggregation_mode != "null" and (args.pp_size > 1 or args.nnodes > 1):
        raise ValueError(
            "--disaggregation-mode runs with --pp-size 1 and --nnodes 1 for now "
            "(any --tp-size and --dp-size; docs/disaggregation.md)"
        )
