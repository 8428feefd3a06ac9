"""The node: hold slices of a model's block stacks and serve them (its command line: ``diffuse.node.command``).

Control requests (``diffuse.node.control``) are answered on this thread at once;
data messages are computed on a second thread (``diffuse.node.compute``), so a
node answers pings while its blocks run.
The control thread never waits for the compute thread: a data message waits
for it only once its envelope names an open session and its header opens under
that session's hop key (anything else is dropped at the door), and never more
than ``MAX_QUEUED`` of them; an ended session's sending end is handed over
without waiting. A bad frame is logged with its reason and dropped; the node
goes on serving, whatever a message holds.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from diffuse.wire import frames
from diffuse.wire import sealing
from diffuse.errors import DiffuseError, WireError
from diffuse.node.batches import PARTS  # noqa: F401 (said here too)
from diffuse.node.compute import MAX_PASS_LOG, Arrived, ComputeThread  # noqa: F401 (the limits, said here too)
from diffuse.node.control import NodeControl, refusal
from diffuse.node.metrics import NodeTally
from diffuse.wire.links import NextHop
from diffuse.plan.reports import SpeedBook
from diffuse.plan.contracts import StackPlan, parse_slices
from diffuse.processes import alive
from diffuse.node.sessions import SessionTable

log = logging.getLogger("diffuse.node")

MAX_QUEUED = 256  # data messages waiting for the compute thread; more are dropped (and logged)
MAX_SESSIONS = 256  # open sessions in all (each holds a socket toward its next hop)
MAX_SESSIONS_PER_CLIENT = 16  # open sessions of one client key: one key's flood leaves room for the others
FDS_PER_SESSION = 3  # a ZeroMQ socket's own descriptor, its connection, one being reconnected
FDS_KEPT = 128  # descriptors left for everything else (model files, libraries, the node's own sockets)


class StateTally:
    """Bytes of per-session state (language models' key/value caches) held now, kept as it changes so
    that reading the total costs nothing. Written by the compute thread, read by anyone."""

    def __init__(self):
        self.lock = threading.Lock()
        self.held: dict[bytes, int] = {}
        self.total = 0

    def set(self, sid: bytes, nbytes: int) -> None:
        with self.lock:
            self.total += nbytes - self.held.get(sid, 0)
            self.held[sid] = nbytes

    def drop(self, sid: bytes) -> None:
        with self.lock:
            self.total -= self.held.pop(sid, 0)


def session_capacity(wanted: int, max_sockets: int | None) -> int:
    """At most ``wanted`` sessions, and no more than the descriptors and ZeroMQ sockets this process may
    open leave room for: a node at its limit refuses an open in one line instead of failing every socket."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fit = wanted if soft == resource.RLIM_INFINITY else (soft - FDS_KEPT) // FDS_PER_SESSION
    return max(1, min(wanted, fit, (max_sockets or wanted + 16) - 16))


@dataclass
class NodeOptions:
    """How a node serves, as its command line's flags of the same meaning give it."""

    allowed_clients: set[bytes] | None = None  # --allow-client: the only client keys it serves (None: any)
    advertise: str | None = None  # --advertise-data: the data address peers dial, where it differs from the bound one
    max_message_bytes: int | None = None  # --max-message-mb
    max_sessions: int = MAX_SESSIONS
    max_sessions_per_client: int = MAX_SESSIONS_PER_CLIENT
    batch: bool = True  # decoding passes of several sessions as one batch (--no-batch: off)
    compute: object = None  # a diffuse.plan.devices.Compute: --device and --dtype (None: the CPU, as each session asks)
    compiled: bool = False  # --compile
    encoders: bool = False  # --encoders ring: the pipeline's encoders' stacks are served too (diffuse.plan.encoders)
    decoders: bool = False  # --decoder ring: its VAE's stack of one block too, held when a client names this node


class Node:
    def __init__(self, model_path: str, listen: str, blocks: str | None, key_file: str | None,
                 options: NodeOptions | None = None):
        o = options or NodeOptions()
        allowed_clients, advertise, max_message_bytes = o.allowed_clients, o.advertise, o.max_message_bytes
        max_sessions, max_sessions_per_client, batch = o.max_sessions, o.max_sessions_per_client, o.batch
        compute, compiled = o.compute, o.compiled
        from diffuse.plan.analysis import ModelSubject
        from diffuse.plan.decoders import without_decoders
        from diffuse.plan.planner import config_draft
        from diffuse.wire.transport import transport_for
        from diffuse.wire.sealing import load_identity
        from diffuse.node.stage import BlockStore

        self.transport = transport_for(listen)
        subject = ModelSubject.from_path(model_path, o.encoders, o.decoders)
        draft = config_draft(subject, wanted={"stacks", "two_stream"})  # not the pipeline's output: it loads far more
        self.stacks: list[StackPlan] = draft["stacks"]
        self.two_stream: dict[str, bool] = dict(draft.get("two_stream", {}))  # such stacks run uncut steps
        self.store = BlockStore(model_path, subject, self.stacks, compute)
        self.store.compiled = compiled  # --compile: each block through torch.compile as it loads (not exact)
        self.runs_on = self.store.compute  # where its blocks compute and in what (--device, --dtype)
        self.device = self.runs_on.device
        # a VAE (--decoder ring) is no part of --blocks: it is loaded when a client names this node to hold it
        self.store.fixed = parse_slices(blocks, without_decoders(self.stacks, subject))
        self.speeds = SpeedBook(self.store.model_hash)  # its own measured speed, said at hello (diffuse.plan.placement)
        self.next_hops = NextHop()  # its links to the next hops it was given (diffuse.wire.links)
        self.max_memory: int | None = None  # --max-memory, in bytes
        self.to_fetch: dict | None = None  # --blocks: the slice's tensors, where some are not on this disk yet
        if self.store.fixed:
            from diffuse.plan.hubmodel import check_slice_room

            # a Hub model's: room for all of it, first; what is still to fetch, fetched by hold_slice
            self.to_fetch = check_slice_room(subject, self.stacks, self.store.fixed)
        self.fetching = None  # while --blocks fetches the slice: its diffuse.plan.fetchprogress.Progress
        self.identity = load_identity(key_file)
        self.allowed = allowed_clients
        self.sessions = SessionTable()
        self.refused_connections = 0  # data connections that named no open session (or not with its token)
        self.tally = NodeTally()  # what it has done: passes, bytes, busy time, refusals, evictions (its status, metrics)
        self.metrics_url: str | None = None  # where its metrics are scraped (--metrics-port), once open
        from diffuse.wire.admission import receiving  # CURVE under the node's key, or the older token

        self.endpoint = self.transport.serve(listen, max_message_bytes, **receiving(
            self.transport, self.identity, self.admit_connection, self.admit_connection))
        self.max_sessions = session_capacity(max_sessions, getattr(self.transport, "max_sockets", None))
        if self.max_sessions < max_sessions:
            log.warning("at most %d sessions at once: the open-file limit leaves room for no more (raise it "
                        "with ulimit -n)", self.max_sessions)
        self.max_sessions_per_client = min(max_sessions_per_client, self.max_sessions)
        self.state_bytes = StateTally()
        self.data_address = advertise or self.endpoint.address  # what peers dial (differs behind NAT or a relay)
        self.control = NodeControl(self)
        self.worker = ComputeThread(self)  # what runs on the compute thread
        self.work: queue.Queue = queue.Queue(MAX_QUEUED)  # frames to compute, or ("close", outbox)
        self.closing: collections.deque = collections.deque()  # outboxes to close that found the queue full
        # decoding passes of several sessions batched through the layers (language models only; --no-batch)
        self.batching = batch and bool(getattr(subject, "autoregressive", False))
        self.batches = self.batched_rows = self.batch_fallbacks = 0  # counted by the compute thread
        self.idle_s = 0.0  # the compute thread's waits for work not yet counted in a call's record

    def hold_slice(self) -> None:
        """``--blocks``: the slice held before the node serves. A Hub model's tensors not on this disk are fetched
        first on a thread of their own, while this (control) thread answers hello and status, both saying how
        far the fetch got (``fetch``), and refuses opens until it ends; then the slice loads from the disk,
        here, as a session's open loads one (no control request is answered meanwhile)."""
        if not self.store.fixed:
            return
        if self.to_fetch:
            self._fetch_answering(self.to_fetch)
            self.to_fetch = None
        self.store.load(self.store.fixed)

    def _fetch_answering(self, needs: dict) -> None:
        """``needs`` fetched on a thread of its own (``diffuse.plan.fetching.hold``) while this thread answers
        control requests; its error, if it ends in one, raised here."""
        from diffuse.plan.fetching import hold

        ended: list[BaseException] = []

        def fetch() -> None:
            try:
                hold(needs, watch=self._fetching)
            except BaseException as exc:  # noqa: BLE001 (raised again on the control thread)
                ended.append(exc)

        fetcher = threading.Thread(target=fetch, name="fetch", daemon=True)
        fetcher.start()
        try:
            while fetcher.is_alive():
                for ready in self.endpoint.wait(0.2):
                    if ready == "control":
                        self._serve_control()
                    else:
                        self.admit(self.endpoint.recv_data())  # no session is open yet: dropped, as any stranger's
                fetcher.join(0.01)
        finally:
            self.fetching = None
        if ended:
            raise ended[0]

    def _fetching(self, progress) -> None:
        self.fetching = progress
        log.info("fetching its slice (%s) before serving it; meanwhile hello and status are answered at %s (key %s)",
                 ", ".join(map(str, self.store.fixed)), self.endpoint.control_address, self.identity.public_hex)

    def admit_connection(self, key, password=None) -> bool:
        """Asked by the transport (its own thread) about each new connection to the data port, before any of
        its bytes are taken: only a sending end of an open session is let in, by its CURVE client ``key`` (or,
        on a transport that ``admits`` only, by the session id and token in ``key`` and ``password``); a
        stranger's connection is closed at once and costs the node nothing it buffers."""
        if self.sessions.admits_key(key) if password is None else self.sessions.admits(key, password):
            return True
        self.refused_connections += 1
        log.debug("refused a connection to the data port: it names no open session, or not with its token",
                  extra={"event": "refused", "reason": "data_connection"})
        return False

    def admit(self, raw: list[bytes]) -> Arrived | None:
        """On the control thread: whether a data message may wait for the compute thread. Its envelope must
        name an open session, carry that hop's wire version, a counter not yet accepted and the frame count
        it has, and its header frame must open under the session's hop key: a stranger's message is dropped
        here, at the cost of opening one small frame, and never takes a place in the compute thread's queue.
        What is admitted waits with its envelope and opened header, which the compute thread does not read again."""
        env, sess = self._addressed(raw)
        if sess is None:
            self.tally.refused("message")
            return None
        hop = sess.in_hop
        try:
            frames.check_envelope(hop, env, raw)
            plain = sealing.open_frame(hop.key, env["c"], 1, bytes(raw[0]), bytes(raw[1]))
        except WireError as exc:
            log.warning("rejected a message for session %s: %s", sess.sid.hex()[:8], exc,
                        extra=self.sessions.event("refused", sess.sid, reason="message", error=str(exc)[:300]))
            self.tally.refused("message")
            return None
        sess.last_used = time.monotonic()  # authentic data: the session is in use (``NodeControl._make_room``)
        return Arrived(raw, env, hop, plain)

    def _addressed(self, raw: list[bytes]) -> tuple[dict | None, "object | None"]:
        """A data message's envelope and the open session it names; (envelope or None, None), said in the log, when
        it names none."""
        try:
            env = frames.envelope_of(raw)
        except WireError as exc:
            log.warning("rejected a message: %s", exc, extra={"event": "refused", "reason": "message"})
            return None, None
        sess = self.sessions.get(env["s"])
        if sess is None:
            log.warning("rejected a message: unknown session %s", env["s"].hex()[:8],
                        extra={"event": "refused", "reason": "message", "session": env["s"].hex()[:8]})
        return env, sess

    def end(self, sid: bytes, failed: str | None = None) -> None:
        """End a session (control thread, never waiting): its outbox is closed by the compute thread, after the
        messages queued before this, or as soon as it is free when the queue is full. ``failed``: why it ended,
        for its client's next ping."""
        outbox = self.sessions.end(sid, failed=failed)
        self.state_bytes.drop(sid)
        if outbox is not None:
            try:
                self.work.put_nowait(("close", outbox))
            except queue.Full:
                self.closing.append(outbox)

    # -- the serving loop (control thread) ----------------------------------------
    def serve(self, until: float | None = None, parent: int | None = None) -> None:
        worker = threading.Thread(target=self.worker.compute, args=(torch.get_num_threads(),), name="compute",
                                  daemon=True)
        worker.start()
        try:
            while until is None or time.monotonic() < until:
                if parent is not None and not alive(parent):
                    log.info("the process that started this node (%d) is gone: stopping", parent)
                    return
                for ready in self.endpoint.wait(1.0):
                    # one bad message costs that message, never the node
                    try:
                        if ready == "control":
                            self._serve_control()
                        else:
                            arrived = self.admit(self.endpoint.recv_data())
                            if arrived is None:
                                continue
                            try:
                                self.work.put_nowait(arrived)
                            except queue.Full:
                                self.tally.refused("queue_full")
                                log.warning("dropped a data message: %d already wait for the compute thread",
                                            MAX_QUEUED, extra={"event": "refused", "reason": "queue_full"})
                    except Exception:
                        log.exception("dropped a %s message that failed unexpectedly; still serving", ready)
                for sid in self.sessions.idle():
                    log.info("session %s idle: closed", sid.hex()[:8],
                             extra=self.sessions.event("session_evicted", sid, reason="idle"))
                    self.tally.evicted("idle")
                    self.end(sid)
        finally:
            try:
                self.work.put(None, timeout=5.0)
            except queue.Full:
                log.warning("the compute thread did not take the stop in 5 s; stopping without it")
            worker.join(5.0)

    def _serve_control(self) -> None:
        try:
            reply = self.control.handle(self.endpoint.recv_control())
        except (WireError, DiffuseError) as exc:
            log.warning("control request refused: %s", exc)
            self.tally.refused("request")
            reply = refusal(str(exc))
        except Exception as exc:
            log.exception("control request failed")
            self.tally.refused("error")
            reply = refusal(f"{type(exc).__name__}: {exc}")
        self.endpoint.reply_control(reply)  # a request taken off the socket is always answered
