"""Weight fan-out benchmark: pushing one version to N replicas, direct vs relayed, over 1 Gbit/s links.

Command (from the repository root, as root: it creates network namespaces; about 5 minutes for 400 MB,
1.5 for 100 MB, on 2 cores):

    sudo python bench/weight_fanout.py --size-mb 400 --replicas 1,2,4,8 --modes direct,chain,tree \\
        --repeats 3 --json docs/img/weight_fanout.json --plot docs/img/weight_fanout.png
    python bench/weight_fanout.py --from-json docs/img/weight_fanout.json --plot docs/img/weight_fanout.png

The trainer's publisher and each replica run in their own network namespace, each joined to a
bridge (in a hub namespace) by a veth pair shaped with ``tc tbf`` to ``--rate`` in both directions,
so the trainer's egress is one 1 Gbit/s link too. The replicas are processes that take commands on
stdin. For each N (the first N replicas) and mode, interleaved, ``--repeats`` times:

- ``direct``: every replica ``fetch_weights`` from the publisher at once;
- ``chain`` / ``tree``: ``plan_relay(replicas, fanout=1 / 2)``; each replica starts a
  ``WeightRelay`` on its upstream (the publisher or a peer), in plan order, and waits for all of it.

A push's time runs from the first command to the last replica holding every tensor, checked; the
trainer's egress is the bytes its veth sent during the push. Median of the repeats. ``--json``
writes every measurement; ``--plot`` draws the table from that JSON. The namespaces are removed on
exit, on failure or Ctrl-C included (``ip netns list | grep fwo`` shows leftovers of a killed run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

SUBNET = "10.213.0"
PUBLISHER_PORT = 7000
TIMEOUT_S = 600.0


# -- network namespaces ---------------------------------------------------------------------


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class Network:
    """A hub namespace with a bridge and one namespace per node, each behind a shaped veth pair."""

    def __init__(self, prefix: str, rate: str) -> None:
        self.prefix = prefix
        self.rate = rate
        self.hub = f"{prefix}-hub"
        self.namespaces: list[str] = []
        self._links = 0

    def __enter__(self) -> Network:
        try:
            self._add_namespace(self.hub)
            _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def add_node(self, name: str, host: int) -> tuple[str, str]:
        """A namespace ``prefix-name`` at ``SUBNET.host``; returns (namespace, ip)."""
        ns, ip = f"{self.prefix}-{name}", f"{SUBNET}.{host}"
        self._add_namespace(ns)
        self._links += 1
        hub_end, node_end = f"{self.prefix}a{self._links}", f"{self.prefix}b{self._links}"
        _sh("ip", "link", "add", hub_end, "type", "veth", "peer", "name", node_end)
        _sh("ip", "link", "set", hub_end, "netns", self.hub)
        _sh("ip", "link", "set", node_end, "netns", ns)
        _sh("ip", "-n", self.hub, "link", "set", hub_end, "name", f"v-{name}", "master", "br0", "up")
        _sh("ip", "-n", ns, "link", "set", node_end, "name", "eth0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        for netns, dev in ((ns, "eth0"), (self.hub, f"v-{name}")):  # the node's upload, then its download
            _sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                "burst", "512kb", "latency", "20ms")  # fmt: skip
        return ns, ip

    def sent_bytes(self, name: str) -> int:
        """Bytes the node ``name`` has sent (received by its hub-side veth end)."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.hub, "cat", f"/sys/class/net/v-{name}/statistics/rx_bytes"],
            check=True,
            capture_output=True,
            text=True,
        )
        return int(out.stdout)

    def close(self) -> None:
        for ns in reversed(self.namespaces):  # removing a namespace removes its veth ends
            with suppress(subprocess.CalledProcessError):
                _sh("ip", "netns", "del", ns)
        self.namespaces.clear()


# -- worker processes (one per namespace) -----------------------------------------------------


class Worker:
    """A ``--worker`` process in a namespace, driven by JSON lines on stdin/stdout."""

    def __init__(self, ns: str, role: str) -> None:
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-u", os.path.abspath(__file__), "--worker", role]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (rc {self.proc.poll()})")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"worker failed: {reply.get('error')}")
        return reply

    def stop(self) -> None:
        with suppress(OSError, ValueError):
            self.send(op="exit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _worker_main(role: str) -> None:
    """Serve commands from the orchestrator: publish (publisher), direct / relay / release (replica)."""
    import torch

    from fleetrl.weights import WeightPublisher, WeightRelay, fetch_weights

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from weight_push import transformer_state_dict

    torch.set_num_threads(1)
    out: IO[str] = sys.stdout
    publisher: WeightPublisher | None = None
    relay: WeightRelay | None = None

    def say(**reply: Any) -> None:
        out.write(json.dumps({"ok": True, **reply}) + "\n")
        out.flush()

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "exit":
                break
            if op == "publish":
                publisher = WeightPublisher(command["bind"])
                sd = transformer_state_dict(int(command["size_mb"] * 1e6))
                started = time.monotonic()
                manifest = publisher.publish(1, sd)
                del sd
                say(address=publisher.address, bytes=manifest.total_bytes, publish_s=time.monotonic() - started)
            elif op == "direct":
                started = time.monotonic()
                manifest, tensors = fetch_weights(command["upstream"], 1, timeout_s=TIMEOUT_S)
                assert sum(t.nbytes for t in tensors.values()) == manifest.total_bytes
                del tensors
                say(s=time.monotonic() - started)
            elif op == "relay":
                started = time.monotonic()
                relay = WeightRelay(command["upstream"], 1, bind=command["bind"], timeout_s=TIMEOUT_S)
                say(serving=relay.address)
                manifest, tensors = relay.wait()
                assert sum(t.nbytes for t in tensors.values()) == manifest.total_bytes
                del tensors
                say(s=time.monotonic() - started)
            elif op == "release":
                if relay is not None:
                    relay.close()
                    relay = None
                say()
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # reported to the orchestrator, which stops the run
            out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
            out.flush()
    if relay is not None:
        relay.close()
    if publisher is not None:
        publisher.close()


# -- the benchmark ----------------------------------------------------------------------------


def _push(
    mode: str,
    replicas: Sequence[Worker],
    ips: Sequence[str],
    publisher_address: str,
    port: int,
) -> tuple[float, list[float]]:
    """One push to ``replicas``: wall seconds until all hold it, and each replica's own seconds."""
    from fleetrl.weights import plan_relay

    started = time.monotonic()
    if mode == "direct":
        for worker in replicas:
            worker.send(op="direct", upstream=publisher_address)
    else:
        fanout = {"chain": 1, "tree": 2}[mode]
        plan = plan_relay(list(range(len(replicas))), fanout)
        served: dict[int, str] = {}
        for index, upstream in plan.items():  # upstreams first: each starts once its upstream serves
            address = publisher_address if upstream is None else served[upstream]
            replicas[index].send(op="relay", upstream=address, bind=f"tcp://{ips[index]}:{port}")
            served[index] = replicas[index].reply()["serving"]
    own = [worker.reply()["s"] for worker in replicas]
    elapsed = time.monotonic() - started
    if mode != "direct":
        for worker in replicas:
            worker.send(op="release")
        for worker in replicas:
            worker.reply()
    return elapsed, own


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(n) for n in args.replicas.split(",")]
    modes = args.modes.split(",")
    prefix = f"fwo{os.getpid()}"
    workers: list[Worker] = []
    results: dict[str, Any] = {
        "size_mb": args.size_mb,
        "rate": args.rate,
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.node()}",
        "runs": [],
    }
    with Network(prefix, args.rate) as net:
        pub_ns, pub_ip = net.add_node("pub", 1)
        replica_ips = []
        for i in range(max(counts)):
            ns, ip = net.add_node(f"r{i}", 10 + i)
            replica_ips.append(ip)
            workers.append(Worker(ns, "replica"))
        publisher = Worker(pub_ns, "publisher")
        workers.append(publisher)
        try:
            publisher.send(op="publish", bind=f"tcp://{pub_ip}:{PUBLISHER_PORT}", size_mb=args.size_mb)
            published = publisher.reply()
            results["bytes"] = published["bytes"]
            print(f"published {published['bytes'] / 1e6:.0f} MB in {published['publish_s']:.1f}s", flush=True)
            port = 7100
            for repeat in range(args.repeats):
                for n in counts:
                    order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]  # interleaved
                    for mode in order:
                        port += 1
                        egress = net.sent_bytes("pub")
                        elapsed, own = _push(mode, workers[:n], replica_ips, published["address"], port)
                        egress = net.sent_bytes("pub") - egress
                        run_ = {"n": n, "mode": mode, "repeat": repeat, "s": elapsed, "replica_s": own}
                        run_["trainer_egress_bytes"] = egress
                        results["runs"].append(run_)
                        print(
                            f"N={n} {mode:6s} repeat {repeat}: {elapsed:6.2f}s, trainer egress {egress / 1e6:7.0f} MB",
                            flush=True,
                        )
        finally:
            for worker in workers:
                worker.stop()
    return results


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Median seconds and trainer egress per (N, mode), in the order first measured."""
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run_ in results["runs"]:
        rows.setdefault((run_["n"], run_["mode"]), []).append(run_)
    modes = list(dict.fromkeys(run_["mode"] for run_ in results["runs"]))
    table = []
    for (n, mode), runs in sorted(rows.items(), key=lambda item: (item[0][0], modes.index(item[0][1]))):
        seconds = [r["s"] for r in runs]
        table.append(
            {
                "n": n,
                "mode": mode,
                "median_s": statistics.median(seconds),
                "min_s": min(seconds),
                "max_s": max(seconds),
                "egress_mb": statistics.median(r["trainer_egress_bytes"] for r in runs) / 1e6,
                "aggregate_gbit_s": n * results["bytes"] * 8 / 1e9 / statistics.median(seconds),
            }
        )
    return table


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{results['bytes'] / 1e6:.0f} MB float32, links {results['rate']}, median of {results['repeats']}")
    print("| N | mode | push s (median [min, max]) | trainer egress MB | delivered Gbit/s |")
    print("|---|---|---|---|---|")
    for row in summarize(results):
        print(
            f"| {row['n']} | {row['mode']} | {row['median_s']:.2f} [{row['min_s']:.2f}, {row['max_s']:.2f}] "
            f"| {row['egress_mb']:.0f} | {row['aggregate_gbit_s']:.2f} |"
        )


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summarize(results)
    fig, (ax_time, ax_egress) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(row["mode"] for row in table):
        rows = [row for row in table if row["mode"] == mode]
        ns = [row["n"] for row in rows]
        ax_time.errorbar(
            ns,
            [row["median_s"] for row in rows],
            yerr=[[row["median_s"] - row["min_s"] for row in rows], [row["max_s"] - row["median_s"] for row in rows]],
            marker="o",
            capsize=3,
            label=mode,
        )
        ax_egress.plot(ns, [row["egress_mb"] for row in rows], marker="o", label=mode)
    for ax, label in ((ax_time, "push time (s, median, min-max)"), (ax_egress, "trainer egress (MB)")):
        ax.set_xlabel("replicas N")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({row["n"] for row in table}), labels=[str(n) for n in sorted({row["n"] for row in table})])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Weight push of {results['bytes'] / 1e6:.0f} MB to N replicas over {results['rate']} links")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=400)
    parser.add_argument("--replicas", default="1,2,4,8", help="replica counts N")
    parser.add_argument("--modes", default="direct,chain,tree", help="direct, chain (fanout 1), tree (fanout 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="1gbit", help="tc rate of every link, both directions")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--plot", help="draw the results into this PNG")
    parser.add_argument("--from-json", help="plot / print an earlier run's JSON instead of running")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker_main(args.worker)
        return
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        if os.geteuid() != 0:
            sys.exit("weight_fanout needs root (it creates network namespaces)")
        # SIGTERM and SIGHUP unwind like Ctrl-C, so the namespaces are removed.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: sys.exit(1))
        results = run(args)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
            print(f"wrote {args.json}")
    print_table(results)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
