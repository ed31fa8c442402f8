"""The one partition body and the one merge of the Mosaic GPU paged attention family: what the
looped kernel (pallas_kernels/paged_attention_mosaic.py, whose docstring states the reduction
plan) and the split pair (paged_attention_mosaic_decode.py) both run, so their rows' bits are one
by construction, as `_partition` and `_merge` make the Triton pair's (paged_attention_kernels.py).
Also the producer warpgroup's TMA ring, shared by the attention kernels and the split merge.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax.numpy as jnp
from jax import lax

_LOG2E = math.log2(math.e)


def compute_registers(consumers: int, producer: int = 40) -> int:
    """setmaxnreg of a consumer warpgroup (as Pallas's warp-specialised pipeline computes it)."""
    return int(min(256, (512 - producer) // consumers) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class _Static:
    """A call's static plan and launch (the partition body's and the producer's constants)."""

    block_kv: int
    partition_size: int
    page: int
    steps: int
    qk_scale: float
    interpret: bool
    mask_all: bool = False
    num_pages: int = 1
    kv_heads: int = 1

    @property
    def nb(self) -> int:  # blocks per partition
        return self.partition_size // self.block_kv

    def blocks(self, hi):
        """KV blocks holding any position < hi (a part's highest row limit)."""
        return lax.div(jnp.maximum(hi, 0) + (self.block_kv - 1), jnp.int32(self.block_kv))


def _lay(x, layout, st: _Static):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return x if st.interpret else plgpu.layout_cast(x, layout)  # the interpreter has no layouts


def _sentinel(rows: int, e: int, st: _Static):
    """(-inf, 0, 0) in the consumer's layouts: every partition's and the fold's start."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    vec = plgpu.Layout.WGMMA.reduce(1)
    return (_lay(jnp.full((rows,), -jnp.inf), vec, st), _lay(jnp.zeros((rows,)), vec, st),
            _lay(jnp.zeros((rows, e), jnp.float32), plgpu.Layout.WGMMA, st))  # fmt: skip


def _load_lim(lim_smem, st: _Static):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if st.interpret:  # the interpreter has no `plgpu.load` (layouts mean nothing there)
        return lim_smem[...]
    return _load(plgpu, lim_smem, plgpu.Layout.WGMMA.reduce(1))


def _block(i, carry, *, base, q_smem, lim, ring, st: _Static, masked: bool):
    """One KV block's online-softmax step (module docstring) on ring slot (i - base) % steps."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k_smem, v_smem, k_full, v_full, k_used, v_used = ring
    rows, bk = q_smem.shape[0], st.block_kv
    m, lsum, acc = carry
    slot = lax.rem(i - base, jnp.int32(st.steps))
    plgpu.barrier_wait(k_full.at[slot])

    def qk(ref):
        plgpu.wgmma(ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        return ref[...]

    if st.interpret:  # the interpreter's wgmma takes no transposed ref: a plain dot
        s = _dot(q_smem[...], k_smem.at[slot][...], 1)
    else:
        s = pl.run_scoped(qk, plgpu.ACC((rows, bk), jnp.float32))
    plgpu.barrier_arrive(k_used.at[slot])
    if masked:
        if st.interpret:
            cols = lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
        else:
            cols = plgpu.broadcasted_iota(jnp.int32, (rows, bk), 1, layout=plgpu.Layout.WGMMA)
        # kv position i*bk + col < lim, as col < lim - i*bk: one vector subtraction
        lim_b = lax.broadcast_in_dim(lim - i * bk, (rows, bk), [0])
        s = jnp.where(cols < lim_b, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1) * st.qk_scale)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s * st.qk_scale - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    lsum = lsum * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    p16 = p.astype(q_smem.dtype)
    plgpu.barrier_wait(v_full.at[slot])

    def pv(ref):
        plgpu.wgmma(ref, p16, v_smem.at[slot])

    if st.interpret:  # no run_state there: P.V as a plain dot, added (other rounding)
        acc = acc + _dot(p16, v_smem.at[slot][...], 0)
    else:
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(v_used.at[slot])
    return m_new, lsum, acc


def partition_body(j, base, my_blocks, lo, q_smem, lim, ring, st: _Static):
    """Partition j's (m, l, acc) from the sentinel: the one partition body of the looped and the
    split kernels (blocks j*nb .. of this part, the unmasked ones first; `base`: the ring slot
    of block `base` is 0, a launch choice, never a bit)."""
    first = j * st.nb
    n_blk = jnp.minimum(my_blocks - first, st.nb)
    # blocks wholly below every valid row's limit need no mask (an identity there)
    n_full = 0 if st.mask_all else jnp.clip(lax.div(lo, jnp.int32(st.block_kv)) - first, 0,
                                            n_blk)  # fmt: skip
    kw = dict(base=base, q_smem=q_smem, lim=lim, ring=ring, st=st)
    part = _sentinel(q_smem.shape[0], q_smem.shape[1], st)
    part = lax.fori_loop(first, first + n_full, functools.partial(_block, masked=False, **kw),
                         part)  # fmt: skip
    return lax.fori_loop(first + n_full, first + n_blk, functools.partial(_block, masked=True,
                                                                          **kw), part)  # fmt: skip


def stream(start, end, load, used, steps: int):
    """A producer warpgroup's ring: load(i, slot) for items start .. end-1 (item i in slot
    (i - start) % steps), each slot reused once its `used` barriers say it is free; the last
    releases are observed too (every phase of a barrier is waited)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for s in range(steps):

        @pl.when(start + s < end)
        def _(s=s):
            load(start + s, s)

    def wait(i):
        for bar in used:
            plgpu.barrier_wait(bar.at[lax.rem(i - start, jnp.int32(steps))])

    @pl.loop(start + steps, jnp.maximum(end, start + steps))
    def _(i):
        wait(i)
        load(i, lax.rem(i - start, jnp.int32(steps)))

    pl.loop(jnp.maximum(end - steps, start), end)(wait)


def produce(start, end, base_page, page_of, k_ref, v_ref, ring, st: _Static):
    """The attention producer: TMA copies of the pages of KV blocks start .. end-1, one per
    page of K and of V, into the block's ring slot."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k_smem, v_smem, k_full, v_full, k_used, v_used = ring
    ppb, page = st.block_kv // st.page, st.page

    def load(i, slot):
        for p in range(ppb):
            pg = base_page + page_of(i * ppb + p)
            dst = pl.ds(p * page, page)
            plgpu.copy_gmem_to_smem(k_ref.at[pg], k_smem.at[slot, dst], k_full.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[pg], v_smem.at[slot, dst], v_full.at[slot])

    stream(start, end, load, (k_used, v_used), st.steps)


def _load(plgpu, ref, layout):
    """`plgpu.load` of a whole ref: JAX 0.10 wants the index, later JAXes deprecate (and then
    drop) it."""
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _dot(a, b, b_contract: int):
    """a[M, E] . b contracting b's axis `b_contract`, f32 (the interpreter's stand-in for
    wgmma, whose interpreted version takes no transposed operand)."""
    dims = (((1,), (b_contract,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def merge(state, part):
    """`paged_attention_kernels._merge` on the consumer's layouts: the one merge rule (the
    looped kernel's fold and the split path's merge kernel both call it)."""
    mm, ll, aa = state
    mj, lj, aj = part
    m_new = jnp.maximum(mm, mj)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    a = jnp.exp2(mm - m_safe)
    b = jnp.exp2(mj - m_safe)
    ll = ll * a + lj * b
    aa = aa * lax.broadcast_in_dim(a, aa.shape, [0]) + aj * lax.broadcast_in_dim(b, aj.shape, [0])
    return m_new, ll, aa


def finish(state):
    """out = A / L (0 where L = 0: A is 0 there), f32."""
    _, ll, aa = state
    safe = jnp.where(ll > 0.0, ll, 1.0)
    return aa / lax.broadcast_in_dim(safe, aa.shape, [0])


def _interpret_params():
    """Mosaic GPU's interpreter (a JAX that has it: 0.10 does), for the CPU tests."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
