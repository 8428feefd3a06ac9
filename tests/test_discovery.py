"""LAN discovery: a node's announcement (``python -m diffuse.node --announce``) and ``--nodes auto``.

The record's round trip, what a client refuses of it and how it orders what it heard run without a network.
The real thing runs inside two network namespaces this test makes and removes (a veth pair between them, a
multicast route on each), never on the machine's own interfaces: two nodes announce themselves in one, a
client in the other finds them, runs a split, and its video is the one plain diffusers makes whole, bit for
bit; a node stopped there withdraws its announcement at once.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import THREADS, run_cli, run_reference, subprocess_env

KEY_A, KEY_B = "ab" * 32, "cd" * 32


def _announced(**changes):
    from diffuse.wire.discovery import Announced

    fields = dict(name="host-7000-abababab._diffuse._tcp.local.", addresses=("10.213.0.1",), port=7000, key=KEY_A,
                  model="tiny-wan", model_hash="0f" * 16, blocks="blocks[1:2]", wire=(1, 2), data_port=7001)
    fields.update(changes)
    return Announced(**fields)


def _txt_pairs(text: bytes) -> dict[bytes, bytes]:
    """A TXT record's strings as RFC 6763 section 6 lays them out (a length byte, then key=value), read here
    without the library that wrote them."""
    pairs, i = {}, 0
    while i < len(text):
        n = text[i]
        key, _, value = text[i + 1:i + 1 + n].partition(b"=")
        pairs[key] = value
        i += 1 + n
    return pairs


def test_an_announcement_goes_through_its_txt_record_and_back_and_a_bad_one_is_refused_by_field(tmp_path,
                                                                                                monkeypatch):
    import socket

    from zeroconf import ServiceInfo

    from diffuse.client.lan import nodes_for
    from diffuse.wire.discovery import Announced, SERVICE_TYPE
    from diffuse.errors import DiffuseError

    sent = _announced()
    info = ServiceInfo(SERVICE_TYPE, sent.name, port=sent.port, properties=sent.properties(),
                       addresses=[socket.inet_aton(a) for a in sent.addresses])
    assert len(info.text) < 400  # one small record: key, model, hash, blocks, wire, data port
    back = Announced.from_record(sent.name, ["10.213.0.1"], 7000, _txt_pairs(info.text))
    assert back == sent and back.address == "tcp://10.213.0.1:7000"
    bare = _announced(blocks="", data_port=None)  # a node that loads what sessions ask for, its data port unsaid
    text = ServiceInfo(SERVICE_TYPE, bare.name, port=bare.port, properties=bare.properties()).text
    assert Announced.from_record(bare.name, ["10.213.0.1"], 7000, _txt_pairs(text)) == bare
    wrong = {"key": ("key", "AB" * 32, "its key"), "control": ("model", "tiny\x1b[2J", "its model name"),
             "blocks": ("blocks", "blocks[0:2];rm", "its blocks"), "wire": ("wire", "1,x", "its wire versions"),
             "version": ("txtvers", "2", "TXT record version"), "data": ("data", "70000", "its data port")}
    for what, (field, value, said) in wrong.items():
        props = dict(sent.properties(), **{field: value})
        with pytest.raises(DiffuseError, match=said):
            Announced.from_record(sent.name, ["10.213.0.1"], 7000, props)
    with pytest.raises(DiffuseError, match="no IPv4 address"):
        Announced.from_record(sent.name, [], 7000, sent.properties())

    # the client's list: this model's nodes only, fixed slices in their order, keys checked against those remembered
    monkeypatch.setenv("DIFFUSE_HOME", str(tmp_path))
    first = _announced(addresses=("10.213.0.2",), key=KEY_B, blocks="blocks[0:1]")
    other = _announced(addresses=("10.213.0.3",), model_hash="ee" * 16)
    assert nodes_for([sent, other, first], "0f" * 16) == "tcp://10.213.0.2:7000,tcp://10.213.0.1:7000"
    assert nodes_for([other], "0f" * 16) == ""
    with open(tmp_path / "known_nodes.json", "w") as f:
        json.dump({"tcp://10.213.0.1:7000": KEY_B}, f)
    with pytest.raises(DiffuseError, match=r"tcp://10.213.0.1:7000 announces key abababababababab\.\.\., but "
                       r"cdcdcdcdcdcdcdcd\.\.\. is remembered"):
        nodes_for([sent, first], "0f" * 16)
    with open(tmp_path / "known_nodes.json", "w") as f:
        json.dump({"tcp://10.213.0.1:7000": KEY_A}, f)
    assert nodes_for([sent], "0f" * 16) == "tcp://10.213.0.1:7000"


def test_without_zeroconf_announcing_and_discovering_say_how_to_install_it(monkeypatch, capsys, diffuse_home):
    """The flags, and ``diffuse.split(..., nodes="auto")`` with its ``discover_seconds``, each refused in one line
    before anything loads."""
    from diffuse.node import command as node

    monkeypatch.setitem(sys.modules, "zeroconf", None)  # as where it is not installed
    said = run_cli(["plan", "tiny-wan-shapes", "--nodes", "auto"], diffuse_home)
    assert said.returncode == 2 and "pip install 'diffuse[lan]'" in said.stderr, said.stderr
    assert said.stderr.strip().count("\n") == 0  # one line
    queried = run_cli(["query", "--nodes", "auto", "--quiet"], diffuse_home)
    assert queried.returncode == 2 and "pip install 'diffuse[lan]'" in queried.stderr, queried.stderr
    assert node.main(["--model", "tiny-wan-shapes", "--listen", "tcp://0.0.0.0:0", "--announce"]) == 2
    assert "pip install 'diffuse[lan]'" in capsys.readouterr().err
    import diffuse
    from diffuse.errors import DiffuseError

    with pytest.raises(DiffuseError, match=r"needs the zeroconf library: pip install 'diffuse\[lan\]'"):
        diffuse.split(object(), nodes="auto", model="tiny-wan-shapes")  # refused before the model is looked at
    monkeypatch.delitem(sys.modules, "zeroconf")
    for nodes, seconds, said in ((None, 2, 'discover_seconds applies with nodes="auto"'),
                                 ("tcp://10.213.0.1:7000", 2, 'applies with nodes="auto"'),
                                 ("auto", 0, "discover_seconds=0: a number of seconds above 0"),
                                 ("auto", True, "discover_seconds=True"), ("auto", "2", "discover_seconds='2'"),
                                 ("auto", 601, "at most 600")):
        with pytest.raises(DiffuseError, match=said):
            diffuse.split(object(), nodes=nodes, discover_seconds=seconds, model="tiny-wan-shapes")
    with pytest.raises(DiffuseError, match="--nodes and --local-nodes: give one"):
        diffuse.split(object(), nodes="auto", local_nodes=2, model="tiny-wan-shapes")
    assert node.main(["--model", "tiny-wan-shapes", "--announce"]) == 2  # on loopback: nobody else reaches it
    assert "which no other machine reaches" in capsys.readouterr().err


# ------------------------------------------------------------------------ on a network of the test's own

class Namespaces:
    """Two network namespaces, ``node`` and ``client``, joined by a veth pair (10.213.0.1 and .2), each with
    loopback up and a route for multicast; removed by ``close``."""

    def __init__(self, tag: str):
        self.node, self.client, self.made, self.why = f"{tag}-node", f"{tag}-client", [], None
        if os.geteuid() != 0:
            self.why = "not root"
        elif not shutil.which("ip"):
            self.why = "no ip command"

    def make(self) -> None:
        veth = (f"dl{os.getpid()}n", f"dl{os.getpid()}c")
        steps = [["netns", "add", self.node], ["netns", "add", self.client],
                 ["link", "add", veth[0], "type", "veth", "peer", "name", veth[1]]]
        for ns, dev, ip in ((self.node, veth[0], "10.213.0.1/24"), (self.client, veth[1], "10.213.0.2/24")):
            steps += [["link", "set", dev, "netns", ns], ["-n", ns, "addr", "add", ip, "dev", dev],
                      ["-n", ns, "link", "set", dev, "up"], ["-n", ns, "link", "set", "lo", "up"],
                      ["-n", ns, "route", "add", "224.0.0.0/4", "dev", dev]]
        for step in steps:
            done = subprocess.run(["ip", *step], capture_output=True, text=True)
            if done.returncode:
                self.why = f"`ip {' '.join(step)}` failed: {done.stderr.strip()}"
                return
            if step[:2] == ["netns", "add"]:
                self.made.append(step[2])

    def run(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)

    def close(self) -> None:
        for ns in self.made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def namespaces():
    spaces = Namespaces(f"diffuse-lan-{os.getpid()}")
    try:
        if spaces.why is None:
            spaces.make()
        if spaces.why:
            pytest.skip(f"network namespaces cannot be made here: {spaces.why}")
        yield spaces
    finally:
        spaces.close()


WATCH = """
import sys, time
from zeroconf import IPVersion, ServiceBrowser, Zeroconf
zc = Zeroconf(ip_version=IPVersion.V4Only)
seen = lambda zeroconf, service_type, name, state_change: print(state_change.name, name, flush=True)
browser = ServiceBrowser(zc, "_diffuse._tcp.local.", handlers=[seen])
sys.stdin.read()
browser.cancel()
zc.close()
"""


class Lines:
    """A process's output lines as they come, each waited for at most ``timeout`` seconds ("" if none came)."""

    def __init__(self, proc):
        import queue
        import threading

        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(ln) for ln in proc.stdout], daemon=True).start()

    def next(self, timeout: float) -> str:
        import queue

        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return ""


def test_nodes_announced_in_one_namespace_are_found_from_another_and_split_the_bytes_of_a_whole_run(
        namespaces, models, tmp_path, diffuse_home):
    """Two nodes with --announce (fixed slices, started last slice first) and a client with --nodes auto in
    another namespace: it lists both, orders them by their slices, trusts each key on first use, and saves the
    array plain diffusers returns whole. A node stopped with SIGTERM is seen withdrawn by a watcher at once."""
    import families

    model, kwargs = models("wan"), families.call_args("wan")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # computed while the nodes and the client start
        reference = pool.submit(run_reference, model, kwargs, str(tmp_path / "whole.npy"))
        _discover_and_split(namespaces, model, kwargs, subprocess_env(diffuse_home), tmp_path, reference)


def _discover_and_split(namespaces, model, kwargs, env, tmp_path, reference):
    import numpy as np

    nodes, watcher = [], None
    try:
        for blocks in ("2/2", "1/2"):
            nodes.append(namespaces.run(namespaces.node, [
                sys.executable, "-m", "diffuse.node", "--model", model, "--listen", "tcp://0.0.0.0:0", "--announce",
                "--blocks", blocks, "--ephemeral-key", "--threads", str(THREADS)], env=env, stdout=subprocess.PIPE,
                stderr=open(tmp_path / f"node{blocks[0]}.log", "w"), text=True))
        ready = [json.loads(Lines(p).next(120) or "null") for p in nodes]
        assert all(ready), [(tmp_path / f"node{b}.log").read_text()[-2000:] for b in "21"]
        ports = [r["address"].rpartition(":")[2] for r in ready]

        save = tmp_path / "split.npy"
        argv = [sys.executable, "-m", "diffuse.run", "--model", model, "--nodes", "auto", "--discover-seconds", "2",
                "--seed", "0", "--threads", str(THREADS), "--save-array", str(save), "--timeout", "120"]
        argv += [x for k, v in kwargs.items() for x in ("--arg", f"{k}={json.dumps(v)}")]
        client = namespaces.run(namespaces.client, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        out, err = client.communicate(timeout=300)
        assert client.returncode == 0, err[-3000:]
        found = [ln.split()[1] for ln in err.splitlines() if ln.strip().startswith("found ")]
        assert sorted(found) == sorted(f"tcp://10.213.0.1:{p}" for p in ports), err
        for r, p in zip(ready, ports):
            assert f"tcp://10.213.0.1:{p}: key {r['key'][:16]}... trusted on first use" in err, err
        route = [ln.split()[1].rstrip(":") for ln in err.splitlines() if ln.startswith("  node tcp://")]
        assert route == [f"tcp://10.213.0.1:{p}" for p in ports[::-1]], err  # in the order of their slices
        whole = reference.result(timeout=300)
        split = np.load(save)
        assert split.dtype == whole.dtype and split.shape == whole.shape
        assert split.tobytes() == whole.tobytes()

        watcher = namespaces.run(namespaces.client, [sys.executable, "-c", WATCH], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        lines = Lines(watcher)
        heard = [lines.next(10), lines.next(10)]
        assert all(h.startswith("Added") for h in heard), heard
        nodes[0].send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        gone = lines.next(5)
        assert gone.startswith("Removed") and f"-{ports[0]}-" in gone, gone
        assert time.monotonic() - t0 < 5 and nodes[0].wait(10) == 0
        assert "announcement withdrawn" in (tmp_path / "node2.log").read_text()
    finally:
        for p in [*nodes, watcher]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [*nodes, watcher]:
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
