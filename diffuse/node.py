"""``python -m diffuse.node``: hold slices of a model's block stacks and serve them.

The node prints one JSON line when it is ready (its control address, data
address and public key), then serves until stopped. Control requests
(``diffuse.node_control``) are answered on this thread at once; data messages
are computed on a second thread, so a node answers pings while its blocks run.
The control thread never waits for the compute thread: a data message waits
for it only once its envelope names an open session and its header opens under
that session's hop key (anything else is dropped at the door), and never more
than ``MAX_QUEUED`` of them; an ended session's sending end is handed over
without waiting. A bad frame is logged with its reason and dropped; the node
goes on serving, whatever a message holds.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import queue
import signal
import sys
import threading
import time

import torch

from diffuse import discovery, frames, sealing
from diffuse.batching import MAX_BATCH, batch_key, run_batch
from diffuse.devices import to_device, to_host
from diffuse.text import plain
from diffuse.errors import DiffuseError, MalformedHeader, WireError
from diffuse.home import config_home
from diffuse.node_control import NodeControl, refusal
from diffuse.links import NextHop
from diffuse.placement import SpeedBook
from diffuse.plan import WIRE_VERSIONS, StackPlan, parse_slices
from diffuse.processes import alive
from diffuse.sessions import SessionTable
from diffuse.stage import NODE_BUFFER_BYTES, Pass
from diffuse.transport_api import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger("diffuse.node")

MAX_QUEUED = 256  # data messages waiting for the compute thread; more are dropped (and logged)
# where a call's time went on a node, in the order of its per-call record (after the sequence number): the
# compute thread idle before it, opening its frames, checking it, its blocks (wall, then CPU), building what it
# hands on, sealing and sending that, and the page faults its blocks took
PARTS = ("idle", "open", "prepare", "blocks", "blocks_cpu", "finish", "seal", "faults")
MAX_SESSIONS = 256  # open sessions in all (each holds a socket toward its next hop)
MAX_PASS_LOG = 4096  # per-pass records a session keeps (bytes in, busy time): the latest, with running totals
MAX_SESSIONS_PER_CLIENT = 16  # open sessions of one client key: one key's flood leaves room for the others
FDS_PER_SESSION = 3  # a ZeroMQ socket's own descriptor, its connection, one being reconnected
FDS_KEPT = 128  # descriptors left for everything else (model files, libraries, the node's own sockets)


def _keep(records: list, record: list) -> None:
    """Append a per-pass record, keeping the latest ``MAX_PASS_LOG`` (totals are counted apart): a long
    session's records, and the close reply that carries them, stay bounded."""
    records.append(record)
    if len(records) > MAX_PASS_LOG:
        del records[:len(records) - MAX_PASS_LOG]


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


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of handing it back: without this, every large activation a
    block makes (tens of MiB) is a fresh mapping, page-faulted and zeroed by the kernel on every call, the more so
    on the compute thread, whose own arena trims eagerly. Placement within a page is unchanged (torch aligns
    every tensor itself), so results are the same bits. False where this is not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return bool(libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20)
                and libc.mallopt(m_arena_max, 1))


def compile_unavailable() -> str | None:
    """Why ``--compile`` cannot work here (inductor missing, or no C compiler for its CPU kernels), or None."""
    import shutil

    try:
        import torch._inductor  # noqa: F401
    except Exception as exc:
        return f"torch's inductor compiler is not available in this torch ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available() and not any(shutil.which(c) for c in ("cc", "gcc", "clang", "g++")):
        return "inductor compiles CPU kernels with a C compiler, and none is on PATH (install gcc)"
    return None


def _faults() -> int:
    """Minor page faults of the calling thread so far (0 where the system does not count per thread)."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_minflt if who is not None else 0


class Incoming:
    """A data message opened on the compute thread: its session, header and tensors; once prepared, the pass
    to run (``pass_``) or the message to send at once (``reply``); its batch key (``diffuse.batching``); where
    its time went (``parts``: wall seconds of each stage, for ``python -m diffuse.bench``)."""

    __slots__ = ("sess", "header", "tensors", "malformed", "pass_", "reply", "key", "busy", "t0", "parts")

    def __init__(self, sess, header: dict, tensors: list, malformed: str | None, t0: float = 0.0):
        self.sess, self.header, self.tensors, self.malformed = sess, header, tensors, malformed
        self.t0 = t0 or time.perf_counter()  # when it began to be opened
        self.pass_: Pass | None = None
        self.reply: tuple[dict, list] | None = None
        self.key: tuple | None = None
        self.busy = 0.0  # seconds its preparing and running took
        self.parts = dict.fromkeys(PARTS, 0.0)

    def timed(self, part: str, since: float) -> float:
        """Add the wall time from ``since`` to ``part``; the time now."""
        now = time.perf_counter()
        self.parts[part] += now - since
        return now

    def spent(self, seconds: float) -> None:
        """Count ``seconds`` of work on this message (the compute thread's own CPU time: waiting for a core
        another process holds is not work) in its session's busy time, and per call in its busy log."""
        self.busy += seconds
        self.sess.busy_s += seconds


class Node:
    def __init__(self, model_path: str, listen: str, blocks: str | None, key_file: str | None,
                 allowed_clients: set[bytes] | None = None, advertise: str | None = None,
                 max_message_bytes: int | None = None, max_sessions: int = MAX_SESSIONS,
                 max_sessions_per_client: int = MAX_SESSIONS_PER_CLIENT, batch: bool = True, compute=None,
                 compiled: bool = False):
        from diffuse.analysis import ModelSubject
        from diffuse.planner import config_draft
        from diffuse.plugins import transport_for
        from diffuse.sealing import load_identity
        from diffuse.stage import BlockStore

        self.transport = transport_for(listen)
        subject = ModelSubject.from_path(model_path)
        draft = config_draft(subject, wanted={"stacks", "two_stream"})  # not the pipeline's output: it loads far more
        self.stacks: list[StackPlan] = draft["stacks"]
        self.two_stream: dict[str, bool] = dict(draft.get("two_stream", {}))  # such stacks run uncut steps
        self.store = BlockStore(model_path, subject, self.stacks, compute)
        self.store.compiled = compiled  # --compile: each block through torch.compile as it loads (not exact)
        self.runs_on = self.store.compute  # where its blocks compute and in what (--device, --dtype)
        self.device = self.runs_on.device
        self.store.fixed = parse_slices(blocks, self.stacks)
        self.speeds = SpeedBook(self.store.model_hash)  # its own measured speed, said at hello (diffuse.placement)
        self.next_hops = NextHop()  # its links to the next hops it was given (diffuse.links)
        self.max_memory: int | None = None  # --max-memory, in bytes
        if self.store.fixed:
            self.store.load(self.store.fixed)
        self.identity = load_identity(key_file)
        self.allowed = allowed_clients
        self.sessions = SessionTable()
        self.refused_connections = 0  # data connections that named no open session (or not with its token)
        admits = {"admit": self.admit_connection} if getattr(self.transport, "admits", False) else {}
        self.endpoint = self.transport.serve(listen, max_message_bytes, **admits)
        self.max_sessions = session_capacity(max_sessions, getattr(self.transport, "max_sockets", None))
        if self.max_sessions < max_sessions:
            log.warning("at most %d sessions at once: the open-file limit leaves room for no more (raise it "
                        "with ulimit -n)", self.max_sessions)
        self.max_sessions_per_client = min(max_sessions_per_client, self.max_sessions)
        self.state_bytes = StateTally()
        self.data_address = advertise or self.endpoint.address  # what peers dial (differs behind NAT or a relay)
        self.control = NodeControl(self)
        self.work: queue.Queue = queue.Queue(MAX_QUEUED)  # frames to compute, or ("close", outbox)
        self.closing: collections.deque = collections.deque()  # outboxes to close that found the queue full
        # decoding passes of several sessions batched through the layers (language models only; --no-batch)
        self.batching = batch and bool(getattr(subject, "autoregressive", False))
        self.batches = self.batched_rows = self.batch_fallbacks = 0  # counted by the compute thread
        self.idle_s = 0.0  # the compute thread's waits for work not yet counted in a call's record

    def admit_connection(self, user, password) -> bool:
        """Asked by the transport (its own thread) about each new connection to the data port, before any of
        its bytes are taken: only a sending end of an open session, with that session's token, is let in; a
        stranger's connection is closed at once and costs the node nothing it buffers."""
        if self.sessions.admits(user, password):
            return True
        self.refused_connections += 1
        log.debug("refused a connection to the data port: it names no open session, or not with its token")
        return False

    # -- data (compute thread) ---------------------------------------------------
    def data(self, raw: list[bytes]) -> None:
        """One data message, alone: opened, handled, sealed and sent on."""
        m = self._open(raw)
        if m is not None:
            self._prepare(m)
            self._solo(m)

    def admit(self, raw: list[bytes]) -> bool:
        """On the control thread: whether a data message may wait for the compute thread. Its envelope must
        name an open session, carry that hop's wire version, a counter not yet accepted and the frame count
        it has, and its header frame must open under the session's hop key: a stranger's message is dropped
        here, at the cost of opening one small frame, and never takes a place in the compute thread's queue."""
        env, sess = self._addressed(raw)
        if sess is None:
            return False
        hop = sess.in_hop
        try:
            frames.check_envelope(hop, env, raw)
            sealing.open_frame(hop.key, env["c"], 1, bytes(raw[0]), bytes(raw[1]))
        except WireError as exc:
            log.warning("rejected a message for session %s: %s", sess.sid.hex()[:8], exc)
            return False
        sess.last_used = time.monotonic()  # authentic data: the session is in use (``NodeControl._make_room``)
        return True

    def _addressed(self, raw: list[bytes]) -> tuple[dict | None, "object | None"]:
        """A data message's envelope and the open session it names; (envelope or None, None), said in the log, when
        it names none."""
        try:
            env = frames.envelope_of(raw)
        except WireError as exc:
            log.warning("rejected a message: %s", exc)
            return None, None
        sess = self.sessions.get(env["s"])
        if sess is None:
            log.warning("rejected a message: unknown session %s", env["s"].hex()[:8])
        return env, sess

    def _open(self, raw: list[bytes]) -> "Incoming | None":
        t0 = time.perf_counter()
        env, sess = self._addressed(raw)
        if sess is None:
            return None
        malformed = None
        try:
            header, tensors = frames.open_message(sess.in_hop, raw)
            tensors = to_device(tensors, self.device)  # the CPU's: as they are
        except MalformedHeader as exc:  # its sender is authentic: it hears why, in one line
            header, tensors, malformed = {}, [], f"malformed header: {exc}"
        except WireError as exc:
            log.warning("rejected a message for session %s: %s", sess.sid.hex()[:8], exc)
            return None
        nbytes = sum(len(f) for f in raw)
        sess.bytes_in += nbytes
        sess.messages += 1
        if header.get("op") == "call":
            _keep(sess.hop_log, [header.get("seq"), nbytes])
        m = Incoming(sess, header, tensors, malformed, t0)
        m.timed("open", t0)
        return m

    def _failed(self, m: "Incoming", exc: Exception) -> None:
        """The message that answers a call that failed: the client hears of it; the node keeps serving."""
        sid = m.sess.sid.hex()[:8]
        if isinstance(exc, DiffuseError):  # a malformed call: one line
            log.warning("session %s: %s", sid, exc)
            text = str(exc)
        else:  # logged in one line
            text = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            log.warning("call failed in session %s: %s", sid, text)
            log.debug("call failed", exc_info=True)
        m.reply = (self._error(m.header, text), [])

    def _prepare(self, m: "Incoming") -> None:
        """Check and take apart a message (``StageSession.prepare``): ``m.pass_`` to run, or ``m.reply`` at once."""
        sess = m.sess
        t0, w0 = time.thread_time(), time.perf_counter()
        sess.room = NODE_BUFFER_BYTES - self.sessions.buffer_bytes(but=sess)  # what the other sessions left
        try:
            if m.malformed:
                raise DiffuseError(m.malformed)
            got = sess.prepare(m.header, m.tensors)
        except Exception as exc:
            self._failed(m, exc)
        else:
            if isinstance(got, Pass):
                m.pass_ = got
            else:
                m.reply = got
        m.spent(time.thread_time() - t0)
        m.timed("prepare", w0)

    def _solo(self, m: "Incoming") -> None:
        """Run a prepared message alone, then send what it made."""
        if m.reply is None:
            t0, f0 = time.thread_time(), _faults()
            try:
                with torch.no_grad():
                    w0 = time.perf_counter()
                    out = m.sess.run(m.pass_)
                    if self.device.type == "cuda":  # the kernels done, so the speed measured is theirs
                        torch.cuda.synchronize(self.device)
                    ran = time.perf_counter() - w0
                    self.speeds.add(m.pass_, m.sess.dtype, ran)
                w1 = m.timed("blocks", w0)
                m.parts["blocks_cpu"] += time.thread_time() - t0
                m.parts["faults"] += _faults() - f0
                m.reply = m.sess.finish(m.pass_, out)
                m.timed("finish", w1)
                if getattr(m.pass_.part, "tail", None) is not None:  # the output head's work: planned as weights
                    ran = time.perf_counter() - w0
            except Exception as exc:
                self._failed(m, exc)
                ran = None
            m.spent(time.thread_time() - t0)
            self._send(m)
            if ran is not None:  # its opening, checking, sealing and sending, besides its blocks
                self.speeds.overhead(m.pass_, time.perf_counter() - m.t0 - ran)
            return
        self._send(m)

    def _batch(self, group: list["Incoming"]) -> None:
        """Decoding passes of different sessions through the layers as one batch (``diffuse.batching``); each
        session's tail and message then as for a lone pass. What cannot be batched runs one by one."""
        t0, w0 = time.thread_time(), time.perf_counter()
        try:
            outs = run_batch([m.pass_ for m in group])
        except Exception as exc:
            log.debug("a batch of %d passes ran one by one: %s", len(group), exc)
            self.batch_fallbacks += 1
            for m in group:
                self._solo(m)
            return
        rows = sum(out.shape[0] if isinstance(out, torch.Tensor) else 1 for out in outs)
        self.batches += 1
        self.batched_rows += rows
        share = (time.thread_time() - t0) / len(group)
        wall = (time.perf_counter() - w0) / len(group)
        for m, out in zip(group, outs):
            m.parts["blocks"] += wall
            m.parts["blocks_cpu"] += share
            t1, w1 = time.thread_time(), time.perf_counter()
            m.sess.batched_passes += 1
            try:
                m.reply = m.sess.finish(m.pass_, out)
            except Exception as exc:
                self._failed(m, exc)
            m.spent(share + time.thread_time() - t1)
            m.timed("finish", w1)
        for m in group:
            self._send(m)

    def _send(self, m: "Incoming") -> None:
        sess = m.sess
        if hasattr(sess, "kv"):
            self.state_bytes.set(sess.sid, sess.kv.nbytes())
            if self.sessions.get(sess.sid) is not sess:  # closed while it computed: its state went with it
                self.state_bytes.drop(sess.sid)
        out_header, out_tensors = m.reply
        call = m.header.get("op") == "call" and type(m.header.get("seq")) is int
        if call:
            _keep(sess.busy_log, [m.header["seq"], m.busy])
        w0 = time.perf_counter()
        out = frames.seal_message(sess.out_hop, out_header, to_host(out_tensors))  # the CPU's: as they are
        sess.bytes_out += sum(len(f) for f in out)
        outbox = self.sessions.outbox(sess.sid)
        if outbox is None:
            return  # closed while it computed
        try:
            outbox.send(out)
        except DiffuseError as exc:
            self._give_up(sess.sid, outbox, exc)
        m.timed("seal", w0)
        if call:
            _keep(sess.parts_log, [m.header["seq"]] + [round(m.parts[k], 6) for k in PARTS])

    def serve_taken(self, items: list) -> None:
        """What the compute thread took from its queue at once, in arrival order, except that decoding passes
        of different sessions that fit together run as one batch when the first of them comes up (each
        session's messages keep their order: only a session's earliest waiting message joins a batch)."""
        entries: list = []
        for item in items:
            if isinstance(item, tuple):
                entries.append(item)
                continue
            try:
                m = self._open(item)
            except Exception as exc:
                log.warning("dropped a data message that failed unexpectedly (%s); still serving", type(exc).__name__)
                log.debug("dropped", exc_info=True)
                continue
            if m is not None:
                m.parts["idle"], self.idle_s = self.idle_s, 0.0
                entries.append(m)
        while entries:
            e = entries.pop(0)
            try:
                if isinstance(e, tuple):
                    if e:
                        e[1].close()
                    continue
                group = [e] + self._partners(e, entries) if self.batching else [e]
                if len(group) > 1:
                    for f in group[1:]:
                        entries.remove(f)
                    self._batch(group)
                else:
                    if e.pass_ is None and e.reply is None:
                        self._prepare(e)
                    self._solo(e)
            except Exception as exc:
                log.warning("dropped a data message that failed unexpectedly (%s); still serving", type(exc).__name__)
                log.debug("dropped", exc_info=True)

    def _partners(self, e: "Incoming", entries: list) -> list["Incoming"]:
        """Messages among ``entries`` that can run in one batch with ``e``: each the earliest waiting message of
        a session other than ``e``'s (prepared here, in its session's order), with ``e``'s batch key."""
        if e.pass_ is None and e.reply is None:
            self._prepare(e)
        key = e.key = batch_key(e.sess.dtype, e.pass_) if e.pass_ is not None else None
        if key is None:
            return []
        found, seen = [], {id(e.sess)}
        for f in entries:
            if isinstance(f, tuple) or id(f.sess) in seen:
                continue
            seen.add(id(f.sess))
            if f.pass_ is None and f.reply is None:
                self._prepare(f)
                f.key = batch_key(f.sess.dtype, f.pass_) if f.pass_ is not None else None
            if f.key == key:
                found.append(f)
        return found

    def _give_up(self, sid: bytes, outbox, exc: Exception) -> None:
        """The session's next hop takes nothing: the session ends here, and its client's next ping is told
        why (naming that hop); other sessions never wait for it."""
        why = f"its next hop {getattr(outbox, 'address', '?')[:200]} takes no messages ({exc})"
        log.warning("session %s failed: %s", sid.hex()[:8], why)
        self.sessions.end(sid, failed=why)
        self.state_bytes.drop(sid)
        outbox.close()

    def _error(self, header: dict, message: str) -> dict:
        seq, stack = header.get("seq"), header.get("stack")
        return {"op": "error", "stack": stack[:64] if isinstance(stack, str) else None,
                "seq": seq if isinstance(seq, int) else None,
                "node": self.endpoint.control_address, "message": message[:2000]}

    def compute(self, threads: int) -> None:
        """The compute thread: data messages in arrival order; outboxes of ended sessions closed here. A
        language model's node takes everything already waiting (up to ``MAX_BATCH``) with the message it
        waited for, so that decoding passes of several sessions can run as one batch (``serve_taken``); it
        never waits for more to come. ``threads``: the process's torch thread count, set again here because a
        new thread's own count starts from the library's default, not from what the main thread set (and the
        count is part of the bits a block computes)."""
        torch.set_num_threads(threads)
        while True:
            stuck = self.sessions.waiting()
            w0 = time.perf_counter()
            try:
                item = self.work.get(timeout=0.1) if stuck else self.work.get()
            except queue.Empty:
                item = ()
            self.idle_s += time.perf_counter() - w0
            if item is None:
                return
            items = [item]
            while self.batching and item != () and len(items) < MAX_BATCH:
                try:
                    items.append(self.work.get_nowait())
                except queue.Empty:
                    break
                if items[-1] is None:
                    break
            stop = items[-1] is None
            try:
                self.serve_taken(items[:-1] if stop else items)
            except Exception as exc:
                log.warning("dropped data messages that failed unexpectedly (%s); still serving",
                            type(exc).__name__)
                log.debug("dropped", exc_info=True)
            for sid, outbox in stuck:  # what a next hop could not take before goes out as it can
                try:
                    outbox.flush()
                except Exception as exc:  # DiffuseError: given up; anything else: the socket is gone
                    if self.sessions.outbox(sid) is outbox:
                        self._give_up(sid, outbox, exc)
            self._close_handed_over()
            if stop:
                return

    def _close_handed_over(self) -> None:
        """Close the outboxes of sessions that ended while the queue was full (compute thread)."""
        while self.closing:
            try:
                self.closing.popleft().close()
            except Exception:
                log.debug("closing an outbox failed", exc_info=True)

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
        worker = threading.Thread(target=self.compute, args=(torch.get_num_threads(),), name="compute", daemon=True)
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
                            raw = self.endpoint.recv_data()
                            if not self.admit(raw):
                                continue
                            try:
                                self.work.put_nowait(raw)
                            except queue.Full:
                                log.warning("dropped a data message: %d already wait for the compute thread",
                                            MAX_QUEUED)
                    except Exception:
                        log.exception("dropped a %s message that failed unexpectedly; still serving", ready)
                for sid in self.sessions.idle():
                    log.info("session %s idle: closed", sid.hex()[:8])
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
            reply = refusal(str(exc))
        except Exception as exc:
            log.exception("control request failed")
            reply = refusal(f"{type(exc).__name__}: {exc}")
        self.endpoint.reply_control(reply)  # a request taken off the socket is always answered


def _wire(text: str) -> tuple[int, ...]:
    """``--wire``: the wire versions this node speaks, e.g. "1" or "1,2"."""
    try:
        versions = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        versions = ()
    if not versions or not set(versions) <= set(WIRE_VERSIONS):
        raise argparse.ArgumentTypeError(f"{text!r}: this node speaks wire versions "
                                         f"{','.join(map(str, WIRE_VERSIONS))} (give one or more, comma-separated)")
    return versions


def node_compute(device: str | None, dtype: str | None, path: str):
    """``--device`` and ``--dtype`` for the model at ``path`` (``auto`` on an accelerator: the dtype the folder
    declares for the component holding the blocks), checked before anything loads."""
    from diffuse.analysis import ModelSubject
    from diffuse.devices import Compute, resolve_device

    resolve_device(device)  # refused before the folder is read
    return Compute.of(device, dtype, path, ModelSubject.from_path(path).denoiser or None)


def _parser():
    """The node's command line."""
    from diffuse import cli

    ap = cli.Parser(prog="diffuse node", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--model", required=True, help="the model folder (the same one the client uses), a shipped "
                    "model's name, or a Hub id in the local cache")
    ap.add_argument("--listen", default="tcp://127.0.0.1:0", help="control address to bind (port 0: pick one)")
    ap.add_argument("--blocks", help='the slice to hold: "2/3" (2nd of 3 even slices of every stack), "all", or '
                    '"blocks[0:20]"; default: load what each session asks for')
    ap.add_argument("--key-file", default=None,
                    help="long-term identity key, created (0600) if missing; default: node.key in $DIFFUSE_HOME "
                    "or ~/.config/diffuse (nodes sharing that folder share one identity: give each its own file)")
    ap.add_argument("--ephemeral-key", action="store_true", help="a fresh identity for this run only")
    ap.add_argument("--allow-client", action="append", default=None, metavar="HEXKEY",
                    type=functools.partial(cli.hex_key, what="client public key"),
                    help="serve only this client key (repeatable); a client shows its key when run with --client-key")
    ap.add_argument("--advertise-data", metavar="ADDR", help="data address peers should dial, if not the bound one")
    ap.add_argument("--wire", type=_wire, default=WIRE_VERSIONS, metavar="V[,V]",
                    help=f"the wire versions to speak (default {','.join(map(str, WIRE_VERSIONS))}; 1: hop keys sealed "
                    "to this node's long-term key; 2: agreed per session, forward secret)")
    ap.add_argument("--max-message-mb", type=cli.positive, default=None, metavar="MB",
                    help=f"the most one received data frame (one tensor) may hold; a peer sending more is cut off "
                    f"before it is buffered (default {DEFAULT_MAX_MESSAGE_BYTES >> 20})")
    ap.add_argument("--max-sessions", type=cli.positive, default=MAX_SESSIONS, metavar="N",
                    help=f"open sessions at once, in all (default {MAX_SESSIONS}; fewer if the open-file limit "
                    "leaves no room)")
    ap.add_argument("--max-sessions-per-client", type=cli.positive, default=MAX_SESSIONS_PER_CLIENT, metavar="N",
                    help=f"open sessions at once per client key (default {MAX_SESSIONS_PER_CLIENT})")
    ap.add_argument("--no-batch", action="store_true",
                    help="run every pass alone (default for a language model: decoding passes of several sessions "
                    "that wait together run through the layers as one batch)")
    ap.add_argument("--compile", action="store_true",
                    help="run the blocks through torch.compile (inductor; on CPU it needs a C compiler): each block "
                    "is compiled as it loads and traced at its first call of each shape. NOT EXACT: results differ "
                    "from plain diffusers/transformers in the last bits; without it a split is byte-identical")
    ap.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                    help="the most this node's blocks and sessions may take, in GiB, as it tells clients planning "
                    "where slices go (default: what its cgroup or machine has available)")
    cli.device_flags(ap, "this node's blocks")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (match the client for exact results)")
    ap.add_argument("--exit-with", type=int, metavar="PID", help="stop when process PID is gone (local nodes)")
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default), WARNING or ERROR")
    ap.add_argument("--announce", action="store_true", help="advertise this node on the local network (mDNS) while "
                    "it serves, for clients given --nodes auto; needs a --listen others reach, and diffuse[lan]")
    return ap


def main(argv: list[str] | None = None) -> int:
    from diffuse import cli

    a = _parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s node %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    keep_freed_memory()
    if a.threads:
        torch.set_num_threads(a.threads)
    from diffuse.modelfiles import resolve_model

    if a.compile and (why := compile_unavailable()):
        print(f"error: --compile: {why}", file=sys.stderr)
        return 2
    try:
        cli.check_port_free(a.listen)  # before anything loads
        path = resolve_model(a.model)
        compute = node_compute(a.device, a.dtype, path)  # a device or dtype this machine lacks: refused here
        lan = discovery.Announcer(a.listen) if a.announce else None  # the library there, an address others reach
        log.info("loading %s%s on %s", a.model, f" (blocks {a.blocks})" if a.blocks else "", compute.describe())
        key_file = None if a.ephemeral_key else (a.key_file or os.path.join(config_home(), "node.key"))
        node = Node(path, a.listen, a.blocks, key_file,
                    set(a.allow_client) if a.allow_client else None, a.advertise_data,
                    a.max_message_mb << 20 if a.max_message_mb else None, a.max_sessions, a.max_sessions_per_client,
                    batch=not a.no_batch, compute=compute, compiled=a.compile)
    except (DiffuseError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    node.control.speaks = a.wire
    if a.max_memory is not None:
        if not a.max_memory > 0:
            print(f"error: --max-memory {a.max_memory}: give a positive number of GiB", file=sys.stderr)
            return 2
        node.max_memory = int(a.max_memory * (1 << 30))
    print(json.dumps({"diffuse_node": max(a.wire), "wire": list(a.wire), "address": node.endpoint.control_address,
                      "data": node.endpoint.address, "key": node.identity.public_hex}), flush=True)
    log.info("serving %s at %s, key %s, wire versions %s", a.model, node.endpoint.control_address,
             node.identity.public_hex, ",".join(map(str, a.wire)))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, _stopping)
    try:
        with discovery.announced(lan, node, a.model, a.wire):  # withdrawn on the way out
            node.serve(parent=a.exit_with)
    except KeyboardInterrupt:
        pass
    finally:
        node.endpoint.close()
    log.info("stopped")
    return 0


def _stopping(*_) -> None:
    """Ctrl-C: say so at once (the compute thread may take a moment to finish its pass), then stop."""
    log.info("stopping (interrupted)")
    raise KeyboardInterrupt


if __name__ == "__main__":
    from diffuse.cli import exit_now

    exit_now(main())
