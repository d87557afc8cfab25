"""The target's features as EAGLE-3 reads them, captured by forward hooks: the outputs of the three feature layers
(HF `hidden_states` indices; index i is the output of decoder layer i-1) and of the final norm, while the *base*
model runs (`target.model.model`), so no other layer's states are kept and no full-vocabulary logits are
computed. Extraction (eyas.store.extract) and online training (eyas.train.batches) both read them here.
"""

from __future__ import annotations

import torch

from eyas.core.errors import EyasError


class Capture:
    """Forward hooks on the three feature layers and the final norm; `out` is [aux0, aux1, aux2, final], [B,T,H]."""

    def __init__(self, target, layer_ids: list[int]):
        layers = target.decoder_layers()
        self.modules = [layers[i - 1] for i in layer_ids] + [target.final_norm()]
        self.out: list[torch.Tensor | None] = [None] * 4
        self.handles = []

    def __enter__(self):
        for j, m in enumerate(self.modules):
            self.handles.append(m.register_forward_hook(self._hook(j)))
        return self

    def _hook(self, j: int):
        def hook(module, args, output):
            self.out[j] = output[0] if isinstance(output, tuple) else output
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class HostCopies(list):
    """The four captured tensors on their way to the host: pinned buffers filled by non-blocking copies on a side
    stream, so the next batch's forward runs meanwhile. `wait()` (the writer thread's) returns once they landed."""

    def __init__(self, tensors: list[torch.Tensor], done):
        super().__init__(tensors)
        self.done = done

    def wait(self) -> HostCopies:
        self.done.synchronize()
        return self


_COPY_STREAMS: dict = {}


def forward_batch(target, cap: Capture, toks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the base model on right-padded ids; the four captured [B, T, H] tensors on the host. On a GPU they come
    as HostCopies still in flight (call wait() before reading them): the device never waits for the host."""
    T = max(len(t) for t in toks)
    ids = torch.zeros(len(toks), T, dtype=torch.int64)  # pads are never attended to by real tokens
    for b, t in enumerate(toks):
        ids[b, : len(t)] = t
    with torch.inference_mode():
        target.model.model(input_ids=ids.to(target.device, non_blocking=True), use_cache=False)
        if target.device.type != "cuda":
            return [o.cpu() for o in cap.out]
        return _copy_to_host(cap.out, target.device)


def _copy_to_host(outs: list[torch.Tensor], device) -> HostCopies:
    """Device tensors -> pinned host tensors, copied on a side stream after the forward that made them."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    stream = _COPY_STREAMS[device]
    stream.wait_stream(torch.cuda.current_stream(device))
    host = [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) for o in outs]
    with torch.cuda.stream(stream):
        for h, o in zip(host, outs):
            h.copy_(o, non_blocking=True)
            o.record_stream(stream)  # its memory is not reused by the next forward before the copy is done
        done = torch.cuda.Event()
        done.record(stream)
    return HostCopies(host, done)


def check_layers(layer_ids: list[int], num_layers: int) -> None:
    bad = [i for i in layer_ids if not 1 <= i < num_layers]
    if bad:
        raise EyasError(f"feature layer(s) {bad} outside 1..{num_layers - 1} for a target with {num_layers} layers",
                        fix="use HF hidden_states indices; the final (post-norm) state is stored anyway")
