"""The client's data channel of one session: seal and send into the first node, receive and open
from the last.

Non-stream tensors are sent once: the channel keeps a mirror (hashes only) of
what every node's slot cache holds, updated by the same rule, and refers to a
kept tensor by its digest. While it waits for an answer the channel asks
``probe`` every few seconds whether the ring is still alive, so a dead or
frozen node is named within seconds rather than at the timeout; when the
answer does not come at all, the nodes say how far the pass got, and the hop
where it stopped is named. While the session is open a light background ping
keeps its lease on every node alive (nodes close sessions whose client stopped
pinging: ``diffuse.node.sessions``), between passes and between a chat's turns.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from diffuse.wire import frames
from diffuse.plan.calltree import decode_value, digest
from diffuse.wire.slots import SLOT_CACHE_BYTES, SlotCache
from diffuse.plan.devices import device_of, to_device, to_host
from diffuse.errors import DiffuseError, NodeError, WireError
from diffuse.wire.passes import WHOLE, Answer, ContractError, Part, Pass
from diffuse.plan.contracts import ReturnMap
from diffuse.plan.messages import Patch, SlotRef

log = logging.getLogger("diffuse.client.ring")

PROBE_EVERY_S = 1.5  # while waiting for an answer, ask the nodes this often whether they are alive
MAX_RECORDS = 4096  # per-message records a session keeps (the latest; the totals count every message)


def keep(records: list, record) -> None:
    """Append a per-message record, keeping the latest ``MAX_RECORDS``: a long session's records stay bounded."""
    records.append(record)
    if len(records) > MAX_RECORDS:
        del records[:len(records) - MAX_RECORDS]


def keepalive_every_s() -> float:
    """How often an open session pings its nodes when it is not waiting for an answer: well inside
    the nodes' lease (``diffuse.node.sessions.lease_s``)."""
    from diffuse.wire.tokens import lease_s

    return max(0.2, min(5.0, lease_s() / 4))


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


@dataclass
class ChannelStats:
    passes: int = 0  # answers received from the last node
    bytes_sent: int = 0
    bytes_received: int = 0
    per_stack: dict = field(default_factory=dict)  # stack -> {"calls": count, "bytes": the latest messages' sizes}
    messages: list = field(default_factory=list)  # a record per message sent into the ring (the latest MAX_RECORDS)
    returns: list = field(default_factory=list)  # [seq, bytes] per answer from the last node (the latest MAX_RECORDS)
    stream_rows: int = 0  # hidden-state rows sent into the ring (the stream slot of every message)
    max_return_bytes: int = 0  # the largest answer from the last node
    dropped: int = 0  # messages on the client's inbox that failed to open (junk, replays) and were dropped
    reuse: dict = field(default_factory=dict)  # stack -> [skipped, calls] of the first-block cache (diffuse.firstblock)
    # where the client's time in this channel went, in seconds so far: hashing tensors it had no digest of,
    # sealing, handing frames to the transport, waiting for answers, opening them (``python -m diffuse.bench``)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(("hash", "seal", "send", "wait", "open"), 0.0))


class Channel:
    def __init__(self, outbox, inbox, send_hop: frames.Hop, recv_hop: frames.Hop, timeout_s: float, probe=None):
        self.outbox, self.inbox = outbox, inbox
        self.send_hop, self.recv_hop = send_hop, recv_hop
        self.timeout_s = timeout_s
        self.probe = probe  # called while waiting; raises NodeError naming a node that stopped answering
        self.stats = ChannelStats()
        self._seq = 0
        self._trees: dict[str, dict] = {}
        self._sent_rmap: dict[str, ReturnMap] = {}
        self._mirror = SlotCache(SLOT_CACHE_BYTES)  # what every node's slot cache holds: (stack, slot) -> size
        self._waiting = False  # in receive, which probes by itself
        self.device = None  # where the model's calls hand their tensors from, and get answers back (None: the CPU)
        self._closed = threading.Event()
        self._keepalive = None
        if probe is not None:
            self._keepalive = threading.Thread(target=self._keep_alive, name="keepalive", daemon=True)
            self._keepalive.start()

    def _keep_alive(self) -> None:
        every = keepalive_every_s()
        while not self._closed.wait(every):
            if self._waiting:
                continue
            try:
                self.probe(keepalive=True)
            except Exception as exc:  # the next pass finds out for itself, and says so
                log.debug("keep-alive ping failed: %s", exc)

    def send(self, stack: str, tree: dict, tensors: list, rmap: ReturnMap, patch: Patch | None = None,
             digests: list | None = None, part: Part | None = None) -> int:
        """Seal and send one pass of ``stack``; returns its sequence number (``digests``: the tensors'
        digests where already known, so each is hashed once per call; ``patch`` or ``part``: what kind of
        pass it is, ``diffuse.wire.passes``; neither: a whole call)."""
        if patch is not None and part is not None:
            raise ContractError("a pass carries one part: a patch, or another, not both")
        self._seq += 1
        self.device = device_of(tensors) or self.device
        tensors = to_host(tensors)  # one copy from an accelerator (CPU tensors: as they are)
        sent_tree = None
        if self._trees.get(stack) != tree:
            sent_tree = self._trees[stack] = tree
        sent_rmap = None
        if self._sent_rmap.get(stack) != rmap:  # the first call's, and again when a pass threads otherwise
            sent_rmap = self._sent_rmap[stack] = rmap
        streams = set(rmap.streams)
        mirror = self._mirror
        refs, sent, fresh = [], [], []
        clock = self.stats.seconds
        t0 = time.perf_counter()
        for i, t in enumerate(tensors):
            if i in streams:
                refs.append(SlotRef(frame=len(sent)))
                sent.append(t)
                continue
            h = digests[i] if digests else digest(t)
            if ((stack, i), h) in mirror:
                mirror.get((stack, i), h)
                refs.append(SlotRef(digest=h))
            else:
                mirror.put((stack, i), h, nbytes=_nbytes(t))
                refs.append(SlotRef(frame=len(sent), digest=h))
                sent.append(t)
                fresh.append(i)
        part = patch if patch is not None else part if part is not None else WHOLE
        message = Pass(stack, self._seq, tuple(refs), part, sent_tree, sent_rmap,
                       self._mirror.max_bytes if self._seq == 1 else None)  # the nodes keep what the mirror assumes
        t1 = time.perf_counter()
        out = frames.seal_message(self.send_hop, message.to_wire(), sent)
        t2 = time.perf_counter()
        self.outbox.send(out)
        clock["hash"] += t1 - t0
        clock["seal"] += t2 - t1
        clock["send"] += time.perf_counter() - t2
        n_out = sum(len(f) for f in out)
        self.stats.bytes_sent += n_out
        s = self.stats.per_stack.setdefault(stack, {"calls": 0, "bytes": []})
        s["calls"] += 1
        keep(s["bytes"], n_out)
        rows = max((tensors[i].shape[1] for i in streams if tensors[i].dim() > 1), default=0)
        self.stats.stream_rows += rows
        keep(self.stats.messages, {
            "seq": self._seq, "stack": stack, "bytes_out": n_out,
            "stream_bytes": sum(_nbytes(tensors[i]) for i in streams),
            "stream_rows": rows,
            "fresh_slots": fresh, "fresh_bytes": sum(_nbytes(tensors[i]) for i in fresh),
            **({"branch": patch.branch, "step": patch.step, "uncut": patch.uncut, "index": patch.index}
               if patch else {}),
        })
        return self._seq

    def receive(self, seq: int):
        """The last block's answer to message ``seq``."""
        self._waiting = True
        try:
            while True:
                header, tensors, reply = self._wait(seq)
                if header.get("op") != "error" or header.get("seq") == seq or \
                        (isinstance(header.get("seq"), int) and header["seq"] > seq):
                    break
                # an error about no pass, or an earlier one, answered already: it says something went wrong
                # with a message this client did not send as a pass (or sent before); the pass waited for goes on
                self.stats.dropped += 1
                log.warning("node %.200s reported about another message: %.500s", header.get("node", "?"),
                            header.get("message", ""))
        finally:
            self._waiting = False
        if header.get("op") == "error":
            raise NodeError(str(header.get("node", "?"))[:200], str(header.get("message", "failed"))[:2000])
        if header.get("seq") != seq or header.get("op") != "result":
            raise DiffuseError(f"ring answered {header.get('op')!r:.32} #{header.get('seq')!r:.32} to call #{seq}")
        answer = Answer.from_wire(header)
        n_in = sum(len(f) for f in reply)
        self.stats.passes += 1
        self.stats.bytes_received += n_in
        keep(self.stats.returns, [seq, n_in])
        self.stats.max_return_bytes = max(self.stats.max_return_bytes, n_in)
        if answer.skipped is not None:
            counted = self.stats.reuse.setdefault(answer.stack[:200], [0, 0])
            counted[0] += answer.skipped
            counted[1] += 1
        return decode_value(answer.out, to_device(tensors, self.device))

    def _wait(self, seq: int):
        deadline = time.monotonic() + self.timeout_s
        next_probe = time.monotonic() + PROBE_EVERY_S
        flush = getattr(self.outbox, "flush", None)  # an outbox that queues what its peer cannot take yet
        while True:
            now = time.monotonic()
            if now >= deadline:
                if self.probe is not None:
                    self.probe(stalled=seq)  # names the hop where the pass stopped, if a node can tell
                raise DiffuseError(f"the ring gave no answer within {self.timeout_s:.0f} s although every node "
                                   "still answers: a pass is slower than --timeout allows (raise --timeout)")
            queued = flush is not None and flush()  # True while some of what was sent still waits here
            w0 = time.perf_counter()
            reply = self.inbox.recv(min(deadline, next_probe, now + 0.2 if queued else next_probe) - now)
            opened = time.perf_counter()
            self.stats.seconds["wait"] += opened - w0
            if reply is None:
                if self.probe is not None and time.monotonic() >= next_probe:
                    self.probe()
                    next_probe = time.monotonic() + PROBE_EVERY_S
                continue
            try:
                header, tensors = frames.open_message(self.recv_hop, reply)
                return header, tensors, reply
            except WireError as exc:  # anyone can reach the inbox: junk costs itself, not the run
                self.stats.dropped += 1
                log.warning("dropped a message on the client's inbox: %s", exc)
            finally:
                self.stats.seconds["open"] += time.perf_counter() - opened

    def close(self) -> None:
        self._closed.set()
        self.outbox.close()
        self.inbox.close()
