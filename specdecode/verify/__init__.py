"""Pure verification functions: tensors in, tensors out."""

from specdecode.verify.chain import VerifyResult, verify_greedy, verify_speculative

__all__ = ["VerifyResult", "verify_greedy", "verify_speculative"]
