"""Constrained sampling on the host: the per-request logits transforms as one step's
`LogitsInputs` rows (logits_rows.py) and structured output's token masks (structured.py)."""
