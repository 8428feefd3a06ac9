"""``python -m diffuse.node``: hold slices of a model's block stacks and serve them.

The node prints one JSON line when it is ready (its control address, data
address and public key), then serves until stopped. Control requests
(``diffuse.node_control``) are answered on this thread at once; data messages
are computed on a second thread, so a node answers pings while its blocks run.
A bad frame is logged with its reason and dropped; the node goes on serving,
whatever a message holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time

import torch

from diffuse import frames
from diffuse.text import plain
from diffuse.errors import DiffuseError, MalformedHeader, WireError
from diffuse.home import config_home
from diffuse.node_control import NodeControl, refusal
from diffuse.plan import WIRE_VERSIONS, StackPlan, parse_slices
from diffuse.sessions import SessionTable
from diffuse.stage import NODE_BUFFER_BYTES
from diffuse.transport_api import DEFAULT_MAX_MESSAGE_BYTES

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


class Node:
    def __init__(self, model_path: str, listen: str, blocks: str | None, key_file: str | None,
                 allowed_clients: set[bytes] | None = None, advertise: str | None = None,
                 max_message_bytes: int | None = None, max_sessions: int = MAX_SESSIONS,
                 max_sessions_per_client: int = MAX_SESSIONS_PER_CLIENT):
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
        self.store = BlockStore(model_path, subject, self.stacks)
        self.store.fixed = parse_slices(blocks, self.stacks)
        if self.store.fixed:
            self.store.load(self.store.fixed)
        self.identity = load_identity(key_file)
        self.allowed = allowed_clients
        self.endpoint = self.transport.serve(listen, max_message_bytes)
        self.max_sessions = session_capacity(max_sessions, getattr(self.transport, "max_sockets", None))
        if self.max_sessions < max_sessions:
            log.warning("at most %d sessions at once: the open-file limit leaves room for no more (raise it "
                        "with ulimit -n)", self.max_sessions)
        self.max_sessions_per_client = min(max_sessions_per_client, self.max_sessions)
        self.state_bytes = StateTally()
        self.data_address = advertise or self.endpoint.address  # what peers dial (differs behind NAT or a relay)
        self.sessions = SessionTable()
        self.control = NodeControl(self)
        self.work: queue.Queue = queue.Queue(MAX_QUEUED)  # frames to compute, or ("close", outbox)

    # -- data (compute thread) ---------------------------------------------------
    def data(self, raw: list[bytes]) -> None:
        try:
            env = frames.envelope_of(raw)
        except WireError as exc:
            log.warning("rejected a message: %s", exc)
            return
        sess = self.sessions.get(env["s"])
        if sess is None:
            log.warning("rejected a message: unknown session %s", env["s"].hex()[:8])
            return
        malformed = None
        try:
            header, tensors = frames.open_message(sess.in_hop, raw)
        except MalformedHeader as exc:  # its sender is authentic: it hears why, in one line
            header, tensors, malformed = {}, [], f"malformed header: {exc}"
        except WireError as exc:
            log.warning("rejected a message for session %s: %s", sess.sid.hex()[:8], exc)
            return
        nbytes = sum(len(f) for f in raw)
        sess.bytes_in += nbytes
        sess.messages += 1
        if header.get("op") == "call":
            sess.hop_log.append([header.get("seq"), nbytes])
        t0 = time.perf_counter()
        sess.room = NODE_BUFFER_BYTES - self.sessions.buffer_bytes(but=sess)  # what the other sessions left
        try:
            if malformed:
                raise DiffuseError(malformed)
            out_header, out_tensors = sess.handle(header, tensors)
        except DiffuseError as exc:  # a malformed call: one line, and the client hears of it
            log.warning("session %s: %s", sess.sid.hex()[:8], exc)
            out_header, out_tensors = self._error(header, str(exc)), []
        except Exception as exc:  # the client must hear about it; the node keeps serving, and logs one line
            text = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            log.warning("call failed in session %s: %s", sess.sid.hex()[:8], text)
            log.debug("call failed", exc_info=True)
            out_header, out_tensors = self._error(header, text), []
        sess.busy_s += time.perf_counter() - t0
        if hasattr(sess, "kv"):
            self.state_bytes.set(sess.sid, sess.kv.nbytes())
            if self.sessions.get(sess.sid) is not sess:  # closed while it computed: its state went with it
                self.state_bytes.drop(sess.sid)
        out = frames.seal_message(sess.out_hop, out_header, out_tensors)
        sess.bytes_out += sum(len(f) for f in out)
        outbox = self.sessions.outbox(sess.sid)
        if outbox is None:
            return  # closed while it computed
        try:
            outbox.send(out)
        except DiffuseError as exc:
            self._give_up(sess.sid, outbox, exc)

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
        """The compute thread: data messages in arrival order; outboxes of ended sessions closed here.
        ``threads``: the process's torch thread count, set again here because a new thread's own count
        starts from the library's default, not from what the main thread set (and the count is part of
        the bits a block computes)."""
        torch.set_num_threads(threads)
        while True:
            stuck = self.sessions.waiting()
            try:
                item = self.work.get(timeout=0.1) if stuck else self.work.get()
            except queue.Empty:
                item = ()
            if item is None:
                return
            try:
                if isinstance(item, tuple):
                    if item:
                        item[1].close()
                else:
                    self.data(item)
            except Exception as exc:
                log.warning("dropped a data message that failed unexpectedly (%s); still serving",
                            type(exc).__name__)
                log.debug("dropped", exc_info=True)
            for sid, outbox in stuck:  # what a next hop could not take before goes out as it can
                try:
                    outbox.flush()
                except Exception as exc:  # DiffuseError: given up; anything else: the socket is gone
                    if self.sessions.outbox(sid) is outbox:
                        self._give_up(sid, outbox, exc)

    def end(self, sid: bytes) -> None:
        outbox = self.sessions.end(sid)
        self.state_bytes.drop(sid)
        if outbox is not None:
            self.work.put(("close", outbox))

    # -- the serving loop (control thread) ----------------------------------------
    def serve(self, until: float | None = None, parent: int | None = None) -> None:
        worker = threading.Thread(target=self.compute, args=(torch.get_num_threads(),), name="compute", daemon=True)
        worker.start()
        try:
            while until is None or time.monotonic() < until:
                if parent is not None and not _alive(parent):
                    log.info("the process that started this node (%d) is gone: stopping", parent)
                    return
                for ready in self.endpoint.wait(1.0):
                    # one bad message costs that message, never the node
                    try:
                        if ready == "control":
                            self._serve_control()
                        else:
                            raw = self.endpoint.recv_data()
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
            self.work.put(None)
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _client_key(text: str) -> bytes:
    """``--allow-client``: a client's public key, 64 hex digits."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a client public key (64 hex digits, as `python -m diffuse.run --client-key FILE` prints)")
    return key


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffuse.node", description=plain(__doc__.split("\n")[0]))
    ap.add_argument("--model", required=True, help="diffusers pipeline folder (the same one the client uses)")
    ap.add_argument("--listen", default="tcp://127.0.0.1:0", help="control address to bind (port 0: pick one)")
    ap.add_argument("--blocks", help='the slice to hold: "2/3" (2nd of 3 even slices of every stack), "all", or '
                    '"blocks[0:20]"; default: load what each session asks for')
    ap.add_argument("--key-file", default=None,
                    help="long-term identity key, created (0600) if missing; default: node.key in $DIFFUSE_HOME "
                    "or ~/.config/diffuse (nodes sharing that folder share one identity: give each its own file)")
    ap.add_argument("--ephemeral-key", action="store_true", help="a fresh identity for this run only")
    ap.add_argument("--allow-client", action="append", default=None, metavar="HEXKEY", type=_client_key,
                    help="serve only this client key (repeatable); a client shows its key when run with --client-key")
    ap.add_argument("--advertise-data", metavar="ADDR", help="data address peers should dial, if not the bound one")
    ap.add_argument("--wire", type=_wire, default=WIRE_VERSIONS, metavar="V[,V]",
                    help=f"the wire versions to speak (default {','.join(map(str, WIRE_VERSIONS))}; 1: hop keys sealed "
                    "to this node's long-term key; 2: agreed per session, forward secret)")
    ap.add_argument("--max-message-mb", type=_positive, default=None, metavar="MB",
                    help=f"the most one received data frame (one tensor) may hold; a peer sending more is cut off "
                    f"before it is buffered (default {DEFAULT_MAX_MESSAGE_BYTES >> 20})")
    ap.add_argument("--max-sessions", type=_positive, default=MAX_SESSIONS, metavar="N",
                    help=f"open sessions at once, in all (default {MAX_SESSIONS}; fewer if the open-file limit "
                    "leaves no room)")
    ap.add_argument("--max-sessions-per-client", type=_positive, default=MAX_SESSIONS_PER_CLIENT, metavar="N",
                    help=f"open sessions at once per client key (default {MAX_SESSIONS_PER_CLIENT})")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (match the client for exact results)")
    ap.add_argument("--exit-with", type=int, metavar="PID", help="stop when process PID is gone (local nodes)")
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s node %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.threads:
        torch.set_num_threads(a.threads)
    from diffuse.modelfiles import resolve_model

    try:
        key_file = None if a.ephemeral_key else (a.key_file or os.path.join(config_home(), "node.key"))
        node = Node(resolve_model(a.model), a.listen, a.blocks, key_file,
                    set(a.allow_client) if a.allow_client else None, a.advertise_data,
                    a.max_message_mb << 20 if a.max_message_mb else None, a.max_sessions, a.max_sessions_per_client)
    except (DiffuseError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    node.control.speaks = a.wire
    print(json.dumps({"diffuse_node": max(a.wire), "wire": list(a.wire), "address": node.endpoint.control_address,
                      "data": node.endpoint.address, "key": node.identity.public_hex}), flush=True)
    log.info("serving %s at %s, key %s, wire versions %s", a.model, node.endpoint.control_address,
             node.identity.public_hex, ",".join(map(str, a.wire)))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        node.serve(parent=a.exit_with)
    except KeyboardInterrupt:
        pass
    finally:
        node.endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
