"""The paged KV cache's bookkeeping: fixed-size blocks handed out from a free list (vLLM's PagedAttention block
pool, Kwon et al. 2023). Counts and block ids only: the runtime keeps the tensors, the simulator keeps nothing.
Written here because no library offers this bookkeeping without a model runner around it."""

from __future__ import annotations


class BlockPool:
    """`total` blocks of `block_size` tokens; a request holds a list of block ids (its block table)."""

    def __init__(self, total: int, block_size: int) -> None:
        self.total = total
        self.block_size = block_size
        # Popped from the end: the lowest ids go first, so a fresh pool hands out 0, 1, 2, ...
        self._free = list(range(total - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.total - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend `table` to hold `tokens` tokens; False (and no change) when too few blocks are free."""
        missing = self.blocks_for(tokens) - len(table)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        for _ in range(missing):
            table.append(self._free.pop())
        return True

    def release(self, table: list[int]) -> None:
        """Return every block of `table` to the pool and empty it."""
        self._free.extend(reversed(table))
        table.clear()
