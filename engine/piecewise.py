"""A split model's decode step as CUDA graphs between its collectives.

A rank's step is its kernels with the ranks' sums (and the LM head's gather) in between. The
kernels of each stretch between two collectives are captured as one CUDA graph; the collective
itself runs eagerly between two replays, in place on the graph's own static tensors
(tp_group.TPGroup.cut). So one capture serves any process group: NCCL, or gloo through host memory
where the ranks share one GPU (tp_group.ranks_share_gpu), whose sums no graph can hold. A step of L
layers has 2L + 2 collectives and one graph more on rank 0 (the last holds the argmax), as many on
the others; the eager step is every kernel launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from engine.tp_group import TPGroup


class Pieces:
    """A captured step: graphs[i] replays, then between[i] runs (while there is one)."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.between: list[Callable[[], object]] = []

    def replay(self) -> None:
        # NOTE: the capture ran under inference mode (the forward's), so the static tensors the
        # collectives update in place are inference tensors: so must the replay run.
        with torch.inference_mode():
            for i, graph in enumerate(self.graphs):
                graph.replay()
                if i < len(self.between):
                    self.between[i]()


def capture_pieces(step: Callable[[], object], hook: TPGroup | Any, pool, stream) -> tuple[Pieces, object]:
    """Capture step() (a forward on static buffers) as Pieces on the graph memory pool pool, from
    stream (a side stream: one for all of a model's captures, as the caching allocator reuses the
    pool's freed blocks only on the stream that took them); returns them and what step returned
    (its static outputs). hook: what cuts the step (a TPGroup at its collectives, the mixed graphs
    at each attention), whose cut attribute is set for the capture. Nothing runs on the device here:
    a collective or attention met during the capture is recorded, not done."""
    pieces = Pieces()
    stream.wait_stream(torch.cuda.current_stream())
    graph: torch.cuda.CUDAGraph | None = None

    def begin() -> None:
        nonlocal graph
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)

    def cut(run: Callable[[], object], is_last: bool) -> None:
        nonlocal graph
        graph.capture_end()
        pieces.graphs.append(graph)
        pieces.between.append(run)
        graph = None
        if not is_last:
            begin()

    with torch.cuda.stream(stream):
        begin()
        hook.cut = cut
        try:
            out = step()
        except BaseException:
            if graph is not None:
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()
            raise
        finally:
            hook.cut = None
        if graph is not None:
            graph.capture_end()
            pieces.graphs.append(graph)
    torch.cuda.current_stream().wait_stream(stream)
    return pieces, out
