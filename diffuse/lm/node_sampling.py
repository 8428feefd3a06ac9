"""Sampling on the last node: the session's processors rebuilt there, and the draw made there from the whole distribution."""

from __future__ import annotations

import torch

from diffuse.errors import DiffuseError
from diffuse.lm.sampling import MAX_IDS, rebuild, rng_digest
from diffuse.plan.contracts import is_int
from diffuse.wire.passes import DrawState


class NodeSampler:
    """A session's sampling on the last node: the processors, the token history they read, the generator."""

    def __init__(self):
        self.processors: list | None = None
        self.history = torch.zeros((0, 0), dtype=torch.long)
        self.generator: torch.Generator | None = None

    def nbytes(self) -> int:
        return self.history.numel() * self.history.element_size()

    def draw(self, spec: DrawState | dict, logits: torch.Tensor) -> dict:
        """Apply the processors to ``logits`` (batch x vocab, the last row of the head's answer), then draw
        (``spec.sample``) or take the argmax; the token per row, and the generator's digest after the draw.
        ``spec`` as a pass carries it, or as it travels (checked here then)."""
        if not isinstance(spec, DrawState):
            spec = DrawState.from_wire(spec)
        if spec.processors is not None:
            self.processors = rebuild(spec.processors)
        if self.processors is None:
            raise DiffuseError("this session's draw arrived without its logits processors")
        self._update_history(spec.history)
        if spec.rng is not None:
            state = spec.rng
            if len(state) != torch.get_rng_state().numel():
                raise DiffuseError("malformed generator state")
            self.generator = torch.Generator()
            self.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        scores = logits.to(dtype=torch.float32, device="cpu", copy=True)  # as generate takes the row
        try:
            for p in self.processors:
                scores = p(self.history, scores)
        except (ValueError, RuntimeError, IndexError) as exc:
            raise DiffuseError(f"generate's processors refused these logits: {str(exc)[:160]}") from None
        if scores.dim() != 2 or scores.shape[0] != self.history.shape[0]:
            raise DiffuseError(f"the processors left {scores.shape[0]} rows for {self.history.shape[0]} rows of "
                               "token history")
        if spec.sample:
            if self.generator is None:
                raise DiffuseError("this session's draw arrived without the client's generator state")
            probs = torch.nn.functional.softmax(scores, dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
            return {"drawn": token, "rng": rng_digest(self.generator.get_state())}
        return {"drawn": torch.argmax(scores, dim=-1)}

    def _update_history(self, history) -> None:
        """The token history the processors read (one row per row they answer: the logits have as many, or twice
        as many under guidance)."""
        if not (isinstance(history, dict) and is_int(history.get("keep")) and isinstance(history.get("add"), list)):
            raise DiffuseError("malformed token history")
        keep, add = history["keep"], history["add"]
        batch = len(add)
        if not 0 <= keep <= self.history.shape[1] or not 0 < batch <= MAX_IDS \
                or not all(isinstance(r, list) and len(r) == len(add[0]) and all(is_int(t) for t in r) for r in add):
            raise DiffuseError("malformed token history")
        if keep and self.history.shape[0] != batch:
            raise DiffuseError("the token history kept is for another batch")
        kept = self.history[:, :keep] if keep else torch.zeros((batch, 0), dtype=torch.long)
        self.history = torch.cat([kept, torch.tensor(add, dtype=torch.long).reshape(batch, -1)], dim=1)
