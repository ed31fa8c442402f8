"""Speculative decoding that changes no bit: `Speculator` (speculator.py: drafts, verify rows,
acceptance), model drafts (draft_model.py), adaptive K (adaptive.py) and rejection mode's verify
step (rejection.py)."""
