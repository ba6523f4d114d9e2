"""The two statistical tests the check uses, with their cell-merging rules written down once.

Both are Pearson chi-square tests with the asymptotic chi-square null distribution. Cells are
formed *before* looking at the data (goodness of fit: from the expected law) or from data that are
symmetric under the null (two-sample: from the pooled counts), so merging does not bias the test.
Every merged cell has an expected count of at least ``min_expected``; with that, the chi-square
approximation is accurate enough for the small significance levels used here (the stated
false-alarm probabilities are asymptotic, as for any chi-square test).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import chi2

MIN_EXPECTED = 10.0  # per merged cell; twice the textbook 5 because our levels are ~1e-5


@dataclass
class StatTest:
    n: int  # sample size (per group for the two-sample test)
    cells: int  # merged cells; df = cells - 1
    statistic: float
    p_value: float  # 1.0 when there is nothing to test (fewer than 2 cells)
    level: float  # reject when p_value < level
    impossible: int = 0  # samples on tokens of probability 0 (goodness of fit only): reject at once
    tv: float = 0.0  # total variation between the two empirical/expected laws on the merged cells

    @property
    def rejected(self) -> bool:
        return self.impossible > 0 or self.p_value < self.level

    def to_dict(self) -> dict:
        return asdict(self) | {"rejected": self.rejected}


def goodness_of_fit(
    samples: np.ndarray,  # [n] int token ids
    probs: np.ndarray,  # [V] the law the samples should follow
    level: float,
    min_expected: float = MIN_EXPECTED,
) -> StatTest:
    """Chi-square goodness of fit of ``samples`` to ``probs``.

    Cells: tokens in decreasing probability, each its own cell while its expected count is at least
    ``min_expected``; the remaining tokens of positive probability form one "rest" cell, which is
    folded into the last cell if its own expected count is too small. A sample on a token of
    probability 0 cannot happen under the null, so it rejects outright (``impossible``).
    """
    samples = np.asarray(samples, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64)
    n = int(samples.size)
    counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
    impossible = int(counts[probs <= 0].sum())
    if n == 0:
        return StatTest(0, 0, 0.0, 1.0, level, impossible)
    probs = probs / probs.sum()
    order = np.argsort(-probs, kind="stable")
    order = order[probs[order] > 0]
    expected = n * probs[order]
    own = int(np.sum(expected >= min_expected))  # expected is sorted, so these are a prefix
    obs_cells = list(counts[order[:own]])
    exp_cells = list(expected[:own])
    rest_obs, rest_exp = counts[order[own:]].sum(), expected[own:].sum()
    if rest_exp >= min_expected or not exp_cells:
        obs_cells.append(rest_obs)
        exp_cells.append(rest_exp)
    else:
        obs_cells[-1] += rest_obs
        exp_cells[-1] += rest_exp
    return _pearson(np.array(obs_cells), np.array(exp_cells), n, level, impossible)


def two_sample(
    a: list[tuple],  # outcomes of group A: token tuples
    b: list[tuple],  # outcomes of group B
    level: float,
    min_expected: float = MIN_EXPECTED / 2,
) -> tuple[StatTest, list]:
    """Chi-square test that two samples of token tuples come from the same law (2 x cells table).

    Cells are token tuples, coarsened by prefix until frequent enough: a tuple whose pooled count
    would give the smaller group an expected count below ``min_expected`` is merged into its prefix
    one token shorter (repeatedly; the empty prefix is shown as ``<rest>``), and a still-too-small
    ``<rest>`` is folded into the smallest cell. So a sparse joint law of several tokens falls back
    to the law of the first tokens. The cells depend only on the pooled counts, which under the null
    carry no information about the group labels, so the test stays valid.
    Returns the result and the table rows ``[(cell, count_a, count_b)]``.
    """
    n_a, n_b = len(a), len(b)
    counts: dict[tuple, list[int]] = {}
    for group, outcomes in ((0, a), (1, b)):
        for x in outcomes:
            counts.setdefault(tuple(x), [0, 0])[group] += 1
    need = min_expected * (n_a + n_b) / max(1, min(n_a, n_b))  # pooled count for an expected >= min_expected
    for length in range(max((len(k) for k in counts), default=0), 0, -1):
        for key in [k for k in counts if len(k) == length and sum(counts[k]) < need]:
            ca, cb = counts.pop(key)
            merged = counts.setdefault(key[:-1], [0, 0])
            merged[0] += ca
            merged[1] += cb
    rest = counts.pop((), [0, 0])
    table = sorted(((k, ca, cb) for k, (ca, cb) in counts.items()), key=lambda r: -(r[1] + r[2]))
    if sum(rest) >= need or not table:
        table.append(("<rest>", rest[0], rest[1]))
    elif sum(rest):
        key, ca, cb = table[-1]
        table[-1] = (f"{key} + <rest>", ca + rest[0], cb + rest[1])
    if n_a == 0 or n_b == 0 or len(table) < 2:
        return StatTest(min(n_a, n_b), len(table), 0.0, 1.0, level), table
    obs = np.array([[ca, cb] for _, ca, cb in table], dtype=np.float64)  # [cells, 2]
    col = obs.sum(0)
    exp = obs.sum(1, keepdims=True) * col[None, :] / (n_a + n_b)
    stat = float(((obs - exp) ** 2 / exp).sum())
    tv = 0.5 * float(np.abs(obs[:, 0] / col[0] - obs[:, 1] / col[1]).sum())
    return StatTest(min(n_a, n_b), len(table), stat, float(chi2.sf(stat, len(table) - 1)), level, tv=tv), table


def _pearson(obs: np.ndarray, exp: np.ndarray, n: int, level: float, impossible: int) -> StatTest:
    if obs.size < 2:
        return StatTest(n, int(obs.size), 0.0, 1.0, level, impossible)
    stat = float(((obs - exp) ** 2 / exp).sum())
    tv = 0.5 * float(np.abs(obs - exp).sum()) / n
    return StatTest(n, int(obs.size), stat, float(chi2.sf(stat, obs.size - 1)), level, impossible, tv)
