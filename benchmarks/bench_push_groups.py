"""make bench-push-groups: a weight push to engines on hosts of their own, a weight group per
engine against groups shared by many, timed and counted in the bytes that leave the learner.

    python benchmarks/bench_push_groups.py [--engines 4,8,16,32] [--group-sizes 1,0] [--mb 32] [--rate-mbit 1000]

Each engine (``rlmesh engine`` on a simulated model of MB of bf16 weights) runs in a network
namespace of its own with its own address, on one Linux bridge with the learner (this process,
on the bridge's address): every host's link out is shaped to ``--rate-mbit`` (tc tbf on the
bridge for the learner, on each namespace's veth for an engine), so bytes take the time they
would on a network of that speed, and the bridge's transmit counter is what left the learner.
For each engine count the engines start once; for each group size (0: all engines in one group)
a ``WeightPusher`` builds its groups and pushes ``--pushes`` times (the first builds the groups),
then the heads of every tensor are read back from every engine. Needs root (CAP_NET_ADMIN) and
iproute2. Results go to runs/bench-push-groups/; docs/scale.md has the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from rlmesh.engine.client import EngineClient
from rlmesh.engine.simulated import SimulatedModel, SimulationSpec, write_simulated_model
from rlmesh.learner.weight_sync.push import PushReport, WeightPusher
from rlmesh.runtime.health import http_ok
from rlmesh.runtime.launcher import ProcessLauncher

TOKEN_ENV = "RLMESH_AUTH_TOKEN"


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SystemExit(
            f"`ip {' '.join(args)}` failed ({done.stderr.strip()}): this benchmark needs root and iproute2"
        )


def shape(device: str, rate_mbit: int, netns: str | None = None) -> None:
    """Caps what ``device`` sends at ``rate_mbit`` (a token bucket of 1 MB: whole TCP segments pass)."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    argv = [*prefix, "tc", "qdisc", "replace", "dev", device, "root", "tbf"]
    argv += ["rate", f"{rate_mbit}mbit", "burst", "1mb", "latency", "500ms"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


@dataclass
class Hosts:
    bridge: str
    learner_ip: str
    namespaces: list[str]
    addresses: list[str]

    def bytes_out_of_learner(self) -> int:
        return int(Path(f"/sys/class/net/{self.bridge}/statistics/tx_bytes").read_text())


@contextlib.contextmanager
def hosts(count: int, rate_mbit: int) -> Iterator[Hosts]:
    """A bridge with the learner's address and ``count`` namespaces on it, each link shaped."""
    uid = uuid.uuid4().hex[:6]
    subnet = f"10.216.{int(uid[:2], 16) % 250 + 1}"
    bridge = f"rpb{uid}"
    made: list[str] = []
    links: list[str] = []
    try:
        ip("link", "add", bridge, "type", "bridge")
        links.append(bridge)
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        shape(bridge, rate_mbit)
        addresses = []
        for i in range(count):
            ns, outer, inner = f"rpg{uid}-{i}", f"rph{uid}{i}", f"rpn{uid}{i}"
            ip("netns", "add", ns)
            made.append(ns)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            links.append(outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "master", bridge)
            ip("link", "set", outer, "up")
            address = f"{subnet}.{i + 2}"
            for args in (
                ("addr", "add", f"{address}/24", "dev", inner),
                ("link", "set", inner, "up"),
                ("link", "set", "lo", "up"),
            ):
                ip("netns", "exec", ns, "ip", *args)
            shape(inner, rate_mbit, ns)
            addresses.append(address)
        learner = (None, f"{subnet}.1", bridge)
        engines = [(ns, a, f"rpn{uid}{i}") for i, (ns, a) in enumerate(zip(made, addresses, strict=True))]
        static_neighbours([learner, *engines])
        yield Hosts(bridge, f"{subnet}.1", made, addresses)
    finally:
        for link in reversed(links):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def static_neighbours(hosts_: list[tuple[str | None, str, str]]) -> None:
    """Every host (namespace or None for this one, address, device) knows every other's MAC: real
    hosts have theirs cached, and 33 hosts resolving 32 peers at once (a group's full mesh) flood
    the bridge with broadcasts that it drops, failing a connection with "No route to host"."""
    macs = {}
    for ns, address, device in hosts_:
        prefix = ["-n", ns] if ns else []
        shown = subprocess.run(
            ["ip", *prefix, "-j", "link", "show", "dev", device], capture_output=True, text=True, timeout=30
        )
        macs[address] = json.loads(shown.stdout)[0]["address"]
    for ns, own, device in hosts_:
        lines = "".join(
            f"neigh replace {address} lladdr {mac} dev {device} nud permanent\n"
            for address, mac in macs.items()
            if address != own
        )
        prefix = ["-n", ns] if ns else []
        done = subprocess.run(
            ["ip", *prefix, "-batch", "-"], input=lines, capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            raise SystemExit(f"static neighbours in {ns or 'this namespace'} failed: {done.stderr.strip()}")


def start_engines(launcher: ProcessLauncher, net: Hosts, model_dir: Path, token: str) -> list[str]:
    """One engine per namespace, all started before any is waited for; returns their URLs."""
    started = []
    for i, (ns, address) in enumerate(zip(net.namespaces, net.addresses, strict=True)):
        ready_file = launcher.workdir / f"engine-{ns}.ready.json"
        ready_file.unlink(missing_ok=True)
        argv = [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "rlmesh.cli",
            "engine",
            "--model-path",
            str(model_dir),
        ]
        argv += ["--host", address, "--port", "0", "--ready-file", str(ready_file)]
        argv += ["--json-model-override-args", json.dumps({"seed": i})]
        proc = launcher.spawn(f"engine-{i}", argv, {TOKEN_ENV: token})
        started.append((proc, ready_file, address))

    def ready_check(ready_file: Path, address: str):
        def ready() -> bool:
            if not ready_file.exists():
                return False
            port = json.loads(ready_file.read_text())["port"]
            return http_ok(f"http://{address}:{port}/health")

        return ready

    launcher.wait_all_ready([(proc, ready_check(f, a), 300.0, ()) for proc, f, a in started])
    return [f"http://{a}:{json.loads(f.read_text())['port']}" for _, f, a in started]


async def pushes(
    urls: list[str],
    net: Hosts,
    token: str,
    weights: dict[str, torch.Tensor],
    group_size: int,
    times: int,
    load_format: str | None,
) -> list[dict[str, Any]]:
    clients = [EngineClient(u, name=f"engine-{i}", timeout_s=600, token=token) for i, u in enumerate(urls)]
    pusher = WeightPusher(
        clients,
        backend="gloo",
        master_address=net.learner_ip,
        timeout_s=600,
        bucket_bytes=512 << 20,
        load_format=load_format,
        group_size=group_size,
    )
    rows = []

    def before_push() -> int:
        return net.bytes_out_of_learner()

    def after_push(version: int, seconds: float, report: PushReport, before: int) -> None:
        rows.append(
            {
                "seconds": seconds,
                "bytes_out": net.bytes_out_of_learner() - before,
                "bytes": report.bytes_per_engine,
            }
        )
        print(
            f"  group size {group_size}: push {version} {seconds:.2f} s, {rows[-1]['bytes_out'] / 1e6:,.0f} MB out of the learner",
            flush=True,
        )

    await timed_pushes(pusher, clients, weights, times, after_push, before_push)
    return rows


async def timed_pushes(
    pusher: WeightPusher,
    clients: list[EngineClient],
    weights: dict[str, torch.Tensor],
    times: int,
    after_push: Callable[[int, float, PushReport, Any], None],
    before_push: Callable[[], Any] = lambda: None,
) -> None:
    """Pushes ``weights`` to every engine ``times`` times, each timed (``after_push(version,
    seconds, report, what before_push() returned)``), then reads the head of every tensor back from
    every engine; stops at the first push that missed an engine. Closes the pusher and clients."""
    try:
        for version in range(1, times + 1):
            before = before_push()
            t0 = time.perf_counter()
            report = await pusher.push(weights.items(), version=version)
            seconds = time.perf_counter() - t0
            if report.failed or len(report.engines) != len(clients):
                raise SystemExit(f"push {version} to {len(clients)} engines failed on {report.failed}")
            after_push(version, seconds, report, before)
        mismatches = await pusher.verify(weights)
        if any(mismatches.values()):
            raise SystemExit(f"engines hold other weights than pushed: {mismatches}")
    finally:
        await pusher.close()
        for c in clients:
            await c.aclose()


def point(
    launcher: ProcessLauncher, root: Path, engines: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    spec = SimulationSpec(
        weight_bytes=args.mb << 20, tensor_bytes=args.tensor_mb << 20, weight_dtype="bfloat16"
    )
    model_dir = write_simulated_model(root / f"sim-{args.mb}mb", spec)
    weights = {n: torch.randn(p.shape).to(p.dtype) for n, p in SimulatedModel(spec).named_parameters()}
    token = secrets.token_hex(16)
    results = []
    with hosts(engines, args.rate_mbit) as net:
        print(f"{engines} engines on hosts of their own, links at {args.rate_mbit} Mbit/s", flush=True)
        urls = start_engines(launcher, net, model_dir, token)
        try:
            for size in args.group_sizes:
                group_size = size or engines
                load_format = None if args.load_format == "per_tensor" else args.load_format
                rows = asyncio.run(pushes(urls, net, token, weights, group_size, args.pushes, load_format))
                warm = min(rows[1:], key=lambda r: r["seconds"])
                results.append(
                    {
                        "engines": engines,
                        "group_size": group_size,
                        "weight_bytes": rows[0]["bytes"],
                        "rate_mbit": args.rate_mbit,
                        "load_format": args.load_format,
                        "tensor_mb": args.tensor_mb,
                        "first_push_s": rows[0]["seconds"],
                        "push_s": warm["seconds"],
                        "bytes_out": warm["bytes_out"],
                        "copies_out": warm["bytes_out"] / rows[0]["bytes"],
                    }
                )
        finally:
            for proc in list(launcher.processes):
                launcher.stop(proc)
    return results


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| engines | group size | first push s (groups built) | push s (warm) | MB out of the learner | copies out | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    per_engine = {r["engines"]: r["push_s"] for r in rows if r["group_size"] == 1}
    for r in rows:
        base = per_engine.get(r["engines"])
        speedup = f"{base / r['push_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['engines']} | {r['group_size']} | {r['first_push_s']:.2f} | {r['push_s']:.2f} | "
            f"{r['bytes_out'] / 1e6:,.0f} | {r['copies_out']:.1f} | {speedup} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 32])
    p.add_argument(
        "--group-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 0],
        help="0: all engines in one group",
    )
    p.add_argument("--mb", type=int, default=32, help="MB of bf16 weights")
    p.add_argument("--rate-mbit", type=int, default=1000, help="every host's link out, Mbit/s")
    p.add_argument("--tensor-mb", type=int, default=16, help="the weights' tensors are at most this big")
    p.add_argument(
        "--load-format",
        choices=["flattened_bucket", "per_tensor", "auto"],
        default="flattened_bucket",
        help="per_tensor: one broadcast per tensor, all queued at once; auto: per_tensor to a shared group, "
        "else flattened_bucket (rlmesh.weight_sync.load_format)",
    )
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/bench-push-groups"))
    args = p.parse_args(argv)
    if args.pushes < 2:
        p.error("--pushes must be at least 2: the first builds the groups")
    if os.geteuid() != 0:
        raise SystemExit("bench-push-groups makes network namespaces: run it as root (CAP_NET_ADMIN)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with ProcessLauncher(args.out / "work", stop_grace_s=10) as launcher:
        for engines in args.engines:
            rows += point(launcher, args.out, engines, args)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print(f"results: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
