"""--memory-window K (as TPI-LLM's sliding window): a worker keeps only K layers' weights resident. A background
thread reads the next layers from the folder's safetensors files (safetensors' safe_open: only the tensors
asked for) while the current layer computes; every step walks the layers in order, so the reader simply cycles
through them, at most K layers ahead of the compute (a semaphore of K slots, freed as each layer is dropped)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from fivefold.checkpoint.hf import _weight_files, hf_names
from fivefold.spec import ModelSpec


class SafetensorsLayers:
    """Reads one layer's weights (fivefold names, experts stacked) or the non-layer ones from an HF folder."""

    def __init__(self, folder: str, spec: ModelSpec) -> None:
        from safetensors import safe_open

        self.spec = spec
        where: dict[str, Path] = {}
        for file, promised in _weight_files(Path(folder)).items():
            if promised is None:
                with safe_open(str(file), "pt") as handle:
                    promised = list(handle.keys())
            where.update({name: file for name in promised})
        self.where = where
        self.names = hf_names(spec)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        wanted: dict[Path, list[str]] = {}
        for ours in names:
            for theirs in self.names[ours] if isinstance(self.names[ours], list) else [self.names[ours]]:
                wanted.setdefault(self.where[theirs], []).append(theirs)
        tensors: dict[str, torch.Tensor] = {}
        for file, hf_list in wanted.items():
            with safe_open(str(file), "pt") as handle:
                tensors.update({name: handle.get_tensor(name).to(torch.float32) for name in hf_list})
        out = {}
        for ours in names:
            theirs = self.names[ours]
            out[ours] = torch.stack([tensors[t] for t in theirs]) if isinstance(theirs, list) else tensors[theirs]
        return out

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        return self.read([name for name in self.names if name.startswith(f"layers.{layer}.")])

    def resident(self) -> dict[str, torch.Tensor]:
        """Embeddings, final norm and LM head (always resident)."""
        state = self.read([name for name in self.names if not name.startswith("layers.")])
        if "output.weight" not in state and self.spec.tied_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
        return state


class LayerStream:
    """The layers' weights in compute order, forever: `take()` the next, `release()` once it is dropped."""

    def __init__(self, load: Callable[[int], dict], layers: list[int], window: int) -> None:
        self.load, self.layers = load, layers
        self.slots = threading.Semaphore(window)
        self.ready: queue.Queue = queue.Queue()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="fivefold-layer-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        index = 0
        while not self.closed:
            self.slots.acquire()
            if self.closed:
                return
            layer = self.layers[index % len(self.layers)]
            try:
                self.ready.put((layer, self.load(layer)))
            except Exception as exc:  # noqa: BLE001 - handed to the compute thread, which raises it
                self.ready.put((layer, exc))
                return
            index += 1

    def take(self) -> tuple[int, dict]:
        layer, weights = self.ready.get()
        if isinstance(weights, Exception):
            raise weights
        return layer, weights

    def release(self) -> None:
        self.slots.release()

    def close(self) -> None:
        self.closed = True
        self.slots.release()
