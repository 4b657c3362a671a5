"""The pool's shelf of shared weight segments, and what a core needs to load a model.

    Pool.load_all(cores, graph)
       │ shelf.publish(graph): the graph's SharedWeights, written once per graph
       │   object and counted once more per core that loads it (acquire)
       ▼
    LoadSpec(skeleton, timing, weights) ──LOAD──▶ each core (kept for its restarts)
       │ a core's unload, or the load's own reference when it ends
       ▼
    shelf.release(weights): the last release unlinks the segment and forgets it

A graph is found on the shelf by identity: DataParallel loads one model per core,
all from one graph, and they all map one copy.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

from .weights import SharedWeights


class WeightShelf:
    """The weight segments a pool owns now, keyed by the graph they came from."""

    def __init__(self):
        # id(graph bytes) -> (those bytes, their SharedWeights), while a core holds them
        self._weights: Dict[int, Tuple[bytes, SharedWeights]] = {}
        self._lock = threading.Lock()

    def publish(self, graph) -> Optional[SharedWeights]:
        """The shared weights of ``graph``, written now unless a core already holds the
        same graph object (acquired once more then); None when nothing is shareable.

        Keyed by identity (the entry keeps the object, so its id stays its own): a
        content key would hash every byte of the weights."""
        with self._lock:
            entry = self._weights.get(id(graph))
            if entry is not None and entry[0] is graph and not entry[1].closed:
                entry[1].acquire()
                return entry[1]
            weights = SharedWeights.publish(graph)
            if weights is not None:
                self._weights[id(graph)] = (graph, weights)
            return weights

    def release(self, weights: SharedWeights) -> None:
        """One holder of ``weights`` is done; the last one unlinks the segment."""
        with self._lock:
            weights.release()
            if weights.closed:
                for key, (_graph, w) in list(self._weights.items()):
                    if w is weights:
                        del self._weights[key]

    def owned(self) -> Tuple[SharedWeights, ...]:
        """The segments on the shelf now."""
        with self._lock:
            return tuple(w for _graph, w in self._weights.values() if not w.closed)

    def close(self) -> None:
        """Unlink every segment (the pool closes)."""
        with self._lock:
            for _graph, weights in self._weights.values():
                weights.close()
            self._weights.clear()


class LoadSpec:
    """What a core needs to load a model (again, after a restart): the graph (the
    skeleton when the weights are shared), the latency model, the shared weights."""

    __slots__ = ("graph", "timing", "weights")

    def __init__(self, graph: bytes, timing: Tuple[int, ...],
                 weights: Optional[SharedWeights]):
        self.graph = bytearray(graph)  # writable: sent as a tensor view, never copied again
        self.timing = timing
        self.weights = weights

    def payload(self) -> tuple:
        import torch

        wire = self.weights.wire() if self.weights is not None else None
        return (torch.frombuffer(self.graph, dtype=torch.uint8), self.timing, wire)
