"""The node's compute thread (``python -m diffuse.node``): data messages the control thread admitted are opened,
checked, run through the node's blocks (alone, or decoding passes of several sessions as one batch), sealed and
sent on to each session's next hop; outboxes of ended sessions are closed here. A message that fails is answered
with an error its client hears; the node keeps serving."""

from __future__ import annotations

import logging
import queue
import time

import torch

from diffuse.wire import frames
from diffuse.lm.node_batching import MAX_BATCH
from diffuse.plan.devices import Outgoing, PassClock, to_device
from diffuse.errors import DiffuseError, MalformedHeader, WireError
from diffuse.node.batches import PARTS, Incoming, TakenItems
from diffuse.node.stage import NODE_BUFFER_BYTES, Prepared

log = logging.getLogger("diffuse.node")

MAX_PASS_LOG = 4096  # per-pass records a session keeps (bytes in, busy time): the latest, with running totals


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


class Arrived:
    """A data message the control thread admitted (``Node.admit``): its frames, its envelope as read there, and
    the hop whose key opened its header frame (``plain``), so that the compute thread reads neither again."""

    __slots__ = ("raw", "env", "hop", "plain")

    def __init__(self, raw: list, env: dict, hop, plain: bytes):
        self.raw, self.env, self.hop, self.plain = raw, env, hop, plain


class ComputeThread:
    """What runs on the node's compute thread, working on ``node``'s sessions, queue and counters."""

    def __init__(self, node):
        self.node = node
        self.batches = TakenItems(self)  # what one turn of the loop took, batched where it can be
        self.outgoing = Outgoing(node.device)  # answers to host memory (on CUDA: a copy stream of its own)
        self.pending: tuple | None = None  # (message, host tensors, ready): copying, sealed once the next is queued
        if self.outgoing.rehearse:
            log.warning("rehearsing an accelerator's asynchronous answers on the CPU (DIFFUSE_REHEARSE_ASYNC=1)")

    def data(self, raw: "list[bytes] | Arrived") -> None:
        """One data message, alone: opened, handled, sealed and sent on."""
        m = self.open(raw)
        if m is not None:
            self.prepare(m)
            self.solo(m)
            self.deliver_pending()

    def open(self, arrived: "list[bytes] | Arrived") -> "Incoming | None":
        """A message's frames (or, admitted at the door, ``Arrived``) opened for its session, or None (logged)."""
        t0 = time.perf_counter()
        if isinstance(arrived, Arrived):
            raw, env = arrived.raw, arrived.env
            sess = self.node.sessions.get(env["s"])
            if sess is None:
                log.warning("rejected a message: unknown session %s", env["s"].hex()[:8])
                return None
            plain = arrived.plain if sess.in_hop is arrived.hop else None  # opened under this very hop's key
        else:
            raw, plain = arrived, None
            env, sess = self.node._addressed(raw)
            if sess is None:
                return None
        malformed = None
        try:
            header, tensors = frames.open_message(sess.in_hop, raw, env, plain)
            tensors = to_device(tensors, self.node.device)  # the CPU's: as they are
        except MalformedHeader as exc:  # its sender is authentic: it hears why, in one line
            header, tensors, malformed = {}, [], f"malformed header: {exc}"
        except WireError as exc:
            log.warning("rejected a message for session %s: %s", sess.sid.hex()[:8], exc)
            return None
        nbytes = sum(len(f) for f in raw)
        sess.bytes_in += nbytes
        self.node.tally.bytes_in += nbytes
        sess.messages += 1
        if header.get("op") == "call":
            _keep(sess.hop_log, [header.get("seq"), nbytes])
        m = Incoming(sess, header, tensors, malformed, t0)
        m.timed("open", t0)
        return m

    def failed(self, m: "Incoming", exc: Exception) -> None:
        """The message that answers a call that failed: the client hears of it; the node keeps serving."""
        sid = m.sess.sid.hex()[:8]
        fields = self.node.sessions.event("pass_failed", m.sess.sid, seq=m.header.get("seq"))
        if isinstance(exc, DiffuseError):  # a malformed call: one line
            text = str(exc)
            log.warning("session %s: %s", sid, exc, extra=dict(fields, error=text[:500]))
        else:  # logged in one line
            text = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            log.warning("call failed in session %s: %s", sid, text, extra=dict(fields, error=text))
            log.debug("call failed", exc_info=True)
        m.reply = (self._error(m.header, text), [])

    def prepare(self, m: "Incoming") -> None:
        """Check and take apart a message (``StageSession.prepare``): ``m.pass_`` to run, or ``m.reply`` at once."""
        sess = m.sess
        t0, w0 = time.thread_time(), time.perf_counter()
        sess.room = NODE_BUFFER_BYTES - self.node.sessions.buffer_bytes(but=sess)  # what the other sessions left
        try:
            if m.malformed:
                raise DiffuseError(m.malformed)
            got = sess.prepare(m.header, m.tensors)
        except Exception as exc:
            self.failed(m, exc)
        else:
            if isinstance(got, Prepared):
                m.pass_ = got
            else:
                m.reply = got
        m.spent(time.thread_time() - t0)
        m.timed("prepare", w0)

    def solo(self, m: "Incoming") -> None:
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
                        self.deliver_pending()
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
                self.failed(m, exc)
                ran = None
            m.spent(time.thread_time() - t0)
            self.send(m)
            if ran is not None:  # its opening, checking, sealing and sending, besides its blocks
                self.node.speeds.overhead(m.pass_, time.perf_counter() - m.t0 - ran)
            return
        self.send(m)

    def send(self, m: "Incoming") -> None:
        """Send what ``m`` made: at once where its tensors are in host memory already (the CPU); on CUDA once
        their copy to host memory is done, which is waited for only after the next pass is queued (or when
        the compute thread has nothing else to do: ``compute``). Answers leave in the order they were made."""
        host, ready = self.outgoing.start(m.reply[1])
        self.deliver_pending()
        if ready is None:
            self._deliver(m, host)
        else:
            self.pending = (m, host, ready)

    def deliver_pending(self) -> None:
        """Seal and send the answer whose copy to host memory ``send`` left going, once that copy is done."""
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
        self.node.tally.bytes_out += sum(len(f) for f in out)
        if call:
            self.node.tally.passed(time.perf_counter() - m.t0, m.busy, m.reply[0].get("op") == "error")
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

    def _give_up(self, sid: bytes, outbox, exc: Exception) -> None:
        """The session's next hop takes nothing: the session ends here, and its client's next ping is told
        why (naming that hop); other sessions never wait for it."""
        why = f"its next hop {getattr(outbox, 'address', '?')[:200]} takes no messages ({exc})"
        log.warning("session %s failed: %s", sid.hex()[:8], why,
                    extra=self.node.sessions.event("session_evicted", sid, reason="next_hop", error=why[:500]))
        self.node.sessions.end(sid, failed=why)
        self.node.tally.evicted("next_hop")
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
        waited for, so that decoding passes of several sessions can run as one batch (``diffuse.node.batches``); it
        never waits for more to come. ``threads``: the process's torch thread count, set again here because a
        new thread's own count starts from the library's default, not from what the main thread set (and the
        count is part of the bits a block computes)."""
        torch.set_num_threads(threads)
        while True:
            if self.pending is not None and self.node.work.empty():
                self.deliver_pending()  # no next pass to overlap it with: it goes now
            stuck = self.node.sessions.waiting()
            w0 = time.perf_counter()
            try:
                item = self.node.work.get(timeout=0.1) if stuck else self.node.work.get()
            except queue.Empty:
                item = ()
            waited = time.perf_counter() - w0
            self.node.idle_s += waited
            self.node.tally.idle_s += waited
            if item is None:
                self.deliver_pending()
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
                self.batches.serve_taken(items[:-1] if stop else items)
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
                self.deliver_pending()
                return

    def _close_handed_over(self) -> None:
        """Close the outboxes of sessions that ended while the queue was full (compute thread)."""
        while self.node.closing:
            try:
                self.node.closing.popleft().close()
            except Exception:
                log.debug("closing an outbox failed", exc_info=True)
