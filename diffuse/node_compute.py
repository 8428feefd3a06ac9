"""The node's compute thread (``python -m diffuse.node``): data messages the control thread admitted are opened,
checked, run through the node's blocks (alone, or decoding passes of several sessions as one batch), sealed and
sent on to each session's next hop; outboxes of ended sessions are closed here. A message that fails is answered
with an error its client hears; the node keeps serving."""

from __future__ import annotations

import logging
import queue
import time

import torch

from diffuse import frames
from diffuse.batching import MAX_BATCH, batch_key, run_batch
from diffuse.devices import Outgoing, PassClock, to_device
from diffuse.errors import DiffuseError, MalformedHeader, WireError
from diffuse.stage import NODE_BUFFER_BYTES, Pass

log = logging.getLogger("diffuse.node")

MAX_PASS_LOG = 4096  # per-pass records a session keeps (bytes in, busy time): the latest, with running totals
# where a call's time went on a node, in the order of its per-call record (after the sequence number): the
# compute thread idle before it, opening its frames, checking it, its blocks (wall, then CPU), building what it
# hands on, sealing and sending that, and the page faults its blocks took
PARTS = ("idle", "open", "prepare", "blocks", "blocks_cpu", "finish", "seal", "faults")


def _keep(records: list, record: list) -> None:
    """Append a per-pass record, keeping the latest ``MAX_PASS_LOG`` (totals are counted apart): a long
    session's records, and the close reply that carries them, stay bounded."""
    records.append(record)
    if len(records) > MAX_PASS_LOG:
        del records[:len(records) - MAX_PASS_LOG]


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


class ComputeThread:
    """What runs on the node's compute thread, working on ``node``'s sessions, queue and counters."""

    def __init__(self, node):
        self.node = node
        self.outgoing = Outgoing(node.device)  # answers to host memory (on CUDA: a copy stream of its own)
        self.pending: tuple | None = None  # (message, host tensors, ready): copying, sealed once the next is queued
        if self.outgoing.rehearse:
            log.warning("rehearsing an accelerator's asynchronous answers on the CPU (DIFFUSE_REHEARSE_ASYNC=1)")

    def data(self, raw: list[bytes]) -> None:
        """One data message, alone: opened, handled, sealed and sent on."""
        m = self._open(raw)
        if m is not None:
            self._prepare(m)
            self._solo(m)
            self._deliver_pending()

    def _open(self, raw: list[bytes]) -> "Incoming | None":
        t0 = time.perf_counter()
        env, sess = self.node._addressed(raw)
        if sess is None:
            return None
        malformed = None
        try:
            header, tensors = frames.open_message(sess.in_hop, raw)
            tensors = to_device(tensors, self.node.device)  # the CPU's: as they are
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
        sess.room = NODE_BUFFER_BYTES - self.node.sessions.buffer_bytes(but=sess)  # what the other sessions left
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
            clock = PassClock.start(self.node.device)  # None on the CPU: the thread's own clocks tell
            try:
                with torch.no_grad():
                    w0 = time.perf_counter()
                    out = m.sess.run(m.pass_)
                    if clock is not None:  # its kernels queued: the previous answer goes while they run
                        clock.stop()
                        self._deliver_pending()
                    ran = clock.seconds() if clock is not None else time.perf_counter() - w0
                    self.node.speeds.add(m.pass_, m.sess.dtype, ran)
                w1 = m.timed("blocks", w0)
                t1 = time.thread_time()
                m.parts["blocks_cpu"] += t1 - t0
                t0 = t1 - ran if clock is not None else t0  # busy: the device's time for the blocks, not the CPU's
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
                self.node.speeds.overhead(m.pass_, time.perf_counter() - m.t0 - ran)
            return
        self._send(m)

    def _batch(self, group: list["Incoming"]) -> None:
        """Decoding passes of different sessions through the layers as one batch (``diffuse.batching``); each
        session's tail and message then as for a lone pass. What cannot be batched runs one by one."""
        t0, w0 = time.thread_time(), time.perf_counter()
        clock = PassClock.start(self.node.device)
        try:
            outs = run_batch([m.pass_ for m in group])
            if clock is not None:
                clock.stop()
                self._deliver_pending()
                t0 = time.thread_time() - clock.seconds()  # busy: the device's time for the batch
        except Exception as exc:
            log.debug("a batch of %d passes ran one by one: %s", len(group), exc)
            self.node.batch_fallbacks += 1
            for m in group:
                self._solo(m)
            return
        rows = sum(out.shape[0] if isinstance(out, torch.Tensor) else 1 for out in outs)
        self.node.batches += 1
        self.node.batched_rows += rows
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
        """Send what ``m`` made: at once where its tensors are in host memory already (the CPU); on CUDA once
        their copy to host memory is done, which is waited for only after the next pass is queued (or when
        the compute thread has nothing else to do: ``compute``). Answers leave in the order they were made."""
        host, ready = self.outgoing.start(m.reply[1])
        self._deliver_pending()
        if ready is None:
            self._deliver(m, host)
        else:
            self.pending = (m, host, ready)

    def _deliver_pending(self) -> None:
        """Seal and send the answer whose copy to host memory ``_send`` left going, once that copy is done."""
        if self.pending is not None:
            m, host, ready = self.pending
            self.pending = None
            try:
                ready.synchronize()
                self._deliver(m, host)
            except Exception as exc:
                log.warning("dropped an answer that failed unexpectedly (%s); still serving", type(exc).__name__)
                log.debug("dropped", exc_info=True)

    def _deliver(self, m: "Incoming", host: list) -> None:
        sess = m.sess
        if hasattr(sess, "kv"):
            self.node.state_bytes.set(sess.sid, sess.kv.nbytes())
            if self.node.sessions.get(sess.sid) is not sess:  # closed while it computed: its state went with it
                self.node.state_bytes.drop(sess.sid)
        call = m.header.get("op") == "call" and type(m.header.get("seq")) is int
        if call:
            _keep(sess.busy_log, [m.header["seq"], m.busy])
        w0 = time.perf_counter()
        out = frames.seal_message(sess.out_hop, m.reply[0], host)
        sess.bytes_out += sum(len(f) for f in out)
        outbox = self.node.sessions.outbox(sess.sid)
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
                m.parts["idle"], self.node.idle_s = self.node.idle_s, 0.0
                entries.append(m)
        while entries:
            e = entries.pop(0)
            try:
                if isinstance(e, tuple):
                    if e:
                        e[1].close()
                    continue
                group = [e] + self._partners(e, entries) if self.node.batching else [e]
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
        self.node.sessions.end(sid, failed=why)
        self.node.state_bytes.drop(sid)
        outbox.close()

    def _error(self, header: dict, message: str) -> dict:
        seq, stack = header.get("seq"), header.get("stack")
        return {"op": "error", "stack": stack[:64] if isinstance(stack, str) else None,
                "seq": seq if isinstance(seq, int) else None,
                "node": self.node.endpoint.control_address, "message": message[:2000]}

    def compute(self, threads: int) -> None:
        """The compute thread: data messages in arrival order; outboxes of ended sessions closed here. A
        language model's node takes everything already waiting (up to ``MAX_BATCH``) with the message it
        waited for, so that decoding passes of several sessions can run as one batch (``serve_taken``); it
        never waits for more to come. ``threads``: the process's torch thread count, set again here because a
        new thread's own count starts from the library's default, not from what the main thread set (and the
        count is part of the bits a block computes)."""
        torch.set_num_threads(threads)
        while True:
            if self.pending is not None and self.node.work.empty():
                self._deliver_pending()  # no next pass to overlap it with: it goes now
            stuck = self.node.sessions.waiting()
            w0 = time.perf_counter()
            try:
                item = self.node.work.get(timeout=0.1) if stuck else self.node.work.get()
            except queue.Empty:
                item = ()
            self.node.idle_s += time.perf_counter() - w0
            if item is None:
                self._deliver_pending()
                return
            items = [item]
            while self.node.batching and item != () and len(items) < MAX_BATCH:
                try:
                    items.append(self.node.work.get_nowait())
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
                    if self.node.sessions.outbox(sid) is outbox:
                        self._give_up(sid, outbox, exc)
            self._close_handed_over()
            if stop:
                self._deliver_pending()
                return

    def _close_handed_over(self) -> None:
        """Close the outboxes of sessions that ended while the queue was full (compute thread)."""
        while self.node.closing:
            try:
                self.node.closing.popleft().close()
            except Exception:
                log.debug("closing an outbox failed", exc_info=True)
