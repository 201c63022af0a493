"""Hidden states of chosen target layers, for EAGLE-3's fused features and for training data."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..errors import EaglespecError


def check_layers(layers: list[int], model: torch.nn.Module) -> None:
    """Aux layers must exist in the target (`output_hidden_states` numbering); `model` or its decoder."""
    depth = model.config.num_hidden_layers
    if any(i < 0 or i > depth for i in layers):
        raise EaglespecError(f"aux layers must lie in 0..{depth} (0 = the embeddings), got {layers}")


class HiddenStateTap:
    """Hidden states of chosen decoder layers (``output_hidden_states`` numbering: i = the input of
    layer i, so 0 = the embeddings; the top index = the final-norm output) from forward pre-hooks.

    transformers' ``output_hidden_states=True`` walks every module and wraps every layer on each
    call: 1-3 ms per SmolLM2 forward on a 2-core CPU, paid by every EAGLE round. A hook on the few
    wanted layers costs microseconds, and only the forwards that want them carry one (`capture`):
    the one-call decoder splits its C call and copies the hidden state at every hooked layer, which
    made vanilla decoding on a model shared with an EAGLE engine ~5 % slower. A compiled decoder
    keeps transformers' way: there it is traced once and free, while hooks added after compilation
    would be silently skipped (dynamo does not guard on hooks). One tap per decoder, shared by every
    engine on it."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.depth = int(decoder.config.num_hidden_layers)
        self._decoder = decoder
        self._seen: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, decoder: torch.nn.Module, layers: list[int]) -> "HiddenStateTap":
        tap = decoder.__dict__.get("_eaglespec_tap")
        if tap is None:
            tap = decoder.__dict__["_eaglespec_tap"] = cls(decoder)
        check_layers(layers, decoder)
        return tap

    @contextmanager
    def capture(self, layers: list[int]) -> Iterator[None]:
        """Hooks on `layers` for the decoder forward run inside, so that `read` finds them after it."""
        handles = [] if self._compiled() else [
            self._decoder.layers[i].register_forward_pre_hook(self._keeper(i), with_kwargs=True)
            for i in layers if i < self.depth]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _keeper(self, i: int):
        def keep(module, args, kwargs):
            self._seen[i] = args[0] if args else kwargs["hidden_states"]
        return keep

    def _compiled(self) -> bool:
        return getattr(self._decoder, "_compiled_call_impl", None) is not None

    def forward_kwargs(self, layers: list[int]) -> dict[str, bool]:
        """What the decoder call needs so that `read` finds `layers`."""
        return {"output_hidden_states": True} if layers and self._compiled() else {}

    def read(self, out, layers: list[int]) -> list[torch.Tensor]:
        """The wanted layers' states from the decoder output `out` of the forward just run."""
        if self._compiled():
            return [out.hidden_states[i] for i in layers]
        states = [out.last_hidden_state if i == self.depth else self._seen[i] for i in layers]  # a layer may repeat
        self._seen.clear()
        return states
