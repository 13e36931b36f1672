"""--save-every: checkpoints written in the background while training goes on.

Each save is ``fzero.checkpoint.async_save``: the loop is blocked only while the state is
staged (copied to host memory), then steps on while a writer thread writes and commits the
snapshot. A save is reported once committed -- at the next log step, or when the next save or
the end of the run waits for it -- with how long the loop was blocked and how long the write
took; a save that failed stops the run with its error when the next save or the end of the run
waits for it, at the same step on every rank.
"""
from __future__ import annotations

import time

import fzero
from reporting import dir_bytes


class BackgroundSaves:
    """The run's checkpoints: the one in flight, and ``saved``, the committed ones' paths."""

    def __init__(self, progress):
        self.progress, self.pending, self.saved = progress, None, []

    def start(self, path: str, params, state, scaler_state, engine, extra: dict) -> None:
        """Save to ``path`` in the background (after the save in flight is reported)."""
        self.finish()
        start = time.perf_counter()
        future = fzero.checkpoint.async_save(path, params, state, scaler_state, engine, extra=extra)
        blocked, done = time.perf_counter() - start, []
        future.add_done_callback(lambda _: done.append(time.perf_counter()))  # when the writer committed it
        self.pending = (path, future, start + blocked, blocked, done)

    def poll(self) -> None:
        """Report the save in flight if it is committed (a log step). A failed one is raised by
        ``finish`` only: at the next save or the end, the same step on every rank."""
        if self.pending is not None and self.pending[1].done() and self.pending[1].exception() is None:
            self.finish()

    def finish(self) -> None:
        """Wait for the save in flight and report it; its ``CheckpointError`` if it failed."""
        if self.pending is None:
            return
        (path, future, returned, blocked, done), self.pending = self.pending, None
        future.result()
        self.saved.append(path)
        self.progress.write(f"saved checkpoint {path} ({dir_bytes(path) / 2**20:.2f} MiB, training blocked "
                            f"{blocked * 1e3:.1f} ms, written in the background in {done[0] - returned:.2f} s)")
