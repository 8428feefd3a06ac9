"""What the node's compute thread took from its queue at once (``diffuse.node.compute``): run in arrival order,
except that decoding passes of different sessions that fit together run through the layers as one batch
(``diffuse.lm.node_batching``); the last node's tails of such a batch share one product of the output head
(``diffuse.lm.node_layers.joint_tails``); each session's message then goes as for a lone pass. An opened data message is an ``Incoming``; where its
time went is counted in ``PARTS``."""

from __future__ import annotations

import logging
import time

import torch

from diffuse.lm.node_batching import batch_key, run_batch
from diffuse.plan.devices import PassClock
from diffuse.lm.node_layers import joint_tails
from diffuse.node.stage import Prepared

log = logging.getLogger("diffuse.node")


class TakenItems:
    """The batching side of ``thread`` (a ``diffuse.node.compute.ComputeThread``), on its node's counters."""

    def __init__(self, thread):
        self.thread = thread
        self.node = thread.node

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
                m = self.thread.open(item)
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
                        self.thread.prepare(e)
                    self.thread.solo(e)
            except Exception as exc:
                log.warning("dropped a data message that failed unexpectedly (%s); still serving", type(exc).__name__)
                log.debug("dropped", exc_info=True)

    def _partners(self, e: Incoming, entries: list) -> list[Incoming]:
        """Messages among ``entries`` that can run in one batch with ``e``: each the earliest waiting message of
        a session other than ``e``'s (prepared here, in its session's order), with ``e``'s batch key."""
        if e.pass_ is None and e.reply is None:
            self.thread.prepare(e)
        if not any(not isinstance(f, tuple) and f.sess is not e.sess for f in entries):
            return []  # nothing of another session waits (a single stream): no batch key to work out
        key = e.key = batch_key(e.sess.dtype, e.pass_) if e.pass_ is not None else None
        if key is None:
            return []
        found, seen = [], {id(e.sess)}
        for f in entries:
            if isinstance(f, tuple) or id(f.sess) in seen:
                continue
            seen.add(id(f.sess))
            if f.pass_ is None and f.reply is None:
                self.thread.prepare(f)
                f.key = batch_key(f.sess.dtype, f.pass_) if f.pass_ is not None else None
            if f.key == key:
                found.append(f)
        return found

    def _batch(self, group: list[Incoming]) -> None:
        """Decoding passes of different sessions through the layers as one batch (``diffuse.lm.node_batching``); each
        session's tail (jointly where they fit) and message then as for a lone pass. What cannot be batched runs
        one by one."""
        t0, w0 = time.thread_time(), time.perf_counter()
        clock = PassClock.start(self.node.device)  # None on the CPU: the thread's own clocks tell
        try:
            outs = run_batch([m.pass_ for m in group])
            if clock is not None:  # its kernels queued: the previous answer goes while they run
                clock.stop()
                self.thread.deliver_pending()
                t0 = time.thread_time() - clock.seconds()  # busy: the device's time for the batch
        except Exception as exc:
            log.debug("a batch of %d passes ran one by one: %s", len(group), exc)
            self.node.batch_fallbacks += 1
            for m in group:
                self.thread.solo(m)
            return
        rows = sum(out.shape[0] if isinstance(out, torch.Tensor) else 1 for out in outs)
        self.node.batches += 1
        self.node.batched_rows += rows
        share = (time.thread_time() - t0) / len(group)
        wall = (time.perf_counter() - w0) / len(group)
        t1, w1 = time.thread_time(), time.perf_counter()
        try:
            joint_tails([(m.sess, m.pass_) for m in group], outs)  # the head once over the batch's rows (last node)
        except Exception as exc:  # each tail runs alone, as it would have
            log.debug("a batch's tails ran one by one: %s", exc)
        tails, tails_wall = (time.thread_time() - t1) / len(group), (time.perf_counter() - w1) / len(group)
        for m, out in zip(group, outs):
            m.parts["blocks"] += wall
            m.parts["blocks_cpu"] += share
            m.parts["finish"] += tails_wall
            m.spent(tails)
            t1, w1 = time.thread_time(), time.perf_counter()
            m.sess.batched_passes += 1
            m.sess.joint_tails += m.pass_.tail_answer is not None
            try:
                m.reply = m.sess.finish(m.pass_, out)
            except Exception as exc:
                self.thread.failed(m, exc)
            m.spent(share + time.thread_time() - t1)
            m.timed("finish", w1)
        for m in group:
            self.thread.send(m)


class Incoming:
    """A data message opened on the compute thread: its session, header and tensors; once prepared, the pass
    to run (``pass_``) or the message to send at once (``reply``); its batch key (``diffuse.lm.node_batching``); where
    its time went (``parts``: wall seconds of each stage, for ``python -m diffuse.bench``)."""

    __slots__ = ("sess", "header", "tensors", "malformed", "pass_", "reply", "key", "busy", "t0", "parts")

    def __init__(self, sess, header: dict, tensors: list, malformed: str | None, t0: float = 0.0):
        self.sess, self.header, self.tensors, self.malformed = sess, header, tensors, malformed
        self.t0 = t0 or time.perf_counter()  # when it began to be opened
        self.pass_: Prepared | None = None
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


# where a call's time went on a node, in the order of its per-call record (after the sequence number): the
# compute thread idle before it, opening its frames, checking it, its blocks (wall, then CPU), building what it
# hands on, sealing and sending that, and the page faults its blocks took
PARTS = ("idle", "open", "prepare", "blocks", "blocks_cpu", "finish", "seal", "faults")
