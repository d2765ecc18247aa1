"""``nbos agent``: the daemon of one host, in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

import anyio
import msgspec

from nbos.agent import AgentConfig, run_until_signalled
from nbos.core.config import Settings
from nbos.core.errors import ConfigError
from nbos.core.private_files import keep_private


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "agent",
        help="run the agent of one host: its GPUs and replica processes, for the gateway",
        description="Serve this host's GPUs and replica processes to the gateway over ZeroMQ "
        "(CURVE with --keys) until SIGINT or SIGTERM. Replicas keep running when the agent "
        "stops; an agent started again with the same --state-dir takes them back. "
        "[agent] settings (--config, NBOS_AGENT__*) run them as local processes or as "
        "containers on this host's Docker engine. See docs/deploy.md.",
    )
    parser.add_argument("--host", required=True, help="this host's name (as in nbos keys)")
    parser.add_argument(
        "--address",
        required=True,
        metavar="HOST:PORT",
        help="where the gateway reaches this agent (bound as given; port 0 picks one); "
        "auto:PORT: this machine's address on its route to the gateway (a Swarm service's "
        "node address)",
    )
    parser.add_argument("--gateway", required=True, metavar="HOST:PORT", help="the gateway")
    parser.add_argument(
        "--state-dir",
        required=True,
        type=Path,
        help="where the agent records its replicas (and their logs) across restarts",
    )
    parser.add_argument(
        "--keys",
        type=Path,
        metavar="DIR",
        help="key directory from nbos keys (needs hosts/HOST.key_secret and gateway.key); "
        "without it the links are plain TCP",
    )
    parser.add_argument(
        "--join-token-file",
        type=Path,
        metavar="FILE",
        help="join with the cluster's token from nbos keys DIR --join-token instead of --keys: "
        "the agent makes its own key pair in --state-dir (default: [agent] join_token_file)",
    )
    parser.add_argument(
        "--join-address",
        default="",
        metavar="HOST:PORT",
        help="the gateway's join endpoint (default: --gateway's host, the port after its)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="without --keys, listen on an address other than loopback all the same: whoever "
        "reaches it may start any process as this agent's user (a private test network only)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="N virtual GPUs (default: NVML's GPUs, or [cluster] gpus_per_host virtual ones "
        "where NVML finds none)",
    )
    parser.add_argument(
        "--agent-settings",
        type=Path,
        metavar="FILE",
        help="take the [agent] table of FILE as it is, NBOS_AGENT__* variables not applied "
        "(a gateway hands the agents it starts its own table this way)",
    )
    parser.add_argument(
        "--heartbeat", type=float, default=1.0, metavar="S", help="report interval (default: 1)"
    )
    parser.add_argument(
        "--stop-replicas-on-exit",
        action="store_true",
        help="stop this host's replicas when the agent stops (default: leave them running)",
    )
    parser.set_defaults(func=agent_command)


def agent_command(args: argparse.Namespace) -> int:
    settings = Settings.load(args.config)
    agent = settings.agent
    if args.agent_settings is not None:
        agent = Settings.load(args.agent_settings, env={}).agent
    if args.join_token_file is not None:
        agent = msgspec.structs.replace(agent, join_token_file=str(args.join_token_file))
    config = AgentConfig(
        host_id=args.host,
        address=route_address(args.address, args.gateway),
        gateway_address=args.gateway,
        state_dir=args.state_dir,
        keys=args.keys,
        virtual_gpus=args.gpus,
        fallback_gpus=settings.cluster.gpus_per_host,
        virtual_memory_mib=settings.cluster.gpu_memory_mib,
        heartbeat_interval=args.heartbeat,
        stop_replicas_on_exit=args.stop_replicas_on_exit,
        insecure=args.insecure,
        join_address=args.join_address,
        settings=agent,
    )
    keep_private()
    anyio.run(run_until_signalled, config)
    return 0


def route_address(address: str, gateway: str) -> str:
    """``address``, or for ``auto:PORT`` the local address this machine's routes use to
    reach ``gateway`` (one agent command for every node of a Swarm service)."""
    host, _, port = address.rpartition(":")
    if host != "auto":
        return address
    gateway_host = gateway.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        family = socket.getaddrinfo(gateway_host, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((gateway_host, 9))  # a datagram socket's connect sends nothing
            local: str = probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError("address", address, f"a route to the gateway {gateway} ({exc})") from exc
    return f"[{local}]:{port}" if ":" in local else f"{local}:{port}"
