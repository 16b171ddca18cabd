"""The argmax on the device: llama.cpp's greedy sampler attached to a context's sequence through
its experimental backend-sampling API, so a decode copies back each row's argmax token instead of
its [n_vocab] logits (on a GPU the rows' copy and the host's argmax were most of a step's host
work). A mixin of Context (context.py): it needs the context's `_live()`, `seq`, `model`,
`decode()` and `close()`. docs/gpu.md, "The argmax on the device".
"""

from __future__ import annotations

from typing import Sequence

from . import backend as _b


class DeviceArgmax:
    _argmax = None        # the sampler chain llama.cpp runs on this sequence's rows, while on

    @property
    def argmax_on(self) -> bool:
        """Whether decodes of this sequence hand back each row's argmax, not its logits."""
        return self._argmax is not None

    def device_argmax(self, on: bool) -> bool:
        """Attach (or detach) a greedy sampler to this sequence. While it is on, verify_tokens()
        is the way to decode rows and reading logits raises. Each change costs one graph
        reserve at the next decode (~3-6 ms on a 2-core CPU); a chain is attached once
        (llama.cpp's backend_init), so each attach makes a fresh one. Returns whether it is on
        (False: llama.cpp could not offload it, or the rows are made on Vulkan, where it
        crashed on lavapipe at first use)."""
        if on == self.argmax_on:
            return on
        if on and self.model.output_on_device and "Vulkan" in self.model.device:
            return False
        ctx = self._live()
        chain, self._argmax = self._argmax, None
        if on:
            chain = _b.C.llama_sampler_chain_init(_b.C.llama_sampler_chain_default_params())
            _b.C.llama_sampler_chain_add(chain, _b.C.llama_sampler_init_greedy())
            if _b.C.llama_set_sampler(ctx, self.seq, chain):
                chain, self._argmax = None, chain
        if chain is not None:              # detached, or refused by llama.cpp
            _b.C.llama_set_sampler(ctx, self.seq, None)
            _b.C.llama_sampler_free(chain)
        _b.drain_log()
        return self.argmax_on

    def verify_tokens(self, tokens: Sequence[int]) -> list:
        """A verify batch with the argmax on the device: every row's greedy token."""
        if not self.argmax_on:
            raise RuntimeError("verify_tokens() needs device_argmax(True)")
        self.decode(tokens, logits="all", read=False)
        ctx = self._live()
        return [int(_b.C.llama_get_sampled_token_ith(ctx, i)) for i in range(len(tokens))]

    def close(self) -> None:
        """Free the context, then the chain (its context no longer refers to it)."""
        super().close()
        chain, self._argmax = self._argmax, None
        if chain is not None:
            _b.C.llama_sampler_free(chain)
