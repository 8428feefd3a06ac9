"""``python -m diffuse.node``: hold a slice of a model's block stacks and serve it.

The node prints one JSON line when it is ready (its control address, data
address and public key), then serves until stopped. A bad frame is logged with
its reason and dropped; the node goes on serving, whatever a message holds.

Control: ``hello`` (plain) gives the node's key, data address, what it holds
(``--blocks``, as ``{stack, start, stop}`` ranges) and a one-time challenge.
``open`` and ``close`` are sealed to the node's key, carry their own ``op``
inside the seal, and are answered sealed to the sender with ``re`` naming the
operation. An open must carry an unspent, unexpired challenge and a session id
the node has never seen; the session then belongs to the key that opened it,
and only that key may close it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import OrderedDict

import torch

from diffuse.errors import DiffuseError, WireError
from diffuse.plan import SESSION_ID_BYTES, WIRE_VERSION, Slice, StackPlan
from diffuse.ring import config_home
from diffuse.transport_api import Hop

log = logging.getLogger("diffuse.node")

SESSION_IDLE_S = 900.0  # a session nobody has used for this long is closed and its buffers freed
CHALLENGE_TTL_S = 300.0  # an open must come this soon after the hello that gave its challenge
MAX_CHALLENGES = 1024  # outstanding hello challenges kept (oldest dropped first)
MAX_CLOSED = 4096  # closed session ids remembered, so none is opened twice
MAX_ERRORS = 256  # last errors kept for `status` (oldest dropped first)


def _error(text: str) -> dict:
    return {"ok": False, "error": text}


class Node:
    def __init__(self, model_path: str, listen: str, blocks: str | None, key_file: str | None,
                 allowed_clients: set[bytes] | None = None, advertise: str | None = None):
        from diffuse.analysis import ModelSubject, run_analyzers
        from diffuse.plugins import transport_for
        from diffuse.stage import BlockStore, parse_blocks

        self.transport = transport_for(listen)
        subject = ModelSubject.from_path(model_path)
        draft = run_analyzers("config", subject)
        self.stacks: list[StackPlan] = draft["stacks"]
        self.two_stream: dict[str, bool] = dict(draft.get("two_stream", {}))  # such stacks run whole steps
        self.store = BlockStore(model_path, subject, self.stacks)
        self.store.fixed = parse_blocks(blocks, self.stacks)
        if self.store.fixed:
            self.store.load(self.store.fixed)
        self.identity = self.transport.load_identity(key_file)
        self.allowed = allowed_clients
        self.endpoint = self.transport.serve(listen)
        self.data_address = advertise or self.endpoint.address  # what peers dial (differs behind NAT or a relay)
        self.sessions: dict[bytes, object] = {}
        self.owners: dict[bytes, bytes] = {}  # session id -> public key of the client that opened it
        self.outboxes: dict[bytes, object] = {}  # session id -> its sending end toward its next hop
        self.challenges: OrderedDict[bytes, float] = OrderedDict()  # one-time hello challenge -> expiry
        self.closed: OrderedDict[bytes, None] = OrderedDict()  # recently ended session ids
        self.last_error: OrderedDict[bytes, str] = OrderedDict()

    # -- control ---------------------------------------------------------------
    def control(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            offered = msg.get("wire") or []
            if not isinstance(offered, list) or WIRE_VERSION not in offered:
                return _error(f"this node speaks wire version {WIRE_VERSION}; the client offers {offered!r:.64}")
            holds = None
            if self.store.fixed:
                holds = [{"stack": s.stack, "start": s.start, "stop": s.stop} for s in self.store.fixed]
            return {"ok": True, "wire": WIRE_VERSION, "key": self.identity.public, "data": self.data_address,
                    "model": self.store.model_hash, "holds": holds, "challenge": self._new_challenge()}
        if op == "status":
            sid = msg.get("session")
            sid = sid if isinstance(sid, bytes) else None
            return {"ok": True, "params": self.store.held_parameters(), "sessions": len(self.sessions),
                    "outboxes": len(self.outboxes), "errors_kept": len(self.last_error),
                    "session_known": sid in self.sessions if sid else None,
                    "last_error": self.last_error.get(sid) if sid else None}
        if op in ("open", "close"):
            payload, sender = self.transport.open_control(msg, self.identity)
            # from here on the sender is known: every answer is sealed to it, so it can tell ours from a forgery
            try:
                reply = self._sealed_op(op, payload, sender)
            except DiffuseError as exc:
                log.warning("%s refused: %s", op, exc)
                reply = _error(str(exc))
            except Exception as exc:
                log.exception("%s failed", op)
                reply = _error(f"{type(exc).__name__}: {exc}")
            reply["re"] = op
            return self.transport.seal_control(reply, sender, self.identity)
        return _error(f"unknown control operation {op!r:.64}")

    def _sealed_op(self, op: str, payload: dict, sender: bytes) -> dict:
        if payload.get("op") != op:  # else a sealed open could be replayed as a close, or the reverse
            return _error(f"the sealed payload is not for {op!r}")
        if self.allowed is not None and sender not in self.allowed:
            return _error("this node does not serve your client key")
        return self.open_session(payload, sender) if op == "open" else self.close_session(payload, sender)

    def _new_challenge(self) -> bytes:
        now = time.monotonic()
        while self.challenges and next(iter(self.challenges.values())) < now:
            self.challenges.popitem(last=False)
        challenge = os.urandom(16)
        self.challenges[challenge] = now + CHALLENGE_TTL_S
        while len(self.challenges) > MAX_CHALLENGES:
            self.challenges.popitem(last=False)
        return challenge

    def _take_challenge(self, challenge) -> bool:
        if not isinstance(challenge, bytes):
            return False
        expiry = self.challenges.pop(challenge, None)
        return expiry is not None and expiry >= time.monotonic()

    def open_session(self, p: dict, sender: bytes = b"") -> dict:
        from diffuse.stage import StageSession

        # the challenge goes first, whatever happens next: a captured open replayed later finds it spent
        if not self._take_challenge(p.get("challenge")):
            return _error("stale or replayed open: its hello challenge is unknown, spent or expired "
                          "(ask hello for a fresh one right before opening)")
        if p.get("model") != self.store.model_hash:
            return _error("this node serves a different model (content hash differs): "
                          "start it with the same model folder as the client")
        sid = p.get("session")
        if not isinstance(sid, bytes) or len(sid) != SESSION_ID_BYTES:
            return _error(f"the session id must be {SESSION_ID_BYTES} bytes")
        if sid in self.sessions or sid in self.closed:
            return _error("this session id is already in use on this node, or was: open with a fresh one")
        attention = p.get("attention", "auto")
        if attention not in ("auto", "plain"):
            return _error(f"unknown attention path {attention!r:.64} (auto or plain)")
        for name in ("in_key", "out_key"):
            if not isinstance(p.get(name), bytes) or len(p[name]) != 32:
                return _error(f"{name} must be a 32-byte key")
        if not isinstance(p.get("next"), str):
            return _error("next must be the address of the next hop")
        dtype = None
        if p.get("dtype"):
            dtype = getattr(torch, p["dtype"], None) if isinstance(p["dtype"], str) else None
            if not isinstance(dtype, torch.dtype):
                return _error(f"unknown compute dtype {p['dtype']!r:.64}")
        slices = self._slices(p.get("slices"))
        if isinstance(slices, str):
            return _error(slices)
        if self.store.fixed is not None:
            missing = [str(s) for s in slices if s.start < s.stop and not self.store.covers(s)]
            if missing:
                held = ", ".join(str(s) for s in self.store.fixed)
                return _error(f"asked for blocks {', '.join(missing)}, but this node holds only {held}")
        self.store.load(slices, dtype)
        outbox = self.transport.outbox(p["next"])  # this session's own: closed with it
        self.sessions[sid] = StageSession(
            sid, self.store, slices, Hop(sid, p["in_key"]), Hop(sid, p["out_key"]), p["next"], attention)
        self.owners[sid] = sender
        self.outboxes[sid] = outbox
        log.info("session %s opened: %s -> %s", sid.hex()[:8], ", ".join(map(str, slices)), p["next"])
        # blocks that carry two streams (image and text side by side) cannot be cut into patches
        whole = sorted(s.stack for s in slices if self.two_stream.get(s.stack))
        return {"ok": True, "whole_steps": whole}

    def _slices(self, given) -> list[Slice] | str:
        """The slices an open asks for, checked against the model's stacks (or why not)."""
        lengths = {s.path: s.length for s in self.stacks}
        if not isinstance(given, list):
            return "slices must be a list of {stack, start, stop}"
        out = []
        for s in given:
            if not (isinstance(s, dict) and set(s) == {"stack", "start", "stop"} and s["stack"] in lengths
                    and all(isinstance(s[k], int) and not isinstance(s[k], bool) for k in ("start", "stop"))
                    and 0 <= s["start"] <= s["stop"] <= lengths[s["stack"]]):
                return f"malformed slice {s!r:.80}: expected {{stack, start, stop}} within the model's stacks {lengths}"
            out.append(Slice(**s))
        return out

    def close_session(self, p: dict, sender: bytes = b"") -> dict:
        sid = p.get("session")
        sess = self.sessions.get(sid) if isinstance(sid, bytes) else None
        if sess is None:
            return _error("unknown session")
        if self.owners.get(sid) != sender:
            return _error("this session was opened by another client key: only its opener may close it")
        self._end(sid)
        log.info("session %s closed", sess.sid.hex()[:8])
        return dict(sess.report(), ok=True)  # its stale buffers go with it

    def _end(self, sid: bytes) -> None:
        self.sessions.pop(sid, None)
        self.owners.pop(sid, None)
        outbox = self.outboxes.pop(sid, None)
        if outbox is not None:
            try:
                outbox.close()
            except Exception:
                log.exception("closing the outbox of session %s failed", sid.hex()[:8])
        self.closed[sid] = None
        while len(self.closed) > MAX_CLOSED:
            self.closed.popitem(last=False)

    def _note_error(self, sid: bytes, text: str) -> None:
        self.last_error.pop(sid, None)
        self.last_error[sid] = text
        while len(self.last_error) > MAX_ERRORS:
            self.last_error.popitem(last=False)

    # -- data ------------------------------------------------------------------
    def data(self, frames: list[bytes]) -> None:
        try:
            env = self.transport.envelope(frames)
        except WireError as exc:
            log.warning("rejected a message: %s", exc)
            return
        sess = self.sessions.get(env["s"])
        if sess is None:
            self._note_error(env["s"], "data for an unknown session")
            log.warning("rejected a message: unknown session %s", env["s"].hex()[:8])
            return
        try:
            header, tensors = self.transport.open(sess.in_hop, frames)
        except WireError as exc:
            self._note_error(sess.sid, str(exc))
            log.warning("rejected a message for session %s: %s", sess.sid.hex()[:8], exc)
            return
        nbytes = sum(len(f) for f in frames)
        sess.bytes_in += nbytes
        sess.messages += 1
        if header.get("op") == "call":
            sess.hop_log.append([header.get("seq"), nbytes])
        t0 = time.perf_counter()
        try:
            out_header, out_tensors = sess.handle(header, tensors)
        except Exception as exc:  # the client must hear about it; the node keeps serving
            log.exception("call failed in session %s", sess.sid.hex()[:8])
            out_header = {"op": "error", "stack": header.get("stack"), "seq": header.get("seq"),
                          "node": self.endpoint.control_address, "message": f"{type(exc).__name__}: {exc}"}
            out_tensors = []
        sess.busy_s += time.perf_counter() - t0
        out = self.transport.seal(sess.out_hop, out_header, out_tensors)
        sess.bytes_out += sum(len(f) for f in out)
        try:
            self.outboxes[sess.sid].send(out)
        except DiffuseError as exc:
            self._note_error(sess.sid, str(exc))
            log.warning("session %s: could not hand a message on: %s", sess.sid.hex()[:8], exc)

    def serve(self, until: float | None = None, parent: int | None = None) -> None:
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
                        self.data(self.endpoint.recv_data())
                except Exception:
                    log.exception("dropped a %s message that failed unexpectedly; still serving", ready)
            now = time.monotonic()
            for sid, sess in list(self.sessions.items()):
                if now - sess.last_used > SESSION_IDLE_S:
                    log.info("session %s idle for %.0f s: closed", sid.hex()[:8], now - sess.last_used)
                    self._end(sid)

    def _serve_control(self) -> None:
        try:
            reply = self.control(self.endpoint.recv_control())
        except (WireError, DiffuseError) as exc:
            log.warning("control request refused: %s", exc)
            reply = _error(str(exc))
        except Exception as exc:
            log.exception("control request failed")
            reply = _error(f"{type(exc).__name__}: {exc}")
        self.endpoint.reply_control(reply)  # a request taken off the socket is always answered


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffuse.node", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="diffusers pipeline folder (the same one the client uses)")
    ap.add_argument("--listen", default="tcp://127.0.0.1:0", help="control address to bind (port 0: pick one)")
    ap.add_argument("--blocks", help='what to hold: "2/3" (2nd of 3 even shares), "all", or "blocks[0:20]"; '
                    "default: load what each session asks for")
    ap.add_argument("--key-file", default=None,
                    help="long-term identity key, created (0600) if missing; default: node.key in $DIFFUSE_HOME "
                    "or ~/.config/diffuse")
    ap.add_argument("--ephemeral-key", action="store_true", help="a fresh identity for this run only")
    ap.add_argument("--allow-client", action="append", default=None, metavar="HEXKEY", type=_client_key,
                    help="serve only this client key (repeatable); a client shows its key when run with --client-key")
    ap.add_argument("--advertise-data", metavar="ADDR", help="data address peers should dial, if not the bound one")
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
                    set(a.allow_client) if a.allow_client else None, a.advertise_data)
    except (DiffuseError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"diffuse_node": WIRE_VERSION, "address": node.endpoint.control_address,
                      "data": node.endpoint.address, "key": node.identity.public_hex}), flush=True)
    log.info("serving %s at %s, key %s", a.model, node.endpoint.control_address, node.identity.public_hex)
    try:
        node.serve(parent=a.exit_with)
    except KeyboardInterrupt:
        pass
    finally:
        node.endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
