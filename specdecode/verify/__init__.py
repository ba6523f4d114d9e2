"""Pure verification functions (tensors in, tensors out), and the verifier the engine is given."""

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from specdecode.processors import process_batch
from specdecode.verify.chain import VerifyResult, verify_greedy, verify_speculative
from specdecode.verify.coupled import verify_coupled, verify_tree_coupled
from specdecode.verify.tree import TreeVerifyResult, verify_tree, verify_tree_greedy


@dataclass(frozen=True)
class Verifier:
    """What the engine verifies with; ``check`` and tests inject a broken one to prove they notice."""

    greedy: Callable[..., VerifyResult] = verify_greedy  # chains
    speculative: Callable[..., VerifyResult] = verify_speculative
    tree_greedy: Callable[..., TreeVerifyResult] = verify_tree_greedy  # trees (verify/tree.py)
    tree: Callable[..., TreeVerifyResult] = verify_tree
    coupled: Callable[..., VerifyResult] = verify_coupled  # --sampler coupled (verify/coupled.py)
    tree_coupled: Callable[..., TreeVerifyResult] = verify_tree_coupled
    # (seqs, logits [B, Q, V], prefixes [B][Q]) -> the target's logits through each request's processors, each
    # verified position with its drafted prefix (specdecode.processors)
    process: Callable[..., Tensor] = process_batch


__all__ = [
    "TreeVerifyResult",
    "Verifier",
    "VerifyResult",
    "verify_coupled",
    "verify_greedy",
    "verify_speculative",
    "verify_tree",
    "verify_tree_coupled",
    "verify_tree_greedy",
]
