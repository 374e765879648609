"""Two "machines" on this one: dp=2 × pp=2 with DDP across network namespaces joined by a veth.

Each host is a network namespace with its own interface and address, so the two torchrun
launches (``--nnodes 2 --node-rank 0/1``) can reach each other only over the veth pair, as two
machines reach each other only over their network; ``GLOO_SOCKET_IFNAME`` makes gloo use that
interface. Rank 0 (on the first host) runs ``examples/hybrid.py``, which checks three training
steps against the plain model on the whole batch and prints ``equal``. A fresh namespace has
its own port space, so the fixed rendezvous port cannot collide with anything else.

Skipped, with the reason, where namespaces cannot be made: not root, no ``ip`` (iproute2), or a
container without CAP_NET_ADMIN. The test installs nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
PORT = 29511
SUBNET = "10.77.0"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[list[tuple[str, str]]]:
    """Two namespaces joined by a veth pair: [(namespace = interface name, address)]."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (install iproute2) to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    names = [f"pc{os.getpid()}{side}" for side in "ab"]  # also the interface names (<= 15 chars)
    made: list[str] = []
    try:
        for ns in names:
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot make a network namespace (no CAP_NET_ADMIN?): {r.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", names[0], "type", "veth", "peer", "name", names[1])]
        for i, ns in enumerate(names):
            steps += [
                ("link", "set", ns, "netns", ns),
                ("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", ns),
                ("-n", ns, "link", "set", ns, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot wire the namespaces (`ip {' '.join(step)}`): {r.stderr.strip()}")
        yield [(ns, f"{SUBNET}.{i + 1}") for i, ns in enumerate(names)]
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth, and so the pair
            _ip("netns", "del", ns)


@pytest.mark.timeout(300)
def test_ddp_across_two_hosts_matches_the_plain_model(hosts: list[tuple[str, str]]) -> None:
    master = hosts[0][1]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    procs = []
    for rank, (ns, _) in enumerate(hosts):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": ns, "OMP_NUM_THREADS": "1"}
        cmd = ["ip", "netns", "exec", ns, torchrun, "--nnodes=2", "--nproc_per_node=2",
               f"--node-rank={rank}", f"--master-addr={master}", f"--master-port={PORT}",
               "examples/hybrid.py", "ddp"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=270)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(f"--- host {i} (exit {p.returncode}) ---\n{out[-3000:]}"
                     for i, (p, out) in enumerate(zip(procs, outputs)))
    assert all(p.returncode == 0 for p in procs), logs
    # examples/hybrid.py asserts the losses equal the plain model's before printing this line.
    assert "pipelined x replicated (ddp):" in outputs[0] and "\nequal\n" in outputs[0], logs
