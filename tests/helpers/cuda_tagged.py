"""Write a checkpoint as a GPU job's ``torch.save`` writes it: ``python tests/helpers/cuda_tagged.py SRC DST``.

``torch.save`` records, for every storage, the device it lives on: the location string that its registered tagger
returns (``torch.serialization.register_package``; torch's own CUDA tagger returns ``"cuda:0"`` for a storage on the
first GPU), and writes the storage's bytes, copied to the host. So a storage on the host whose tagger says
``"cuda:0"`` is written exactly as the same storage on ``cuda:0`` would be: the same bytes, the same location. This
script loads ``SRC`` on the host and saves it to ``DST`` with a tagger of higher priority than torch's, which says
``"cuda:0"`` for every tensor a GPU job holds on its GPU: everything but the optimizers' ``step`` counters, which
torch's optimizers (not capturable, not fused) keep on the host. It runs as a process of its own, so that the tagger
registered here touches no other program.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.serialization


def _tensors(obj: Any, on_host: bool = False) -> Iterator[tuple[torch.Tensor, bool]]:
    """Every tensor in a nested structure, with whether a GPU job keeps it on the host (an optimizer's ``step``)."""
    if isinstance(obj, torch.Tensor):
        yield obj, on_host
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, on_host or key == "step")
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, on_host)


def main(source: str, target: str) -> None:
    checkpoint = torch.load(source, map_location="cpu", weights_only=False)
    on_gpu = {t.untyped_storage().data_ptr() for t, on_host in _tensors(checkpoint) if not on_host and t.numel()}

    def tag(storage: Any) -> str | None:
        return "cuda:0" if storage.device.type == "cpu" and storage.data_ptr() in on_gpu else None

    def deserialize(storage: Any, location: str) -> None:
        return None  # loading is left to torch's own deserializers

    torch.serialization.register_package(0, tag, deserialize)
    torch.save(checkpoint, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
