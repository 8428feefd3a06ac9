"""``python -m diffuse.node``: hold a slice of a model's block stacks and serve it.

The node prints one JSON line when it is ready (its control address, data
address and public key), then serves until stopped. A bad frame is logged with
its reason and dropped; the node goes on serving.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

from diffuse.errors import DiffuseError, WireError
from diffuse.plan import WIRE_VERSION, Slice, StackPlan
from diffuse.transport_api import Hop

log = logging.getLogger("diffuse.node")

SESSION_IDLE_S = 900.0  # a session nobody has used for this long is closed and its buffers freed


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
        self.outboxes: dict[str, object] = {}
        self.last_error: dict[bytes, str] = {}

    # -- control ---------------------------------------------------------------
    def control(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            offered = msg.get("wire") or []
            if WIRE_VERSION not in offered:
                return {"ok": False, "error": f"this node speaks wire version {WIRE_VERSION}; the client offers {offered}"}
            return {"ok": True, "wire": WIRE_VERSION, "key": self.identity.public, "data": self.data_address,
                    "model": self.store.model_hash,
                    "holds": [str(s) for s in self.store.fixed] if self.store.fixed else None}
        if op == "status":
            sid = msg.get("session")
            return {"ok": True, "params": self.store.held_parameters(), "sessions": len(self.sessions),
                    "session_known": sid in self.sessions if sid else None,
                    "last_error": self.last_error.get(sid) if sid else None}
        if op in ("open", "close"):
            payload, sender = self.transport.open_control(msg, self.identity)
            if self.allowed is not None and sender not in self.allowed:
                return {"ok": False, "error": "this node does not serve your client key"}
            reply = self.open_session(payload) if op == "open" else self.close_session(payload)
            return self.transport.seal_control(reply, sender, self.identity)
        return {"ok": False, "error": f"unknown control operation {op!r}"}

    def open_session(self, p: dict) -> dict:
        from diffuse.stage import StageSession

        if p.get("model") != self.store.model_hash:
            return {"ok": False, "error": "this node serves a different model (content hash differs): "
                    "start it with the same model folder as the client"}
        slices = [Slice(**s) for s in p["slices"]]
        if self.store.fixed is not None:
            missing = [str(s) for s in slices if s.start < s.stop and not self.store.covers(s)]
            if missing:
                held = ", ".join(str(s) for s in self.store.fixed)
                return {"ok": False, "error": f"asked for blocks {', '.join(missing)}, but this node holds only {held}"}
        dtype = getattr(torch, p["dtype"]) if p.get("dtype") else None
        self.store.load(slices, dtype)
        sid = p["session"]
        attention = p.get("attention", "auto")
        if attention not in ("auto", "plain"):
            return {"ok": False, "error": f"unknown attention path {attention!r} (auto or plain)"}
        self.sessions[sid] = StageSession(
            sid, self.store, slices, Hop(sid, p["in_key"]), Hop(sid, p["out_key"]), p["next"], attention)
        log.info("session %s opened: %s -> %s", sid.hex()[:8], ", ".join(map(str, slices)), p["next"])
        # blocks that carry two streams (image and text side by side) cannot be cut into patches
        whole = sorted(s.stack for s in slices if self.two_stream.get(s.stack))
        return {"ok": True, "whole_steps": whole}

    def close_session(self, p: dict) -> dict:
        sess = self.sessions.pop(p.get("session"), None)
        if sess is None:
            return {"ok": False, "error": "unknown session"}
        log.info("session %s closed", sess.sid.hex()[:8])
        return dict(sess.report(), ok=True)  # its stale buffers go with it

    # -- data ------------------------------------------------------------------
    def data(self, frames: list[bytes]) -> None:
        try:
            env = self.transport.envelope(frames)
        except WireError as exc:
            log.warning("rejected a message: %s", exc)
            return
        sess = self.sessions.get(env["s"])
        if sess is None:
            sid = env["s"] if isinstance(env["s"], bytes) else b""
            self.last_error[sid] = "data for an unknown session"
            log.warning("rejected a message: unknown session %s", sid.hex()[:8])
            return
        try:
            header, tensors = self.transport.open(sess.in_hop, frames)
        except WireError as exc:
            self.last_error[sess.sid] = str(exc)
            log.warning("rejected a message for session %s: %s", sess.sid.hex()[:8], exc)
            return
        nbytes = sum(len(f) for f in frames)
        sess.bytes_in += nbytes
        sess.messages += 1
        if isinstance(header, dict) and header.get("op") == "call":
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
        self._outbox(sess.next_address).send(out)

    def _outbox(self, address: str):
        if address not in self.outboxes:
            self.outboxes[address] = self.transport.outbox(address)
        return self.outboxes[address]

    def serve(self, until: float | None = None, parent: int | None = None) -> None:
        while until is None or time.monotonic() < until:
            if parent is not None and not _alive(parent):
                log.info("the process that started this node (%d) is gone: stopping", parent)
                return
            for ready in self.endpoint.wait(1.0):
                if ready == "control":
                    try:
                        msg = self.endpoint.recv_control()
                        reply = self.control(msg)
                    except (WireError, DiffuseError) as exc:
                        log.warning("control request refused: %s", exc)
                        reply = {"ok": False, "error": str(exc)}
                    except Exception as exc:
                        log.exception("control request failed")
                        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                    self.endpoint.reply_control(reply)
                else:
                    self.data(self.endpoint.recv_data())
            now = time.monotonic()
            for sid, sess in list(self.sessions.items()):
                if now - sess.last_used > SESSION_IDLE_S:
                    log.info("session %s idle for %.0f s: closed", sid.hex()[:8], now - sess.last_used)
                    del self.sessions[sid]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffuse.node", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="diffusers pipeline folder (the same one the client uses)")
    ap.add_argument("--listen", default="tcp://127.0.0.1:0", help="control address to bind (port 0: pick one)")
    ap.add_argument("--blocks", help='what to hold: "2/3" (2nd of 3 even shares), "all", or "blocks[0:20]"; '
                    "default: load what each session asks for")
    ap.add_argument("--key-file", default=os.path.join(os.path.expanduser("~"), ".config", "diffuse", "node.key"),
                    help="long-term identity key (created if missing)")
    ap.add_argument("--ephemeral-key", action="store_true", help="a fresh identity for this run only")
    ap.add_argument("--allow-client", action="append", default=None, metavar="HEXKEY",
                    help="serve only these client keys (repeatable)")
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
        node = Node(resolve_model(a.model), a.listen, a.blocks, None if a.ephemeral_key else a.key_file,
                    {bytes.fromhex(k) for k in a.allow_client} if a.allow_client else None, a.advertise_data)
    except DiffuseError as exc:
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
