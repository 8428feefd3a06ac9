"""The client's control protocol with each node of a ring: hello, open, close, liveness.

``hello`` (plain) gives a node's key (pinned, or trusted on first use), data
address, model hash, the slices it holds (nodes started with ``--blocks``) and
a one-time challenge. ``open`` and ``close`` are sealed to the node's key and
carry their operation inside the seal; only a reply sealed by that key, for
that operation, counts. ``open`` tells each node its ``StagePlan``.
"""

from __future__ import annotations

import os
import time

from diffuse import frames, sealing
from diffuse.errors import DiffuseError, NodeError, WireError
from diffuse.known_nodes import parse_node, pin_key
from diffuse.plan import SESSION_ID_BYTES, WIRE_VERSION, ContractError, Slice, SlicingPlan, Stage, StagePlan, \
    check_slices

HELLO_TIMEOUT_S = 10.0
OPEN_TIMEOUT_S = 600.0  # opening may load blocks from disk
CLOSE_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 2.5  # a node that does not answer a ping this fast, twice in a row, is dead or frozen
CHALLENGE_FRESH_S = 60.0  # older than this, a hello's challenge is fetched again right before the open


def route_from_slices(plan: SlicingPlan, held: list[list[Slice] | None]) -> SlicingPlan:
    """The plan with each stage's slices set to what its node holds, checking that in route order they
    chain into every stack exactly; the plan unchanged unless every node says what it holds."""
    if not held or any(h is None for h in held):
        return plan
    mine = [{s.stack: s for s in h if not s.empty} for h in held]

    def refuse(why: str):
        order = "; ".join(f"{st.address}: {', '.join(map(str, m.values())) or 'nothing'}"
                          for st, m in zip(plan.route, mine))
        return DiffuseError(f"the nodes' slices do not chain into whole stacks in route order: {why} "
                            f"(route order: {order}); list the nodes in the order of their blocks, or change "
                            "their --blocks")

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


class Handshake:
    """Control requests to the nodes of one session's route."""

    def __init__(self, plan: SlicingPlan, client_key: str | None = None, attention: str = "auto"):
        from diffuse.plugins import transport_for

        if not plan.route:
            raise DiffuseError("the plan has no route: give --nodes or --local-nodes")
        for stage in plan.route:
            parse_node(stage.address + (f"#{stage.key}" if stage.key else ""))
        self.plan = plan
        self.transports = [transport_for(s.address) for s in plan.route]
        self.identity = sealing.load_identity(client_key)
        self.attention = attention
        self.sid = os.urandom(SESSION_ID_BYTES)
        self.keys: list[bytes] = []
        self.opened: list[int] = []  # route positions whose node has this session open
        self.uncut: set[str] = set()  # stacks a node says must run uncut steps (two streams)
        self._misses = [0] * len(plan.route)

    def _request(self, k: int, msg: dict, timeout: float) -> dict:
        return self.transports[k].request(self.plan.route[k].address, msg, timeout)

    def hello(self, k: int, expect_key: bytes | None = None) -> dict:
        stage = self.plan.route[k]
        hello = self._request(k, {"op": "hello", "wire": [WIRE_VERSION]}, HELLO_TIMEOUT_S)
        if not hello.get("ok"):
            raise NodeError(stage.address, str(hello.get("error", "refused hello"))[:500])
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
        if hello.get("slices") is not None:
            try:
                hello["slices"] = check_slices(hello["slices"], self.plan.lengths)
            except ContractError as exc:
                raise NodeError(stage.address, f"says it holds what this model does not have: {exc}") from None
        hello["at"] = time.monotonic()
        return hello

    def open(self, transport_inbox) -> tuple[SlicingPlan, frames.Hop, frames.Hop, str]:
        """Open the session on every node, in route order. Returns the plan with the route the nodes'
        slices make, the client's two hops, and the first node's data address."""
        hellos = [self.hello(k) for k in range(len(self.plan.route))]
        self.keys = [h["key"] for h in hellos]
        data = []
        for stage, h in zip(self.plan.route, hellos):
            d = h["data"]
            if "://0.0.0.0:" in d or "://*:" in d:  # bound on all interfaces: dial the host we reached
                d = stage.address.rsplit(":", 1)[0] + ":" + d.rsplit(":", 1)[1]
            data.append(d)
        plan = route_from_slices(self.plan, [h.get("slices") for h in hellos])
        self.plan = plan
        hop_keys = [sealing.new_key() for _ in range(len(plan.route) + 1)]
        nexts = data[1:] + [transport_inbox]
        try:
            for k, stage in enumerate(plan.route):
                hello = hellos[k]
                if time.monotonic() - hello["at"] > CHALLENGE_FRESH_S:  # earlier nodes took long to load
                    hello = self.hello(k, self.keys[k])
                stage_plan = StagePlan(plan.model.content_hash, plan.compute_dtype, stage.slices, nexts[k],
                                       self.attention)
                payload = {"session": self.sid, "challenge": hello.get("challenge"), "in_key": hop_keys[k],
                           "out_key": hop_keys[k + 1], "stage": stage_plan.to_dict()}
                reply = self.sealed(k, "open", payload, OPEN_TIMEOUT_S)
                self.opened.append(k)
                self.uncut.update(s for s in reply.get("uncut") or () if isinstance(s, str))
        except BaseException:
            self.close()  # the nodes that said yes free their session now, not at idle-out
            raise
        return plan, frames.Hop(self.sid, hop_keys[0]), frames.Hop(self.sid, hop_keys[-1]), data[0]

    def sealed(self, k: int, op: str, payload: dict, timeout: float) -> dict:
        """A sealed request; only a reply sealed by node ``k``'s key for this very operation counts.
        A plain reply can only be a refusal (one made before the node could open the request)."""
        address, node_key = self.plan.route[k].address, self.keys[k]
        msg = dict(sealing.seal_control(dict(payload, op=op), node_key, self.identity), op=op)
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
        if not inner.get("ok"):
            raise NodeError(address, str(inner.get("error", f"refused {op}"))[:500])
        return inner

    def probe(self, keepalive: bool = False, stalled: int | None = None) -> None:
        """Ask every node of the route whether it is alive and still has the session (each ping also
        renews the session's lease there); NodeError naming the first that is dead, frozen (two pings
        unanswered), has lost the session or ended it on a failure (saying why, e.g. its next hop).
        ``keepalive``: a background renewal only, which never raises. ``stalled``: the sequence number
        of a pass whose answer never came; NodeError naming the hop where it stopped, if the nodes tell."""
        seen = []
        for k, stage in enumerate(self.plan.route):
            try:
                st = self._request(k, {"op": "ping", "session": self.sid}, PROBE_TIMEOUT_S)
            except NodeError:
                if keepalive:
                    continue
                self._misses[k] += 1
                if self._misses[k] >= 2 or stalled is not None:
                    raise NodeError(stage.address, f"stopped answering (no answer to two pings of "
                                    f"{PROBE_TIMEOUT_S:.0f} s): the node is dead or frozen") from None
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
