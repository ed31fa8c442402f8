"""KV pages: a free list, per-sequence page tables, a watermark and a prefix cache.

Why this shape: pages are the only KV memory there is, so every page is at all times either
*free* (reference count 0, in the LRU free list) or *held* (count = number of sequences whose
`page_table` lists it) — `check()` asserts exactly that. A free page may still carry the hash of
the full page of tokens whose K/V it holds; a later sequence with the same prefix revives it
instead of recomputing (prefix caching). Allocation takes the least recently freed page, which
evicts its hash: the prefix cache is LRU over free pages and never costs capacity.

The hash of page i is blake2b(hash of page i-1 || tokens of page i): a chain, so equal hashes mean
equal prefixes. Only full pages are cached. Cached K/V is bitwise what recomputation would give
because the kernels are chunk-invariant (README.md), so a hit changes no output bits.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from serving.sequence import Sequence


def page_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Hash of one full page of tokens, chained to the hash of the page before it."""
    return hashlib.blake2b(
        parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16
    ).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageManager:
    """Owns `num_pages` pages of `page_size` tokens. Knows pages, nothing about scheduling."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_pages = int(watermark * num_pages)
        self.ref_count = [0] * num_pages
        self.page_to_hash: dict[int, bytes] = {}
        self.hash_to_page: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        # counters (read by metrics)
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # of which served from the cache
        self.evictions = 0

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def check(self, seqs: list[Sequence] = ()) -> None:
        """Assert exact accounting: free ∪ held = all pages, disjoint, counts match `seqs`."""
        held = {p for p in range(self.num_pages) if self.ref_count[p] > 0}
        assert held.isdisjoint(self.free), "a page is both free and held"
        assert len(held) + len(self.free) == self.num_pages, "a page was lost"
        if seqs is not None:
            expect = [0] * self.num_pages
            for s in seqs:
                for p in s.page_table:
                    expect[p] += 1
            assert expect == self.ref_count, "reference counts do not match the page tables"
        for h, p in self.hash_to_page.items():
            assert self.page_to_hash.get(p) == h, "prefix-cache maps disagree"

    # ------------------------------------------------------------------ allocation
    def _take_free_page(self) -> int:
        page, _ = self.free.popitem(last=False)  # least recently freed
        h = self.page_to_hash.pop(page, None)
        if h is not None:
            del self.hash_to_page[h]
            self.evictions += 1
        self.ref_count[page] = 1
        return page

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs so that K/V of `num_tokens` more tokens has a slot."""
        return max(
            0, cdiv(seq.num_computed_tokens + num_tokens, self.page_size) - len(seq.page_table)
        )

    def tokens_fitting(self, seq: Sequence, free_pages: int) -> int:
        """How many more tokens of `seq` fit in its pages plus `free_pages` new ones."""
        return (len(seq.page_table) + free_pages) * self.page_size - seq.num_computed_tokens

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` the pages for `num_tokens` more tokens; False (and no change) if too few."""
        need = self.pages_needed(seq, num_tokens)
        if need > self.num_free:
            return False
        seq.page_table.extend(self._take_free_page() for _ in range(need))
        return True

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references (finish, abort or preemption). Pages reaching count 0 go to the
        free list tail-first, so the deepest pages of a chain are evicted before its root."""
        for page in reversed(seq.page_table):
            self.ref_count[page] -= 1
            assert self.ref_count[page] >= 0, f"page {page} released twice"
            if self.ref_count[page] == 0:
                self.free[page] = None
        seq.page_table = []
        seq.page_hashes = []

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached pages holding a prefix of `seq`'s tokens (no side effects).

        At most (num_tokens - 1) // page_size pages: the last token is always recomputed, since
        its logits are what the step must produce.
        """
        if not self.enable_prefix_caching:
            return []
        pages, parent = [], b""
        B = self.page_size
        for i in range((seq.num_tokens - 1) // B):
            parent = page_hash(parent, seq.token_ids[i * B : (i + 1) * B])
            page = self.hash_to_page.get(parent)
            if page is None:
                break
            pages.append(page)
        return pages

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Start `seq` (empty page table) on the cached pages `cached` from `match_prefix`."""
        assert not seq.page_table and seq.num_computed_tokens == 0
        for page in cached:
            if self.ref_count[page] == 0:
                del self.free[page]
            self.ref_count[page] += 1
        seq.page_table = list(cached)
        seq.page_hashes = [self.page_to_hash[p] for p in cached]
        seq.num_computed_tokens = len(cached) * self.page_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed_tokens

    def register_full_pages(self, seq: Sequence) -> None:
        """After a step: publish the hashes of `seq`'s pages that became full of computed K/V."""
        if not self.enable_prefix_caching:
            return
        B = self.page_size
        while len(seq.page_hashes) < seq.num_computed_tokens // B:
            i = len(seq.page_hashes)
            parent = seq.page_hashes[-1] if seq.page_hashes else b""
            h = page_hash(parent, seq.token_ids[i * B : (i + 1) * B])
            seq.page_hashes.append(h)
            page = seq.page_table[i]
            if h not in self.hash_to_page and page not in self.page_to_hash:
                self.hash_to_page[h] = page
                self.page_to_hash[page] = h
