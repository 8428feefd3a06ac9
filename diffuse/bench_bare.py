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
of the work that makes a ring safe to expose. ``bench lm`` runs it in the same rounds as the
whole model and the split, and prints the split's rate as a fraction of it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

CACHE = "$cache"  # where the client's cache object sat in a layer's arguments


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


def worker(model_dir: str, start: int, stop: int, push: str) -> None:
    """Serve layers ``start:stop`` of the model at ``model_dir``: print the port it pulls from, then take each pass,
    run the layers on it and push the hidden state (with the same arguments) to ``push``."""
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
    out.connect(push)
    print(f"port {port}", flush=True)
    cache = None
    with torch.no_grad():
        while True:
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
        import zmq

        self.ctx = zmq.Context()
        self.back = self.ctx.socket(zmq.PULL)
        push = f"tcp://127.0.0.1:{self.back.bind_to_random_port('tcp://127.0.0.1')}"
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
        self.layers, self.procs = layers, []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            for k in reversed(range(n)):  # the last first: each worker pushes to the one after it
                code = (f"from diffuse.bench_bare import worker; worker({model_dir!r}, {k * layers // n}, "
                        f"{(k + 1) * layers // n}, {push!r})")
                proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
                self.procs.append(proc)
                line = proc.stdout.readline()
                if not line.startswith("port "):
                    raise RuntimeError(f"a bare ring's worker did not start (exit {proc.wait(30)})")
                push = f"tcp://127.0.0.1:{int(line.split()[1])}"
        except BaseException:
            self.close()
            raise
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.connect(push)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def install(self, model) -> None:
        """Replace ``model``'s decoder layers by the ring's ends (see the module's docstring)."""
        import torch

        ring = self

        class First(torch.nn.Module):
            def forward(self, hidden, **kwargs):
                cache = kwargs.get("cache", kwargs.get("past_key_values"))
                sent = {k: (CACHE if v is cache else v) for k, v in kwargs.items()}
                sent["fresh"] = cache.get_seq_length() == 0
                ring.out.send_multipart(pack((hidden, sent)), copy=False)
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
            if proc.stdout:
                proc.stdout.close()
        self.ctx.destroy(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
