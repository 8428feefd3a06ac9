"""The client's end of the ring: hello, session open/close, and one call per stack pass.

The client sends into the first node and receives from the last; nodes hand
activations to each other. Every wait is bounded: a ring that does not answer
becomes a NodeError naming what each node says about the session. Only a
reply sealed by the node's pinned key, for the operation asked, counts as an
answer to open or close; a message on the client's inbox that fails to open is
dropped and the wait goes on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field

from diffuse.callplan import SlotCache, decode_value, digest, flatten
from diffuse.errors import DiffuseError, NodeError, WireError
from diffuse.plan import SESSION_ID_BYTES, WIRE_VERSION, Slice, SlicingPlan
from diffuse.transport_api import Hop

log = logging.getLogger("diffuse.ring")

CONTROL_TIMEOUT_S = 30.0
OPEN_TIMEOUT_S = 600.0  # opening may load blocks from disk
CHALLENGE_FRESH_S = 60.0  # older than this, a hello's challenge is fetched again right before the open


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def config_home() -> str:
    """Where Diffuse keeps its keys and known nodes: $DIFFUSE_HOME, else ~/.config/diffuse."""
    return os.environ.get("DIFFUSE_HOME") or os.path.join(os.path.expanduser("~"), ".config", "diffuse")


def known_nodes_file() -> str:
    return os.path.join(config_home(), "known_nodes.json")


def _read_known(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError) as exc:
        raise DiffuseError(f"the known-nodes file {path} cannot be read ({exc}): fix it, or remove it "
                           "(each node's key is then trusted again on first use)") from None
    if not isinstance(known, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in known.items()):
        raise DiffuseError(f"the known-nodes file {path} is damaged (expected a JSON map of node address to hex "
                           "key): fix it, or remove it (each node's key is then trusted again on first use)")
    return known


def pin_key(address: str, key: bytes, pinned: str | None) -> None:
    """Check a node's key against the one given with its address, or trust it on first use."""
    if pinned:
        if key.hex() != pinned.lower():
            raise NodeError(address, f"presented key {key.hex()[:16]}..., but {pinned[:16]}... was pinned: "
                            "refusing (wrong node, or someone in between)")
        return
    path = known_nodes_file()
    known = _read_known(path)
    if address in known and known[address] != key.hex():
        raise NodeError(address, f"key changed since first use (known: {known[address][:16]}..., now: "
                        f"{key.hex()[:16]}...); if the node was re-keyed on purpose, remove it from {path}")
    if address not in known:
        known[address] = key.hex()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, path)


def check_node_address(address: str, key: str = "") -> None:
    """A node address as --nodes takes it: SCHEME://WHERE, optionally with a 64-hex-digit #KEY."""
    if "://" not in address:
        raise DiffuseError(f"node address {address!r} has no scheme: write it as tcp://HOST:PORT "
                           "(optionally tcp://HOST:PORT#KEY, KEY being the node's public key, to pin it)")
    if key and not re.fullmatch(r"[0-9a-fA-F]{64}", key):
        raise DiffuseError(f"node {address}: #{key[:70]} is not a public key (64 hex digits, as the node prints)")


def route_from_holds(plan: SlicingPlan, holds: list) -> bool:
    """Set each stage's slices to what its node says it holds (hello's ``holds``), checking that in
    route order they chain into every stack exactly. Returns False, changing nothing, unless every
    node says what it holds."""
    if not holds or any(h is None for h in holds):
        return False
    lengths = {st.path: st.length for st in plan.stacks}
    held: list[dict[str, Slice]] = []
    for stage, given in zip(plan.route, holds):
        mine: dict[str, Slice] = {}
        for h in given if isinstance(given, list) else [given]:
            ok = isinstance(h, dict) and isinstance(h.get("stack"), str) and all(
                isinstance(h.get(k), int) and not isinstance(h.get(k), bool) for k in ("start", "stop"))
            if not ok:
                raise NodeError(stage.address, f"says it holds {h!r:.80}, which is not a {{stack, start, stop}} range")
            sl = Slice(h["stack"], h["start"], h["stop"])
            if sl.stack not in lengths or not 0 <= sl.start <= sl.stop <= lengths[sl.stack]:
                raise NodeError(stage.address, f"says it holds {sl}, which this model does not have")
            if sl.start == sl.stop:
                continue
            if sl.stack in mine:
                raise NodeError(stage.address, f"holds two ranges of {sl.stack} ({mine[sl.stack]} and {sl}); "
                                "a node's share of a stack must be one contiguous range")
            mine[sl.stack] = sl
        held.append(mine)
    routes: list[list[Slice]] = [[] for _ in plan.route]

    def refuse(why: str):
        order = "; ".join(f"{st.address}: {', '.join(map(str, h.values())) or 'nothing'}"
                          for st, h in zip(plan.route, held))
        return DiffuseError(f"the nodes' blocks do not chain into whole stacks in route order: {why} "
                            f"(route order: {order}); list the nodes in the order of their blocks, or change "
                            "their --blocks")

    for st in plan.stacks:
        pos, last = 0, None
        for k, (stage, mine) in enumerate(zip(plan.route, held)):
            sl = mine.get(st.path)
            if sl is None:  # holds none of this stack: it hands the call on untouched
                routes[k].append(Slice(st.path, pos, pos))
                continue
            if sl.start > pos:
                raise refuse(f"{st.path}[{pos}:{sl.start}] is held by no node before {stage.address}, "
                             f"which holds {sl}")
            if sl.start < pos:
                raise refuse(f"{st.path}[{sl.start}:{pos}] is held twice, by {plan.route[last].address} "
                             f"and by {stage.address}")
            routes[k].append(sl)
            pos, last = sl.stop, k
        if pos < st.length:
            raise refuse(f"{st.path}[{pos}:{st.length}] is held by no node")
        # nodes after the one holding a stack's last blocks pass its result on to the client
    for stage, slices in zip(plan.route, routes):
        stage.slices = slices
    return True


def _inbox_bind(address: str) -> str:
    scheme, rest = address.split("://", 1)
    if scheme != "tcp":
        import tempfile

        return f"{scheme}://{tempfile.gettempdir()}/diffuse-client-{os.getpid()}-{os.urandom(4).hex()}"
    host = rest.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost", "[::1]"):
        return "tcp://127.0.0.1:0"
    # the address this machine uses to reach the first node is one the last node can reach back
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return f"tcp://{s.getsockname()[0]}:0"


@dataclass
class RingStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    per_stack: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)  # one record per message sent into the ring
    returns: list = field(default_factory=list)  # [seq, bytes] of every answer from the last node
    dropped: int = 0  # messages on the client's inbox that failed to open (junk, replays) and were dropped


class Ring:
    """One session through a ring of nodes, from the client's side."""

    def __init__(self, plan: SlicingPlan, timeout_s: float = 300.0, attention: str | None = None,
                 client_key: str | None = None):
        """``client_key``: a file holding this client's long-term identity (created 0600 if missing),
        for nodes that serve only some clients (``--allow-client``); None: a fresh identity per session."""
        from diffuse.plugins import transport_for

        if not plan.route:
            raise DiffuseError("the plan has no route: give --nodes or --local-nodes")
        for stage in plan.route:
            check_node_address(stage.address, stage.key)
        self.plan = plan
        self.timeout_s = timeout_s
        self.transport = transport_for(plan.route[0].address)
        for stage in plan.route[1:]:
            transport_for(stage.address)  # every node's scheme is one some transport serves
        self.identity = self.transport.load_identity(client_key)
        self.sid = os.urandom(SESSION_ID_BYTES)
        self.stats = RingStats()
        self.node_stats: list[dict] = []
        self._seq = 0
        self._trees: dict[str, dict] = {}
        self._sent_rmap: set[str] = set()
        self._mirrors: dict[str, SlotCache] = {}
        self._open = False
        # PipeFusion attention path the nodes may take: "auto" (quick where it is verified) or "plain"
        self.attention = attention or os.environ.get("DIFFUSE_PATCH_ATTENTION", "auto")
        self.whole_steps: set[str] = set()  # stacks the nodes say must run whole steps (two streams)

    def _hello(self, stage, expect_key: bytes | None = None) -> dict:
        hello = self.transport.request(stage.address, {"op": "hello", "wire": [WIRE_VERSION]}, CONTROL_TIMEOUT_S)
        if not hello.get("ok"):
            raise NodeError(stage.address, str(hello.get("error", "refused hello")))
        key = hello.get("key")
        if not isinstance(key, bytes) or len(key) != 32 or not isinstance(hello.get("data"), str):
            raise NodeError(stage.address, "answered hello without a 32-byte key and a data address")
        if expect_key is not None:
            if key != expect_key:
                raise NodeError(stage.address, "presented another key than a moment ago: refusing")
        else:
            pin_key(stage.address, key, stage.key or None)
        if hello.get("model") != self.plan.model.content_hash:
            raise NodeError(stage.address, "serves a different model (content hash differs): "
                            "start it with the same model folder as the client")
        hello["at"] = time.monotonic()
        return hello

    def open(self) -> None:
        t = self.transport
        data_addresses, keys, hellos = [], [], []
        for stage in self.plan.route:
            hello = self._hello(stage)
            data = hello["data"]
            if "://0.0.0.0:" in data or "://*:" in data:  # bound on all interfaces: dial the host we reached
                data = stage.address.rsplit(":", 1)[0] + ":" + data.rsplit(":", 1)[1]
            data_addresses.append(data)
            keys.append(hello["key"])
            hellos.append(hello)
        # nodes started with --blocks say what they hold: the route is theirs (uneven shares included)
        route_from_holds(self.plan, [h.get("holds") for h in hellos])
        self.inbox = t.inbox(_inbox_bind(self.plan.route[0].address))
        hop_keys = [t.new_key() for _ in range(len(self.plan.route) + 1)]
        nexts = data_addresses[1:] + [self.inbox.address]
        opened = []
        try:
            for k, stage in enumerate(self.plan.route):
                hello = hellos[k]
                if time.monotonic() - hello["at"] > CHALLENGE_FRESH_S:  # earlier nodes took long to load
                    hello = self._hello(stage, keys[k])
                payload = {
                    "session": self.sid, "model": self.plan.model.content_hash, "dtype": self.plan.compute_dtype,
                    "slices": [vars(s) for s in stage.slices], "challenge": hello.get("challenge"),
                    "in_key": hop_keys[k], "out_key": hop_keys[k + 1], "next": nexts[k], "attention": self.attention,
                }
                reply = self._sealed_request(stage.address, "open", payload, keys[k], OPEN_TIMEOUT_S)
                opened.append((stage.address, keys[k]))
                self.whole_steps.update(reply.get("whole_steps") or ())
        except BaseException:
            # a node refused: the ones that said yes free their session now, not at idle-out
            for address, key in opened:
                try:
                    self._sealed_request(address, "close", {"session": self.sid}, key, 5.0)
                except DiffuseError:
                    pass
            self.inbox.close()
            raise
        self._keys = keys
        self.outbox = t.outbox(data_addresses[0])
        self.send_hop = Hop(self.sid, hop_keys[0])
        self.recv_hop = Hop(self.sid, hop_keys[-1])
        self._open = True

    def _sealed_request(self, address: str, op: str, payload: dict, node_key: bytes, timeout: float) -> dict:
        """A sealed request; only a reply sealed by ``node_key`` for this very operation counts as an answer.
        A plain reply can only be a refusal (one made before the node could open the request)."""
        msg = dict(self.transport.seal_control(dict(payload, op=op), node_key, self.identity), op=op)
        reply = self.transport.request(address, msg, timeout)
        if "box" not in reply:
            if reply.get("ok"):
                raise NodeError(address, f"answered {op} without sealing the reply: refusing "
                                "(not the node whose key is pinned, or someone in between)")
            raise NodeError(address, str(reply.get("error", f"refused {op}")))
        try:
            inner, sender = self.transport.open_control(reply, self.identity)
        except WireError as exc:
            raise NodeError(address, f"its {op} reply failed to open ({exc}): refusing") from None
        if sender != node_key:
            raise NodeError(address, f"its {op} reply is sealed by another key than the node's: refusing")
        if not isinstance(inner, dict) or inner.get("re") != op:
            raise NodeError(address, f"its sealed reply does not answer {op}: refusing")
        if not inner.get("ok"):
            raise NodeError(address, str(inner.get("error", f"refused {op}")))
        return inner

    def call(self, stack: str, args: tuple, kwargs: dict, return_map: dict, patch: dict | None = None):
        """One pass of ``stack`` through the ring; returns what its last block returns."""
        tree, tensors = flatten(args, kwargs)
        return self._receive(self._send(stack, tree, tensors, return_map, patch))

    def call_flat(self, stack: str, tree: dict, tensors: list, return_map: dict, patch: dict | None = None,
                  digests: list | None = None):
        """``call`` for a call already taken apart by ``flatten`` (``digests``: its tensors' digests, if known)."""
        return self._receive(self._send(stack, tree, tensors, return_map, patch, digests))

    def call_patches(self, stack: str, tree: dict, tensors: list, return_map: dict, stream: int, axis: int,
                     ranges: list[tuple[int, int]], patch: dict, digests: list | None = None) -> list:
        """One pass per patch, pipelined: every patch is sent before any answer is awaited, so each
        node works on one patch while the next node works on the one before. Returns the last
        block's answer for each patch, in order."""
        seqs = []
        for i, (lo, hi) in enumerate(ranges):
            cut = list(tensors)
            cut[stream] = tensors[stream].narrow(axis, lo, hi - lo)
            seqs.append(self._send(stack, tree, cut, return_map, dict(patch, lo=lo, count=hi - lo, index=i), digests))
        return [self._receive(seq) for seq in seqs]

    def _send(self, stack: str, tree: dict, tensors: list, return_map: dict, patch: dict | None,
              digests: list | None = None) -> int:
        self._seq += 1
        header = {"op": "call", "stack": stack, "seq": self._seq}
        if self._trees.get(stack) != tree:
            header["tree"] = self._trees[stack] = tree
        if stack not in self._sent_rmap:
            header["rmap"] = return_map
            self._sent_rmap.add(stack)
        if patch is not None:
            header["patch"] = patch
        streams = set(return_map["streams"])
        mirror = self._mirrors.setdefault(stack, SlotCache())
        slots, sent, fresh = [], [], []
        for i, t in enumerate(tensors):
            if i in streams:
                slots.append(["f", len(sent)])
                sent.append(t)
                continue
            h = digests[i] if digests else digest(t)
            if (i, h) in mirror:
                mirror.get(i, h)
                slots.append(["h", h])
            else:
                mirror.put(i, h)
                slots.append(["f", len(sent), h])
                sent.append(t)
                fresh.append(i)
        header["slots"] = slots
        frames = self.transport.seal(self.send_hop, header, sent)
        self.outbox.send(frames)
        n_out = sum(len(f) for f in frames)
        self.stats.bytes_sent += n_out
        s = self.stats.per_stack.setdefault(stack, {"calls": 0, "bytes": []})
        s["calls"] += 1
        s["bytes"].append(n_out)
        self.stats.messages.append({
            "seq": self._seq, "stack": stack, "bytes_out": n_out,
            "stream_bytes": sum(_nbytes(tensors[i]) for i in streams),
            "fresh_slots": fresh, "fresh_bytes": sum(_nbytes(tensors[i]) for i in fresh),
            **({k: patch[k] for k in ("branch", "step", "whole", "index") if k in patch} if patch else {}),
        })
        return self._seq

    def _receive(self, seq: int):
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            reply = self.inbox.recv(left) if left > 0 else None
            if reply is None:
                raise NodeError(self.plan.route[0].address, self._diagnose())
            try:
                out_header, out_tensors = self.transport.open(self.recv_hop, reply)
                break
            except WireError as exc:  # anyone can reach the inbox: junk costs itself, not the run
                self.stats.dropped += 1
                log.warning("dropped a message on the client's inbox: %s", exc)
        if out_header.get("op") == "error":
            raise NodeError(out_header.get("node", "?"), out_header.get("message", "failed"))
        if out_header.get("seq") != seq or out_header.get("op") != "result":
            raise DiffuseError(f"ring answered {out_header.get('op')} #{out_header.get('seq')} to call #{seq}")
        n_in = sum(len(f) for f in reply)
        self.stats.calls += 1
        self.stats.bytes_received += n_in
        self.stats.returns.append([seq, n_in])
        return decode_value(out_header["out"], out_tensors)

    def _diagnose(self) -> str:
        said = []
        for stage in self.plan.route:
            try:
                st = self.transport.request(stage.address, {"op": "status", "session": self.sid}, 5.0)
                if st.get("session_known") is False:
                    said.append(f"{stage.address}: unknown session")
                elif st.get("last_error"):
                    said.append(f"{stage.address}: {st['last_error']}")
            except NodeError as exc:
                said.append(str(exc))
        detail = "; ".join(said) or "no node reports an error"
        return f"no answer from the ring within {self.timeout_s:.0f} s ({detail})"

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        for stage, key in zip(self.plan.route, self._keys):
            try:
                self.node_stats.append(self._sealed_request(stage.address, "close", {"session": self.sid}, key, 10.0))
            except DiffuseError:
                self.node_stats.append({})
        self.outbox.close()
        self.inbox.close()

    def node_params(self) -> list[int]:
        return [self.transport.request(s.address, {"op": "status"}, CONTROL_TIMEOUT_S)["params"] for s in self.plan.route]
