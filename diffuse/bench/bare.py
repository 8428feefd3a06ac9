"""A bare ring for ``python -m diffuse.bench lm``: the floor a ring of processes costs on this machine.

The same decoder layers in 1 or 2 worker processes at one torch thread, joined
by ZeroMQ PUSH/PULL over loopback (the transport local nodes use), with nothing
of Diffuse between them: a layer's arguments are pickled with their tensors as
out-of-band frames, and there is no sealing, no check of what arrives, no call
plan, no session, no door thread and no reply but the hidden state. The client
runs the model's own ``generate``; its first decoder layer is replaced by one
that sends the hidden state and the layer's arguments round the ring and writes
a zero per new position into the client's cache (so ``generate`` reads the
lengths a whole run has), and its other layers by ones that hand the state on.
Each worker keeps its layers' key/value cache, new when a pass says so.

What this ring reaches against whole is the ceiling for a split over ZeroMQ
at this size on this machine: the wake-ups and copies of a message between
processes, and layers run by a process that idles between passes, with none
of the work that makes a ring safe to expose. ``bench lm`` runs it in the
same rounds as the whole model and the split, and prints the split's rate as
a fraction of it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

CACHE = "$cache"  # where the client's cache object sat in a layer's arguments
WAIT_S = 300  # the longest a pass round the ring may take before the bench gives up on it


def pack(obj) -> list:
    """Frames of ``obj`` (nested tuples, lists and dicts of tensors and plain values): a pickle whose tensors travel
    as out-of-band frames of their bytes."""
    import torch

    def conv(x):
        if isinstance(x, torch.Tensor):
            return ("T", x.detach().contiguous().numpy())
        if isinstance(x, (tuple, list)):
            return ("t" if isinstance(x, tuple) else "l", [conv(y) for y in x])
        if isinstance(x, dict):
            return ("d", {k: conv(v) for k, v in x.items()})
        return ("v", x)

    buffers: list = []
    head = pickle.dumps(conv(obj), protocol=5, buffer_callback=buffers.append)
    return [head] + [b.raw() for b in buffers]


def unpack(frames: list):
    """``pack``'s object again, its tensors over the received frames' memory."""
    import torch

    def back(x):
        tag, v = x
        if tag == "T":
            return torch.from_numpy(v)
        if tag in ("t", "l"):
            items = [back(y) for y in v]
            return tuple(items) if tag == "t" else items
        if tag == "d":
            return {k: back(y) for k, y in v.items()}
        return v

    return back(pickle.loads(frames[0], buffers=[f.buffer for f in frames[1:]]))


def worker(model_dir: str, start: int, stop: int) -> None:
    """Serve layers ``start:stop`` of the model at ``model_dir``: print the port it pulls from, read from stdin the
    address to push to, then take each pass, run the layers on it and push the hidden state (with the same
    arguments) on."""
    import torch
    import transformers
    import zmq
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    layers = [model.model.layers[i] for i in range(start, stop)]
    ctx = zmq.Context()
    pull, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    print(f"port {port}", flush=True)
    out.connect(sys.stdin.readline().strip())
    parent, cache = os.getppid(), None
    with torch.no_grad():
        while True:
            if not pull.poll(1000):
                if os.getppid() != parent:  # the bench is gone (killed): so is its ring
                    return
                continue
            hidden, kwargs = unpack(pull.recv_multipart(copy=False))
            if kwargs["fresh"] or cache is None:
                cache = DynamicCache(config=model.config)
            call = {k: (cache if isinstance(v, str) and v == CACHE else v) for k, v in kwargs.items() if k != "fresh"}
            for layer in layers:
                hidden = layer(hidden, **call)
            out.send_multipart(pack((hidden, kwargs)), copy=False)


class BareRing:
    """``n`` worker processes holding a model's decoder layers in even slices, and the client's end of their ring;
    a context manager that stops them."""

    def __init__(self, model_dir: str, n: int):
        """Start the workers (they load at once, side by side); they are joined into a ring on first use."""
        from transformers import AutoConfig

        self.layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
        self.procs: list = []
        self.ctx = self.out = None
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            for k in range(n):
                code = (f"from diffuse.bench.bare import worker; worker({model_dir!r}, {k * self.layers // n}, "
                        f"{(k + 1) * self.layers // n})")
                self.procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                                                   stdout=subprocess.PIPE, text=True))
        except BaseException:
            self.close()
            raise

    def _join(self) -> None:
        """Each worker pushes to the next, the last to the client's end; the client pushes to the first."""
        import zmq

        ports = []
        for proc in self.procs:
            line = proc.stdout.readline()
            if not line.startswith("port "):
                raise RuntimeError(f"a bare ring's worker did not start (exit {proc.wait(30)})")
            ports.append(int(line.split()[1]))
        self.ctx = zmq.Context()
        self.back = self.ctx.socket(zmq.PULL)
        home = self.back.bind_to_random_port("tcp://127.0.0.1")
        for proc, port in zip(self.procs, ports[1:] + [home]):
            proc.stdin.write(f"tcp://127.0.0.1:{port}\n")
            proc.stdin.flush()
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.connect(f"tcp://127.0.0.1:{ports[0]}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def install(self, model) -> None:
        """Replace ``model``'s decoder layers by the ring's ends (see the module's docstring)."""
        import torch

        if self.out is None:
            self._join()
        ring = self

        class First(torch.nn.Module):
            def forward(self, hidden, **kwargs):
                cache = kwargs.get("cache", kwargs.get("past_key_values"))
                sent = {k: (CACHE if v is cache else v) for k, v in kwargs.items()}
                sent["fresh"] = cache.get_seq_length() == 0
                ring.out.send_multipart(pack((hidden, sent)), copy=False)
                if not ring.back.poll(WAIT_S * 1000):
                    raise RuntimeError(f"the bare ring gave no answer in {WAIT_S} s (a worker failed: its error is "
                                       "above)")
                out, _ = unpack(ring.back.recv_multipart(copy=False))
                b, q = hidden.shape[0], hidden.shape[1]
                for i in range(ring.layers):  # the lengths generate reads; the keys and values are on the workers
                    z = torch.zeros(b, 1, q, 1, dtype=hidden.dtype)
                    cache.update(z, z.clone(), i)
                return out

        class Onward(torch.nn.Module):
            def forward(self, hidden, **_):
                return hidden

        model.model.layers = torch.nn.ModuleList([First()] + [Onward() for _ in range(self.layers - 1)])

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(30)
            for pipe in (proc.stdin, proc.stdout):
                if pipe:
                    pipe.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
