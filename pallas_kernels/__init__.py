"""Pallas kernels whose reduction order depends on model shapes only, each with a pure-jnp
reference. This package knows nothing about models (DESIGN §2)."""

from pallas_kernels import _platform, xla_fixed
from pallas_kernels.matmul import matmul, matmul_reference
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.rms_norm import rms_norm, rms_norm_reference
from pallas_kernels.tree_matmul import (
    TREE_WIDTH,
    combine_tree,
    tree_matmul,
    tree_matmul_partial,
    tree_matmul_reference,
    tree_plan,
)
from pallas_kernels.vocab import (
    log_softmax,
    log_softmax_reference,
    logsumexp,
    logsumexp_reference,
)


def kernel_backend() -> str:
    """A name for the kernel implementation the invariant modes run here (its bits differ from
    the others'): 'xla-fixed-cpu', 'pallas-interpret', 'mosaic-gpu', 'pallas-triton' or
    'pallas-<platform>'. The system fingerprint includes it. Here rather than in `_platform`,
    which `xla_fixed` imports: the name reads `xla_fixed`'s row-block setting."""
    if _platform.xla_fixed_default():
        # the small row blocks off (not verified here, or forced) may give other bits
        return "xla-fixed-cpu" if xla_fixed.SMALL_ROW_BLOCKS else "xla-fixed-cpu/8-row"
    if _platform.interpret_default():
        return "pallas-interpret"
    if _platform.is_hopper():
        return "mosaic-gpu"
    p = _platform.platform()
    return "pallas-triton" if p == "gpu" else f"pallas-{p}"


__all__ = [
    "kernel_backend",
    "TREE_WIDTH",
    "combine_tree",
    "tree_plan",
    "log_softmax",
    "log_softmax_reference",
    "logsumexp",
    "logsumexp_reference",
    "matmul",
    "matmul_reference",
    "paged_attention",
    "paged_attention_reference",
    "rms_norm",
    "rms_norm_reference",
    "tree_matmul",
    "tree_matmul_partial",
    "tree_matmul_reference",
]
