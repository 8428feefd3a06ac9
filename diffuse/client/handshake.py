"""The client's control protocol with each node of a ring: hello, open, close, liveness.

``hello`` (plain) gives a node's key (pinned, or trusted on first use), data
address, model hash, the slices it holds (nodes started with ``--blocks``), the
wire versions it speaks, a one-time challenge, and its report for placement
(memory, blocks held, threads, device, measured speed; remembered with the
hello's round trip by ``diffuse.client.heard.Heard.note_hello``; a node whose hello
passes every check below is the only one whose report is kept). A node whose
hello says it is still fetching its slice (``fetch``) is waited for, with a line
saying how far it got (``diffuse.client.fetchwait``). The client offers the
versions it speaks; each node's is the highest both speak, and each data hop's
is the highest its two ends speak (a node that speaks only an older version
keeps serving, in a ring with newer ones). ``open`` and ``close`` are sealed to
the node's key and carry their operation inside the seal; only a reply sealed
by that key, for that operation, session and challenge, counts. The first
hello to a node (in ``diffuse.wire.links.FRESH_S``) is followed by a few sealed link
pings, which measure the client's link to it; an open names the next node's
control address and key, and the node answers with its link to it. An open also
names ``next_server``, the CURVE key of the data port the node sends to (the next
node's key, or the key of this client's inbox for the session), which the node's
sending end holds that port to (``diffuse.wire.admission``). ``open`` tells
each node its ``StagePlan`` and its two hop keys: at wire version 1 inside the
seal, at version 2 under a key agreed for that open (``sealing.agree``), so a
recorded session cannot be opened later with the node's long-term key.
"""

from __future__ import annotations

import logging
import os
import time

from diffuse.wire import frames
from diffuse.wire import links
from diffuse.wire import sealing
from diffuse.errors import DiffuseError, NodeError, WireError
from diffuse.client.known_nodes import parse_node, pin_key
from diffuse.client.heard import Heard
from diffuse.plan.contracts import SESSION_ID_BYTES, WIRE_VERSIONS, ContractError, Slice, SlicingPlan, Stage, \
    check_slices
from diffuse.plan.logs import clean_request_id
from diffuse.plan.messages import StagePlan

HELLO_TIMEOUT_S = 10.0
OPEN_TIMEOUT_S = 600.0  # opening may load blocks from disk
CLOSE_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 2.5  # a node that does not answer a ping this fast, twice in a row, is dead or frozen
CHALLENGE_FRESH_S = 60.0  # older than this, a hello's challenge is fetched again right before the open


def route_from_slices(plan: SlicingPlan, held: list[list[Slice] | None], as_routed=frozenset()) -> SlicingPlan:
    """The plan with each stage's slices set to what its node holds, checking that in route order they
    chain into every stack exactly; the plan unchanged unless every node says what it holds. Stacks in
    ``as_routed`` (a VAE, ``diffuse.plan.decoders``: no part of any node's --blocks) go where the route puts them."""
    if not held or any(h is None for h in held):
        return plan
    mine = [{s.stack: s for s in h if not s.empty} for h in held]
    for m, stage in zip(mine, plan.route):
        m.update({s.stack: s for s in stage.slices if s.stack in as_routed and not s.empty})

    def refuse(why: str):
        order = "; ".join(f"{st.address}: {', '.join(map(str, m.values())) or 'nothing'}"
                          for st, m in zip(plan.route, mine))
        return DiffuseError(f"the nodes' slices do not chain into whole stacks in route order: {why} "
                            f"(route order: {order}); change their --blocks")

    routes: list[list[Slice]] = [[] for _ in plan.route]
    for st in plan.stacks:
        pos, last = 0, None
        for k, (stage, m) in enumerate(zip(plan.route, mine)):
            sl = m.get(st.path)
            if sl is None:  # holds none of this stack: it hands the call on untouched
                routes[k].append(Slice(st.path, pos, pos))
                continue
            if sl.start > pos:
                raise refuse(f"{st.path}[{pos}:{sl.start}] is held by no node before {stage.address}, which holds {sl}")
            if sl.start < pos:
                raise refuse(f"{st.path}[{sl.start}:{pos}] is held twice, by {plan.route[last].address} "
                             f"and by {stage.address}")
            routes[k].append(sl)
            pos, last = sl.stop, k
        if pos < st.length:
            raise refuse(f"{st.path}[{pos}:{st.length}] is held by no node")
    return plan.with_route(Stage(s.address, s.key, tuple(r)) for s, r in zip(plan.route, routes))


_TOLD_COMPILED: set[str] = set()  # nodes this process has said run compiled blocks (said once each)


def _speaks(hello: dict) -> list[int] | None:
    """The wire versions a hello's answer says the node speaks; None if it does not say. A node that
    predates negotiation names only the one version it speaks, as ``wire``."""
    speaks = hello.get("speaks")
    if isinstance(speaks, list):
        return sorted({v for v in speaks[:16] if isinstance(v, int) and not isinstance(v, bool)})
    wire = hello.get("wire")
    return [wire] if hello.get("ok") and isinstance(wire, int) and not isinstance(wire, bool) else None


def hop_versions(addresses: list[str], speaks: list[list[int]], chosen: list[int]) -> list[int]:
    """The wire version of each data hop of the ring: the client's two hops use what each end node chose
    with the client; a hop between two nodes uses the highest version both of them (and this client) speak."""
    hops = [chosen[0]]
    for k in range(1, len(addresses)):
        common = set(speaks[k - 1]) & set(speaks[k]) & set(WIRE_VERSIONS)
        if not common:
            raise DiffuseError(f"nodes {addresses[k - 1]} (wire versions {speaks[k - 1]}) and {addresses[k]} "
                               f"(wire versions {speaks[k]}) speak no version in common, so one cannot hand on to "
                               "the other: reorder --nodes, or start one of them with a --wire the other speaks")
        hops.append(max(common))
    return hops + [chosen[-1]]


class Handshake:
    """Control requests to the nodes of one session's route."""

    as_routed: frozenset = frozenset()  # stacks the nodes load where the route puts them, whatever their --blocks

    def __init__(self, plan: SlicingPlan, client_key: str | None = None, attention: str = "auto",
                 heard: Heard | None = None, request_id: str | None = None):
        from diffuse.wire.transport import transport_for

        if not plan.route:
            raise DiffuseError("the plan has no route: give --nodes or --local-nodes")
        for stage in plan.route:
            parse_node(stage.address + (f"#{stage.key}" if stage.key else ""))
        self.plan = plan
        self.heard = heard if heard is not None else Heard()  # what hellos and links said, for placement
        self.transports = [transport_for(s.address) for s in plan.route]
        self.identity = sealing.load_identity(client_key)
        self.attention = attention
        self.request_id = clean_request_id(request_id)  # told to every node in the open, which logs it with this session's events
        self.sid = os.urandom(SESSION_ID_BYTES)
        self.keys: list[bytes] = []
        self.hop_keys: list[bytes] = []  # the key of the hop into each node, then of the hop home
        self.opened: list[int] = []  # route positions whose node has this session open
        self.uncut: set[str] = set()  # stacks a node says must run uncut steps (two streams)
        self._misses = [0] * len(plan.route)
        self.wire: dict[str, int] = {}  # node address -> the wire version its hello chose
        self.fetch_wait_s = OPEN_TIMEOUT_S  # how long a node still fetching its slice is waited for (--timeout)
        self.say = None  # where the lines about that wait go (None: standard error; a ring's: its own)

    def _request(self, k: int, msg: dict, timeout: float) -> dict:
        return self.transports[k].request(self.plan.route[k].address, msg, timeout)

    def hello(self, k: int, expect_key: bytes | None = None) -> dict:
        stage = self.plan.route[k]
        ask = {"op": "hello", "wire": list(WIRE_VERSIONS)}
        t0 = time.perf_counter()
        hello = self._request(k, ask, HELLO_TIMEOUT_S)
        rtt = time.perf_counter() - t0
        if hello.get("ok") and isinstance(hello.get("fetch"), dict):  # --blocks, its slice still coming: wait
            from diffuse.client.fetchwait import until_fetched

            hello, rtt = until_fetched(stage.address, hello, lambda t: self._request(k, ask, t), self.fetch_wait_s,
                                       self.say)
        speaks = _speaks(hello)
        if speaks is not None and not set(speaks) & set(WIRE_VERSIONS):
            raise NodeError(stage.address, f"speaks wire versions {speaks}, this client speaks "
                            f"{list(WIRE_VERSIONS)}: nothing in common (start the node with a --wire this client "
                            "speaks, or update the older side)")
        if not hello.get("ok"):
            raise NodeError(stage.address, str(hello.get("error", "refused hello"))[:500])
        if speaks is None:
            raise NodeError(stage.address, "answered hello without naming the wire versions it speaks")
        key = hello.get("key")
        if not isinstance(key, bytes) or len(key) != 32 or not isinstance(hello.get("data"), str):
            raise NodeError(stage.address, "answered hello without a 32-byte key and a data address")
        best = max(set(speaks) & set(WIRE_VERSIONS))
        if hello.get("wire") != best:
            raise NodeError(stage.address, f"chose wire version {str(hello.get('wire'))[:16]} although both sides "
                            f"speak {best}: refusing")
        if best >= 2 and not (isinstance(hello.get("eph"), bytes) and len(hello["eph"]) == 32):
            raise NodeError(stage.address, "answered a wire-2 hello without its fresh 32-byte key")
        if expect_key is not None:
            if key != expect_key:
                raise NodeError(stage.address, "presented another key than a moment ago: refusing")
            if self.wire.get(stage.address, best) != best:
                raise NodeError(stage.address, "changed its wire version between two hellos: refusing")
        else:
            pin_key(stage.address, key, stage.key or None)
        if hello.get("model") != self.plan.model.content_hash:
            raise NodeError(stage.address, "serves a different model (content hash differs): "
                            "start it with the same model folder as the client, and the same --encoders and --decoder")
        if hello.get("slices") is not None:
            try:
                hello["slices"] = check_slices(hello["slices"], self.plan.lengths)
            except ContractError as exc:
                raise NodeError(stage.address, f"says it holds what this model does not have: {exc}") from None
        hello["speaks"] = speaks
        if hello.get("compiled") is True and stage.address not in _TOLD_COMPILED:
            _TOLD_COMPILED.add(stage.address)
            logging.getLogger("diffuse.client.ring").warning(
                "node %s runs its blocks compiled (--compile): results are close to plain diffusers/transformers, "
                "not byte-identical", stage.address[:200])
        self.heard.note_hello(stage.address, hello, rtt)  # what it says of its memory and speed, for placement
        if expect_key is None:  # the link to it: a few sealed pings, unless measured in the last minutes
            self.heard.client_link(self.transports[k], stage.address, self.identity, key)
        self.wire[stage.address] = best
        hello["at"] = time.monotonic()
        return hello

    def open(self, transport_inbox, inbox_key: bytes | None = None) -> tuple[SlicingPlan, frames.Hop, frames.Hop, str]:
        """Open the session on every node, from the last in route order back to the first. Returns the plan with
        the route the nodes' slices make, the client's two hops, and the first node's data address.
        ``inbox_key``: the CURVE server key of the client's inbox, which the last node's sending end checks."""
        hellos = [self.hello(k) for k in range(len(self.plan.route))]
        self.keys = [h["key"] for h in hellos]
        data = []
        for stage, h in zip(self.plan.route, hellos):
            d = h["data"]
            if "://0.0.0.0:" in d or "://*:" in d:  # bound on all interfaces: dial the host we reached
                d = stage.address.rsplit(":", 1)[0] + ":" + d.rsplit(":", 1)[1]
            data.append(d)
        plan = route_from_slices(self.plan, [h.get("slices") for h in hellos], self.as_routed)
        self.plan = plan
        hops = hop_versions([s.address for s in plan.route], [h["speaks"] for h in hellos],
                            [h["wire"] for h in hellos])
        hop_keys = self.hop_keys = [sealing.new_key() for _ in range(len(plan.route) + 1)]
        nexts = data[1:] + [transport_inbox]
        try:
            # from the last node back: each node's next hop already holds the session when its sending end
            # connects, and admits it (a data port lets in only an open session's sending end: ``diffuse.wire.admission``)
            for k, stage in reversed(list(enumerate(plan.route))):
                hello = hellos[k]
                if time.monotonic() - hello["at"] > CHALLENGE_FRESH_S:  # earlier nodes took long to load
                    hello = self.hello(k, self.keys[k])
                stage_plan = StagePlan(plan.model.content_hash, plan.compute_dtype, stage.slices, nexts[k],
                                       self.attention, hops[k], hops[k + 1], plan.model.commit, plan.quantize)
                payload = self._open_payload(k, hello, stage_plan, hop_keys[k], hop_keys[k + 1])
                if k + 1 < len(plan.route):  # the node measures its link to the next one (diffuse.wire.links)
                    payload.update(next_control=plan.route[k + 1].address, next_key=self.keys[k + 1])
                nxt = self.keys[k + 1] if k + 1 < len(plan.route) else inbox_key
                if nxt is not None:  # the next data port's CURVE key: no one in between can stand in for it
                    payload["next_server"] = nxt
                reply = self.sealed(k, "open", payload, OPEN_TIMEOUT_S)
                if k + 1 < len(plan.route):
                    self.heard.note_link(stage.address, plan.route[k + 1].address, links.Link.from_dict(reply.get("link")))
                self.opened.append(k)
                self.uncut.update(s for s in reply.get("uncut") or () if isinstance(s, str))
        except BaseException:
            self.close()  # the nodes that said yes free their session now, not at idle-out
            raise
        return (plan, frames.Hop(self.sid, hop_keys[0], wire=hops[0]), frames.Hop(self.sid, hop_keys[-1], wire=hops[-1]),
                data[0])

    def _open_payload(self, k: int, hello: dict, stage_plan: StagePlan, in_key: bytes, out_key: bytes) -> dict:
        """What an open tells node ``k``: at wire 1 its hop keys inside the seal to its long-term key; at wire 2
        under a key agreed from a fresh key of ours and the one its hello gave (ours is dropped on return)."""
        challenge = hello.get("challenge")
        payload = {"session": self.sid, "challenge": challenge, "stage": stage_plan.to_dict(), "wire": hello["wire"],
                   "offered": list(WIRE_VERSIONS)}  # the node checks that nobody talked us down to an older version
        if self.request_id:  # an older node ignores it
            payload["request_id"] = self.request_id
        if hello["wire"] == 1:
            return dict(payload, in_key=in_key, out_key=out_key)
        if not isinstance(challenge, bytes):
            raise NodeError(self.plan.route[k].address, "answered a wire-2 hello without a challenge")
        own = sealing.ephemeral()
        node_key, node_eph = self.keys[k], hello["eph"]
        try:
            key = sealing.agree("client", self.identity, own, node_key, node_eph,
                                sealing.open_transcript(self.identity.public, own.public, node_key, node_eph, self.sid,
                                                        challenge))
        except WireError as exc:
            raise NodeError(self.plan.route[k].address, f"its hello's fresh key is unusable ({exc}): refusing") from None
        return dict(payload, eph=own.public,
                    keys=sealing.seal_with(key, {"in_key": in_key, "out_key": out_key}, self.sid + challenge))

    def sealed(self, k: int, op: str, payload: dict, timeout: float) -> dict:
        """A sealed request; only a reply sealed by node ``k``'s key for this very operation, session and
        challenge counts (a close gets a fresh challenge of its own). A plain reply can only be a refusal
        (one made before the node could open the request)."""
        address, node_key = self.plan.route[k].address, self.keys[k]
        payload = dict(payload, op=op)
        if not isinstance(payload.get("challenge"), bytes):
            payload["challenge"] = os.urandom(16)
        msg = dict(sealing.seal_control(payload, node_key, self.identity), op=op)
        reply = self._request(k, msg, timeout)
        if "box" not in reply:
            if reply.get("ok"):
                raise NodeError(address, f"answered {op} without sealing the reply: refusing "
                                "(not the node whose key is pinned, or someone in between)")
            raise NodeError(address, str(reply.get("error", f"refused {op}"))[:500])
        try:
            inner, sender = sealing.open_control(reply, self.identity)
        except WireError as exc:
            raise NodeError(address, f"its {op} reply failed to open ({exc}): refusing") from None
        if sender != node_key:
            raise NodeError(address, f"its {op} reply is sealed by another key than the node's: refusing")
        if not isinstance(inner, dict) or inner.get("re") != op:
            raise NodeError(address, f"its sealed reply does not answer {op}: refusing")
        # a node of wire 2 or later names the session and challenge it answers; one of version 1 may not
        must_echo = self.wire.get(address, 1) >= 2
        for name in ("session", "challenge"):
            if (must_echo or name in inner) and inner.get(name) != payload.get(name):
                raise NodeError(address, f"its sealed {op} reply answers another session or request: refusing")
        if not inner.get("ok"):
            raise NodeError(address, str(inner.get("error", f"refused {op}"))[:500])
        return inner

    def _ping(self, k: int) -> dict:
        """A ping to node ``k``, with the proof that renews the session there (``sessions.ping_proof``)."""
        from diffuse.wire.tokens import ping_proof

        ping = {"op": "ping", "session": self.sid}
        if k < len(self.hop_keys):
            ping["proof"] = ping_proof(self.hop_keys[k], self.sid)
        return ping

    def probe(self, keepalive: bool = False, stalled: int | None = None) -> None:
        """Ask every node of the route whether it is alive and still has the session (each ping also
        renews the session's lease there); NodeError naming the first that is dead, frozen (two pings
        in a row unanswered, or one once a pass's answer is overdue), has lost the session or ended it on a
        failure (saying why, e.g. its next hop).
        ``keepalive``: a background renewal only, which never raises. ``stalled``: the sequence number
        of a pass whose answer never came; NodeError naming the hop where it stopped, if the nodes tell."""
        seen = []
        for k, stage in enumerate(self.plan.route):
            try:
                st = self._request(k, self._ping(k), PROBE_TIMEOUT_S)
            except NodeError:
                if keepalive:
                    continue
                self._misses[k] += 1
                misses = self._misses[k]
                if misses >= 2 or stalled is not None:
                    pings = "a ping" if misses == 1 else f"{misses} pings in a row"
                    raise NodeError(stage.address, f"stopped answering (no answer to {pings}, each given "
                                    f"{PROBE_TIMEOUT_S:g} s): the node is dead or frozen") from None
                continue
            if keepalive:
                continue
            self._misses[k] = 0
            failed = st.get("failed")
            if isinstance(failed, str):
                raise NodeError(stage.address, f"ended this session: {failed[:300]}")
            if st.get("session_known") is False:
                raise NodeError(stage.address, "no longer has this session (restarted, or it timed the session out)")
            seen.append(st.get("seen") if isinstance(st.get("seen"), int) else None)
        if stalled is None or len(seen) != len(self.plan.route) or None in seen:
            return
        route = self.plan.route
        for k, s in enumerate(seen):
            if s < stalled:  # the pass never reached node k
                if k == 0:
                    raise NodeError(route[0].address, f"never received pass #{stalled} from this client")
                raise NodeError(route[k - 1].address, f"did not hand pass #{stalled} on to its next hop "
                                f"{route[k].address} (unreachable from it, or not taking messages)")
        raise NodeError(route[-1].address, f"took pass #{stalled} and gave no answer within the timeout: it is "
                        "slower than --timeout allows, or this client's inbox is unreachable from it")

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> list[dict]:
        """Close the session wherever it is open; each node's report of what it did ({} if it did not say)."""
        reports = {}
        for k in self.opened:
            try:
                reports[k] = self.sealed(k, "close", {"session": self.sid}, timeout)
            except DiffuseError:
                reports[k] = {}
        self.opened = []
        return [reports.get(k, {}) for k in range(len(self.plan.route))]
