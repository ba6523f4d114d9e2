"""`specdecode check`: evidence that speculation does not change what the target says.

Five parts, each with a PASS/FAIL verdict (see docs/exactness.md): the verifier's law on the pair's
real distributions, the end-to-end sampling law, greedy equality, stop/length accounting, seeds; and a
sixth for ``--sampler coupled`` (on by default with it): seeded equality with target-only decoding and
the coupled law.
"""

from specdecode.check.common import CheckConfig, EngineFactory, parse_settings
from specdecode.check.report import CheckReport, PartResult
from specdecode.check.runner import run_check
from specdecode.sampling import SamplingSetting

__all__ = [
    "CheckConfig",
    "CheckReport",
    "EngineFactory",
    "PartResult",
    "SamplingSetting",
    "parse_settings",
    "run_check",
]
