"""`SpeculativeConfig`: how (and whether) an engine drafts tokens and verifies them.

Validated here, at the boundary (API, CLI, server), so the engine never sees an unknown value.
The design and why `verify="exact"` changes no bit: serving/speculative/speculator.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

METHODS = ("ngram", "self", "draft")
VERIFY = ("exact", "rejection")
# what this version runs (every combination); kept so a future method can be refused by name
IMPLEMENTED = {(m, v) for m in METHODS for v in VERIFY}
MAX_NUM_TOKENS = 16
# Revision of the adaptive-K policy (serving/speculative/adaptive.py). In rejection mode the policy
# decides which positions are rejection-sampled, i.e. part of the bits, so the fingerprint
# carries it: bump it whenever the policy changes which steps verify. Revision 4's rules: an
# n-gram lookup that finds nothing is not a miss; in rejection mode the policy never looks at a
# sequence's latest token (its bits independent of async scheduling), a verify is scheduled whole
# or deferred (never cut to the budget or free pages), a recompute leaves its last token to a
# decode step, and the prompt's last token never drafts: its bits independent of the load
# (serving/engine/scheduler.py).
ADAPTIVE_POLICY = 4


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the
        sequence's last n tokens, n from `ngram_max` down to `ngram_min`; no model),
        "self" (the target's first `draft_layers` layers + its norm and LM head) or
        "draft" (a separate small model sharing the tokenizer, `draft_model`: a path, a
        jdet.Model, or "default": the embedded model's trained draft, jdet/default_model/draft).
    num_tokens: K, the most draft tokens verified per sequence and step (1..16).
    verify: "exact" (default: accept draft i iff it equals the token the target samples there
        with its (seed, position) key, so the output is bitwise that of non-speculative decoding)
        or "rejection" (the standard accept-with-min(1, p/q) rule: same distribution, other bits).
    min_alpha: adaptive K (serving/speculative/adaptive.py): a request whose running per-position
        acceptance falls below this decodes without drafts (K = 0), so that steps where no
        request drafts are dispatched ahead (async scheduling) like plain decoding; it drafts
        again once its acceptance, still measured, recovers. 0: always draft. Changes no bit in
        exact mode (which steps verify never does).
    probe_every: with a model draft, a fallen-back request verifies one step's drafts again
        after this many tokens to re-measure its acceptance (n-gram drafts are re-measured on
        the host at every token, at no device cost).
    """

    method: str = "ngram"
    num_tokens: int = 4
    draft_model: Any = None
    verify: str = "exact"
    ngram_min: int = 1
    ngram_max: int = 4
    draft_layers: int | None = None
    min_alpha: float = 0.3
    probe_every: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is unknown; use one of {', '.join(METHODS)}"
            )
        if self.verify not in VERIFY:
            raise ValueError(
                f"speculative verify {self.verify!r} is unknown; use one of {', '.join(VERIFY)}"
            )
        if (self.method, self.verify) not in IMPLEMENTED:  # pragma: no cover - none today
            raise ValueError(
                f"speculative method={self.method!r} with verify={self.verify!r} is not "
                f"implemented in this version of jdet; use verify='exact'"
            )
        _int(self.num_tokens, "num_tokens", 1, MAX_NUM_TOKENS)
        _int(self.ngram_min, "ngram_min", 1, 64)
        _int(self.ngram_max, "ngram_max", self.ngram_min, 64)
        _int(self.probe_every, "probe_every", 1, 1 << 16)
        a = self.min_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"speculative min_alpha must be a number in [0, 1], got {a!r}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError(
                "speculative method='draft' needs draft_model: a checkpoint path, a jdet.Model, "
                "or 'default' (the embedded model's trained draft), e.g. "
                "SpeculativeConfig(method='draft', draft_model='default')"
            )
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"draft_model is only used by method='draft', not {self.method!r}")
        if self.draft_layers is not None:
            if self.method != "self":
                raise ValueError("draft_layers is only used by method='self'")
            _int(self.draft_layers, "draft_layers", 1, 1 << 16)

    @classmethod
    def from_any(cls, v: Any) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig or a dict of its fields (unknown keys refused by name)."""
        if v is None or isinstance(v, cls):
            return v
        if isinstance(v, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            bad = sorted(set(v) - names)
            if bad:
                raise ValueError(
                    f"unknown speculative setting(s) {', '.join(bad)}; known: "
                    f"{', '.join(sorted(names))}"
                )
            return cls(**v)
        raise TypeError(f"speculative must be a jdet.SpeculativeConfig or a dict, got {v!r}")

    @property
    def changes_bits(self) -> bool:
        """Whether outputs may differ from non-speculative decoding (the fingerprint's concern)."""
        return self.verify != "exact"


def add_flags(p: Any) -> None:
    """`jdet serve` / `jdet generate` flags (argparse); `from_args` reads them back."""
    p.add_argument(
        "--speculative-method", default=None, choices=METHODS,
        help="speculative decoding draft: 'ngram' (prompt lookup), 'self' (the model's first "
        "layers), 'draft' (--speculative-draft-model); default off",
    )  # fmt: skip
    p.add_argument(
        "--num-speculative-tokens", type=int, default=4,
        help="draft tokens verified per sequence and step, K (default: 4)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-verify", default="exact", choices=VERIFY,
        help="'exact': the same bits as without speculation (default)",
    )  # fmt: skip
    p.add_argument("--speculative-draft-model", default=None, help="draft model directory")
    p.add_argument(
        "--speculative-min-alpha", type=float, default=None,
        help="a request whose draft acceptance falls below this decodes without drafts (and "
        f"async) until it recovers; 0: always draft (default: {SpeculativeConfig.min_alpha})",
    )  # fmt: skip
    p.add_argument(
        "--speculative-draft-layers", type=int, default=None,
        help="layers of the 'self' draft (default: half the model's)",
    )  # fmt: skip


def from_args(a: Any) -> SpeculativeConfig | None:
    """The SpeculativeConfig of parsed `add_flags` flags, or None when speculation is off."""
    if a.speculative_method is None:
        flags = ("speculative_draft_model", "speculative_draft_layers", "speculative_min_alpha")
        for flag in flags:
            if getattr(a, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --speculative-method")
        return None
    return SpeculativeConfig(
        method=a.speculative_method,
        num_tokens=a.num_speculative_tokens,
        verify=a.speculative_verify,
        draft_model=a.speculative_draft_model,
        draft_layers=a.speculative_draft_layers,
        min_alpha=SpeculativeConfig.min_alpha if a.speculative_min_alpha is None
        else a.speculative_min_alpha,
    )


def _int(v: Any, name: str, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"speculative {name} must be an integer in [{lo}, {hi}], got {v!r}")
