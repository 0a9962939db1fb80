"""The cyclic garbage collector in the long-running processes (the nodes and the proxy).

A full collection traverses every object the collector tracks, and stops the process meanwhile:
a node's loop between two decode steps, the proxy's event loop between two streamed tokens of
every request. Start-up leaves hundreds of thousands of such objects (torch, transformers, the
model's Python side, the tokenizer) that live as long as the process: they are frozen once
(gc.freeze), and the full collections that serving triggers traverse only what serving allocated.

Standard library only: the proxy imports it, and stays torch-free.
"""

from __future__ import annotations

import gc


def freeze_start_up_objects() -> int:
    """Collect once (start-up's own garbage goes), then move every object alive now out of the
    collector's reach for good; returns how many are frozen. Call once, when start-up is done:
    an object frozen here that later ends in a reference cycle is never freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
