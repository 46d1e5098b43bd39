"""Text-overlap scores of one answer against another (token ids or words)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def token_f1(candidate: Sequence[object], reference: Sequence[object]) -> float:
    """SQuAD-style F1 of the bags of tokens (1.0 when both are empty)."""
    if not candidate and not reference:
        return 1.0
    common = sum((Counter(candidate) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision = common / len(candidate)
    recall = common / len(reference)
    return 2 * precision * recall / (precision + recall)


def rouge_l(candidate: Sequence[object], reference: Sequence[object]) -> float:
    """ROUGE-L F-measure: from the longest common subsequence (1.0 when both are empty)."""
    if not candidate and not reference:
        return 1.0
    if not candidate or not reference:
        return 0.0
    previous = [0] * (len(reference) + 1)
    for a in candidate:
        current = [0]
        for j, b in enumerate(reference):
            current.append(previous[j] + 1 if a == b else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)
