"""How fzero's cross-rank failures are raised and worded: the floor that the communicators and
``arrival`` both stand on (it imports nothing of fzero)."""
from __future__ import annotations

__all__ = ["CollectiveError", "ranks_text"]


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, timed out, or disagreed); names the collective and rank."""


def ranks_text(ranks) -> str:
    """``"rank 3"`` or ``"ranks 0, 2"``: how every fzero error names ranks."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
