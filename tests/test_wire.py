"""What crosses the wire is sealed, and a node survives bad frames.

Real node processes, real ZeroMQ sockets on loopback, real libsodium sealing.
"""

from __future__ import annotations

import os
import time

import families
import numpy as np
import pytest
import torch
import zmq

from conftest import THREADS, node_process, run_client
from relay import RecordingRelay

PROMPT = "a zebra crossing a quiet lagoon at dawn"


def _start_node(model, share, extra=()):
    proc = node_process(["--model", model, "--blocks", share, "--ephemeral-key", "--threads", str(THREADS), *extra])
    import json

    line = json.loads(proc.stdout.readline())
    return proc, line


def _block_inputs(model: str, kwargs: dict) -> list[torch.Tensor]:
    """The tensors the first stack call carries, computed with plain diffusers and a hook."""
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    seen: list[torch.Tensor] = []

    def grab(module, args, kw):
        if not seen:
            for x in list(args) + list(kw.values()):
                seen.extend(x if isinstance(x, tuple) else [x])

    pipe.transformer.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    return [t for t in seen if isinstance(t, torch.Tensor) and t.numel() >= 16]


def test_captured_wire_holds_no_prompt_and_no_plaintext_tensor(models, tmp_path, diffuse_home):
    model = models("wan")
    kwargs = dict(families.call_args("wan"), prompt=PROMPT)
    relays, data_relays, procs, nodes = [], [], [], []
    try:
        for share in ("1/2", "2/2"):
            data_relay, control_relay = RecordingRelay(), RecordingRelay()
            proc, ready = _start_node(model, share, ["--advertise-data", data_relay.address])
            data_relay.start(ready["data"])
            control_relay.start(ready["address"])
            relays += [data_relay, control_relay]
            data_relays.append(data_relay)
            procs.append(proc)
            nodes.append(f"{control_relay.address}#{ready['key']}")
        argv = ["--model", model, "--nodes", ",".join(nodes), "--quiet", "--threads", str(THREADS),
                "--save-array", str(tmp_path / "a.npy"), "--out", str(tmp_path / "a.mp4")]
        for k, v in kwargs.items():
            argv += ["--arg", f"{k}={__import__('json').dumps(v)}"]
        run = run_client(argv, diffuse_home)  # the command's own code, its client in this process
        assert run.returncode == 0, run.stderr[-2000:]
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        for r in relays:
            r.close()
    wire = b"".join(bytes(r.captured) for r in relays)
    inputs = _block_inputs(model, kwargs)
    plaintext = sum(t.numel() * t.element_size() for t in inputs)
    # the capture really holds the data path: the data relays alone carried at least the first call's
    # tensors (sizes from plain diffusers), so nodes did not reach each other around the relays
    assert sum(len(r.captured) for r in data_relays) > plaintext
    assert PROMPT.encode() not in wire and b"zebra" not in wire
    # every data connection was a CURVE handshake (the greeting names its mechanism, padded to 20 bytes), so
    # not even the envelopes (session id, counter) crossed in clear
    data = b"".join(bytes(r.captured) for r in data_relays)
    assert data.count(b"CURVE".ljust(20, b"\0")) >= 2  # client -> node 1, node 1 -> node 2 (and their answers)
    assert b"NULL".ljust(20, b"\0") not in data and b"PLAIN".ljust(20, b"\0") not in data
    assert not any(b"\xa4\x61v" + bytes([v]) + b"\x61s\x50" in data for v in (1, 2, 3, 4))  # {"v": 1|2|3|4, "s": 16 bytes
    checked = 0
    for t in inputs:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        # 32-byte windows varied enough that they cannot turn up by chance (a run of zeros could)
        needles = [raw[i:i + 32] for i in range(0, len(raw) - 32, 32) if len(set(raw[i:i + 32])) >= 16][:8]
        for needle in needles:
            assert needle not in wire, f"plaintext bytes of a {tuple(t.shape)} tensor crossed the wire"
        checked += len(needles)
    assert checked >= 16


@pytest.fixture
def wan_ring(models, diffuse_home):
    """A Wan pipeline loaded by plain diffusers in this process, split over two real local nodes."""
    import diffusers

    import diffuse
    from diffuse.local.nodes import start_local_nodes

    torch.set_num_threads(THREADS)
    model = models("wan")
    nodes = start_local_nodes(model, 2, THREADS, extra=["--log-level", "INFO"])
    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        with torch.no_grad():
            return pipe(**families.call_args("wan"), generator=torch.Generator("cpu").manual_seed(0), output_type="np")[0]

    try:
        with diffuse.split(pipe, nodes=[f"{n.address}#{n.key}" for n in nodes], timeout=20) as split:
            yield split.ring, nodes, generate
    finally:
        nodes.stop()


def test_tampered_replayed_and_truncated_frames_are_rejected_and_the_node_keeps_serving(wan_ring):
    from diffuse.wire.frames import seal_message

    ring, nodes, generate = wan_ring
    channel = ring.channel
    sent: list[list[bytes]] = []
    original_send = channel.outbox.send
    channel.outbox.send = lambda frames: (sent.append([bytes(f) for f in frames]), original_send(frames))[1]
    first = generate()
    frames = sent[-1]

    attacker = zmq.Context.instance().socket(zmq.PUSH)
    attacker.setsockopt(zmq.LINGER, 1000)
    from test_sessions_bounded import admitted  # one the data port lets in: it holds the hop's key

    admitted(attacker, channel.send_hop.key, ring.handshake.keys[0])
    attacker.connect(channel.outbox.address)
    # messages sealed by the client but caught in flight: one with a flipped bit, one missing its last frame
    in_flight = [seal_message(channel.send_hop, {"op": "call"}, [torch.randn(4, 4)]) for _ in range(2)]
    tampered = list(in_flight[0])
    flipped = bytearray(tampered[2])
    flipped[len(flipped) // 2] ^= 0x01
    tampered[2] = bytes(flipped)
    for bad in (frames, tampered, in_flight[1][:-1]):  # a replay, a flipped bit, a dropped frame
        attacker.send_multipart(bad)
    attacker.close()
    time.sleep(1.0)

    second = generate()  # the node is still serving, and the session still works
    assert np.array_equal(first, second)
    log = open(nodes[0].log_path).read()
    assert "replayed or reordered message" in log
    assert "failed authentication" in log
    assert "truncated message" in log


def test_unknown_session_is_reported_not_hung(wan_ring):
    from diffuse.errors import NodeError

    ring, nodes, generate = wan_ring
    generate()
    # the node forgets the session (as after an idle timeout); the client must say so, promptly
    ring.handshake.sealed(0, "close", {"session": ring.handshake.sid}, 10)
    t0 = time.monotonic()
    with pytest.raises(NodeError, match="no longer has this session") as lost:
        generate()
    assert lost.value.address == nodes[0].address  # named by its own address
    assert time.monotonic() - t0 < 10
    ring.handshake.sid, real = os.urandom(16), ring.handshake.sid
    try:
        with pytest.raises(NodeError, match="unknown session"):
            ring.handshake.sealed(0, "close", {"session": ring.handshake.sid}, 10)
    finally:
        ring.handshake.sid = real
