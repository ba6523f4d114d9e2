"""Pure verification functions (tensors in, tensors out), and the verifier the engine is given."""

from dataclasses import dataclass
from typing import Callable

from specdecode.verify.chain import VerifyResult, verify_greedy, verify_speculative


@dataclass(frozen=True)
class Verifier:
    """What the engine verifies with; ``check`` and tests inject a broken one to prove they notice."""

    greedy: Callable[..., VerifyResult] = verify_greedy
    speculative: Callable[..., VerifyResult] = verify_speculative


__all__ = ["Verifier", "VerifyResult", "verify_greedy", "verify_speculative"]
