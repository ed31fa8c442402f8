"""The step shapes an engine runs (`ShapeSet`) and the default size of its KV page pool.

Why a bounded shape set (`ShapeSet`): every distinct (T, S, Pmax) compiles the step once per
sampler variant (serving/engine/sampler_variants.py: two on a GPU, one on a CPU), and a compile
costs seconds (BENCHMARKS.md, Start-up) that every request in flight waits for. So an engine
runs only the shapes of its `ShapeSet`, all compiled by `warmup()` before it serves:
- T, tokens: powers of two from `min_tokens_bucket` up to `stall_free_budget` (itself a bucket),
  then on up to `max_num_batched_tokens` (the last bucket): 16, 32, ..., 512, 1024, ..., 8192 by
  default on a GPU, 10 buckets (on a CPU 1, then 8 to 512: 8 buckets, `default_min_tokens_bucket`,
  `single_token_bucket`). A T above the stall-free budget is a step without decodes (a prompt at
  an idle engine, serving/engine/scheduler.py) and runs at the widest Pmax only: such a step is
  long, so padding its page table costs little, and it keeps the compiled set small;
- S, sequences: a function of T's bucket, S = clamp(T_bucket, min_seqs_bucket, max_num_seqs).
  No extra shapes: a step never holds more sequences than tokens, nor more than max_num_seqs
  (a decode step dispatched ahead takes the previous step's S sampled tokens padded on the
  device to its T: serving/engine/model_runner.py `prepare_ahead`);
- Pmax, page-table width: `min_pages_bucket` x 4^k below the pages of `max_model_len`, then that
  maximum (a last geometric bucket above half the maximum merges into it): 32, 128, 512 pages
  for max_model_len 8192 at page size 16, i.e. 3 buckets.
So |T <= budget| x |P| + |T > budget| shapes (6 x 3 + 4 = 22 with the defaults at max_model_len
8192), plus the |T <= budget| x |P| of `score()` (a separate function, compiled on its first use;
a step's score rows stay within the stall-free budget, serving/engine/scheduler.py). Why keep a
few Pmax buckets rather than one: the invariant attention kernel's split grid spans every
partition of Pmax (programs past a tile's context exit at once, but a wider table still costs a
little at decode, more at larger T: BENCHMARKS.md, Defaults and memory), a step's page table
travels to the device, and "none" off a GPU gathers all Pmax pages per token.
Padding cost (benchmarks/ready_bench.py `--padding`): decode steps run at about the exact shape's
time; a prefill chunk of few sequences pays most, mostly for the sampled rows of S = T. A busy
server fills steps to the token budget (T exact); few-sequence prefill is what pays.
Padding never changes a real row's bits: the kernels' reduction plans do not depend on T, S or
Pmax (README.md); padded rows write no K/V (slot -1) and their samples are dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jdet.plan import backend
from serving.engine.page_manager import cdiv

PAGES_BUCKET_FACTOR = 4  # ratio of consecutive Pmax buckets


@dataclasses.dataclass(frozen=True)
class ShapeSet:
    """Every (T, S, Pmax) an engine's step may run with (module docstring: why these)."""

    tokens: tuple[int, ...]  # ascending; the last is max_num_batched_tokens
    pages: tuple[int, ...]  # ascending; the last is the pages of max_model_len
    min_seqs: int
    max_seqs: int
    stall: int = 0  # the bucket of the stall-free budget: T above it runs at the widest Pmax only

    @classmethod
    def build(
        cls,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_pages: int,
        min_tokens_bucket: int | None = None,
        min_seqs_bucket: int = 1,
        min_pages_bucket: int = 32,
        stall_free_budget: int | None = None,
    ) -> ShapeSet:
        """`min_tokens_bucket` None: `default_min_tokens_bucket()`, and on a CPU a 1-token
        bucket below it (`single_token_bucket`). `stall_free_budget` None: max_num_batched_tokens
        (every T at every Pmax)."""
        single = min_tokens_bucket is None and single_token_bucket()
        if min_tokens_bucket is None:
            min_tokens_bucket = default_min_tokens_bucket()
        for name, v in (
            ("min_tokens_bucket", min_tokens_bucket),
            ("min_seqs_bucket", min_seqs_bucket),
            ("min_pages_bucket", min_pages_bucket),
        ):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        cap = max_num_batched_tokens
        stall = min(stall_free_budget or cap, cap)
        tokens, t = [], min(min_tokens_bucket, cap)
        if single and t > 1:
            tokens.append(1)
        while t < cap:
            tokens.append(t)
            if t < stall < 2 * t:
                tokens.append(stall)  # a bucket: steps with decodes fill it
            t *= 2
        tokens = sorted(set(tokens) - {cap}) + [cap]
        stall = next(b for b in tokens if b >= stall)  # the largest T a step with decodes pads to
        pages, p = [], min(min_pages_bucket, max_pages)
        while p < max_pages:
            pages.append(p)
            p *= PAGES_BUCKET_FACTOR
        if len(pages) > 1 and pages[-1] * 2 > max_pages:
            pages.pop()  # within 2x of the maximum: the maximum serves it
        return cls(
            tuple(tokens),
            tuple(pages) + (max_pages,),
            min(min_seqs_bucket, max_num_seqs),
            max_num_seqs,
            stall,
        )

    def pages_for(self, tokens_bucket: int) -> tuple[int, ...]:
        """The Pmax buckets of a T bucket: all up to the stall-free budget, then the widest."""
        return self.pages if tokens_bucket <= self.stall else self.pages[-1:]

    def seqs(self, tokens_bucket: int) -> int:
        """S for a token bucket: >= every step's sequence count (S <= T, S <= max_num_seqs)."""
        return min(max(tokens_bucket, self.min_seqs), self.max_seqs)

    def fit(self, num_tokens: int, num_seqs: int, num_pages: int) -> tuple[int, int, int]:
        """The (T, S, Pmax) bucket of a step; a step outside the set is a bug, not a compile."""
        t = next((b for b in self.tokens if b >= num_tokens), None)
        p = next((b for b in self.pages_for(t or 0) if b >= num_pages), None)
        if t is None or p is None or num_seqs > min(num_tokens, self.max_seqs):
            raise ValueError(
                f"a step of {num_tokens} tokens, {num_seqs} sequences and {num_pages} pages is "
                f"outside the engine's shape set (tokens {self.tokens}, pages {self.pages}, "
                f"at most {self.max_seqs} sequences)"
            )
        return t, self.seqs(t), p

    def all(self, kind: str = "step") -> list[tuple[int, int, int]]:
        """Every shape of `kind`, small first (what warm-up compiles): "score" stops at the
        stall-free budget (a step's score rows stay within it)."""
        top = self.stall if kind == "score" else self.tokens[-1]
        return [(t, self.seqs(t), p) for p in self.pages for t in self.tokens
                if t <= top and p in self.pages_for(t)]  # fmt: skip


def default_min_tokens_bucket() -> int:
    """The smallest T bucket: 8 on a CPU (below it the 1-token bucket of `single_token_bucket`
    where the defaults are kept), 16 elsewhere. Why 8 on a CPU: the CPU kernels compute every
    matmul of 5 or more rows in blocks of 8 (pallas_kernels/xla_fixed.py BM), so a decode padded
    to 16 tokens would compute a second, empty block of every product, attention group and
    sampled row. On a GPU a 16-row tile is the kernels' smallest step anyway."""
    return 8 if backend().cpu else 16


def single_token_bucket() -> bool:
    """Whether the default buckets start with T = 1 (then 8, 16, ...): on a CPU's fixed-order
    kernels, where a 1-token step runs 2-row dots (pallas_kernels/xla_fixed.py `row_block`)
    instead of 8-row ones, the same bits for its row (tests/serving/engine/test_small_buckets.py),
    and batch-1 decode runs faster (BENCHMARKS.md, CPU). One shape more per Pmax bucket to
    compile; batch 2-8 decodes stay at T = 8; `jdet generate` pins its one shape (jdet/cli.py)."""
    return backend().small_row_blocks


CPU_MAX_PAGES = 1024  # the default pool's cap off a GPU (default_num_pages)


def default_num_pages(page_size: int, *, max_model_len: int, max_num_seqs: int) -> int:
    """The pool off a device with a memory limit (a CPU): enough for a full batch of
    max_model_len sequences, at most CPU_MAX_PAGES (16k tokens at page 16: every engine allocates
    and zeroes its pool, a cost that grows with it),
    and at least one sequence. A GPU's pool is sized from its memory (serving/engine/memory.py)."""
    one = cdiv(max_model_len, page_size)
    return max(one, min(one * max_num_seqs, CPU_MAX_PAGES))


def model_len_limit(cfg: Any, max_model_len: int | None) -> int:
    """max_model_len as set, checked against the model's max_position_embeddings (its default)."""
    limit = cfg.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
            f"({limit}); lower it"
        )
    return max_model_len or limit


def kv_pool(
    cfg: Any,
    dtype: Any,
    *,
    page_size: int,
    max_model_len: int | None,
    num_pages: int | None,
    max_num_seqs: int,
) -> tuple[int, int]:
    """An engine's (max_model_len, num_pages) from its settings: max_model_len defaults to the
    model's max_position_embeddings (and may not exceed it), num_pages to `default_num_pages`
    (then an unset max_model_len shrinks to what the pool holds); the pool must hold one
    sequence of max_model_len."""
    model_len = model_len_limit(cfg, max_model_len)
    if num_pages is None:
        num_pages = default_num_pages(
            page_size, max_model_len=model_len, max_num_seqs=max_num_seqs
        )
        if max_model_len is None:
            model_len = min(model_len, num_pages * page_size)
    if num_pages * page_size < model_len:
        raise ValueError(
            f"num_pages={num_pages} x page_size={page_size} = {num_pages * page_size} KV slots "
            f"cannot hold one sequence of max_model_len={model_len}; raise num_pages "
            f"or lower max_model_len"
        )
    return model_len, num_pages
