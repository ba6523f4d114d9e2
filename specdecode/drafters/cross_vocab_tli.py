"""``--draft xvocab-tli:MODEL``: the cross-vocabulary draft in token-level intersection mode (the drafter
and its proofs: :mod:`specdecode.drafters.cross_vocab`)."""

from specdecode.drafters.cross_vocab import build_tli as build  # noqa: F401
