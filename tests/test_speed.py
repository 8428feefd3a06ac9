"""The wire without copies, and the compiled node's refusal.

Tensors are sealed straight from their memory and opened straight from the frame ZeroMQ received (a real
socket pair, frames taken without copying) into memory of their own; ``--compile`` is refused in one line
where inductor cannot build its kernels.
"""

from __future__ import annotations

import os
import subprocess

import torch
import zmq

from conftest import node_process, subprocess_env
from diffuse.wire import frames
from diffuse.errors import WireError
from diffuse.wire.sealing import new_key


def test_frames_open_from_received_zeromq_frames_into_memory_of_their_own():
    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind("inproc://speed-wire")
        push.connect("inproc://speed-wire")
        sid, key = os.urandom(16), new_key()
        sender, receiver = frames.Hop(sid, key), frames.Hop(sid, key)
        g = torch.Generator().manual_seed(0)
        sent = [torch.randn(3, 70, 40, generator=g), torch.randn(40, 70, generator=g).t(),  # one not contiguous
                torch.arange(7, dtype=torch.int64), torch.empty(0, 5), torch.randn(4, 4, generator=g).bfloat16()]
        push.send_multipart(frames.seal_message(sender, {"op": "call"}, sent), copy=False)
        raw = pull.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in raw)
        header, got = frames.open_message(receiver, raw)
        assert header == {"op": "call"}
        for a, b in zip(sent, got):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) and b.is_contiguous()
        first = got[0].clone()
        memoryview(raw[2].buffer)[:64] = bytes(64)  # the received frame changes after opening: the tensor does not
        assert torch.equal(got[0], first)
        got[0].add_(1)  # and it is writable, like a tensor computed here
        # a frame cut short or edited is refused (authenticated first), and the counter does not move
        push.send_multipart(frames.seal_message(sender, {"op": "call"}, sent[:1]), copy=False)
        raw = [bytes(f) for f in pull.recv_multipart(copy=False)]
        for bad in (raw[:2] + [raw[2][:-4]], raw[:2] + [raw[2][:-1] + bytes([raw[2][-1] ^ 1])]):
            try:
                frames.open_message(receiver, bad)
            except WireError as exc:
                assert "failed authentication" in str(exc)
            else:
                raise AssertionError("a damaged frame opened")
        assert frames.open_message(receiver, raw)[1][0].equal(sent[0])
    finally:
        push.close(0)
        pull.close(0)


def test_compile_is_refused_in_one_line_without_a_c_compiler():
    env = dict(subprocess_env(), PATH="/nonexistent")
    proc = node_process(["--model", "nonexistent", "--compile", "--ephemeral-key"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, env=env)
    out, err = (f.read() for f in (proc.stdout, proc.stderr))
    proc.wait(120)
    out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    lines = [line for line in err.strip().splitlines() if not line.startswith("<frozen runpy>")]  # the launcher's
    assert proc.returncode == 2 and out == "", (proc.returncode, out, err)
    assert lines == ["error: --compile: inductor compiles CPU kernels with a C compiler, and none is on PATH "
                     "(install gcc)"], lines
