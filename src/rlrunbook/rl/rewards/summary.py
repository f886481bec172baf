"""Rewards for summarisation: a reference-free compression reward and ROUGE against the highlights.

``compression_reward`` needs no reference, so it scores any document; it is the task reward of the
RS→GRPO mini experiment, where it must spread the samples of one group apart. ``rouge_reward``
measures agreement with the CNN/DailyMail highlights, for evaluation.
"""

from __future__ import annotations

import functools
import re

from rlrunbook.rl.rewards.base import RewardResult

MIN_WORDS = 8
"""Summaries shorter than this many words are scaled down linearly (a one-word summary gets 1/8)."""

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lowercase alphanumeric tokens: ``"U.S. stocks, 2015"`` gives ``["u", "s", "stocks", "2015"]``."""
    return _WORD.findall(text.lower())


def compression_reward(document: str, summary: str) -> RewardResult:
    """How well ``summary`` is a short, grounded, non-repetitive digest of ``document``, in [0, 1].

    With ``D`` the document's words and ``S`` the summary's (``words``: lowercase alphanumeric
    tokens), the reward is the product of four factors, each in [0, 1]::

        length_factor = min(1, |S| / MIN_WORDS)          # MIN_WORDS = 8
        compression   = 1 - min(1, |S| / |D|)
        grounding     = |{s in S : s occurs in D}| / |S|  # counted over tokens, with repeats
        distinctness  = |set(S)| / |S|
        reward        = length_factor * compression * grounding * distinctness

    What it rewards: a summary of at least 8 words, much shorter than the document, made of the
    document's own words, without repeating itself. It does not measure coverage of the
    document's key points (that is ``rouge_reward``'s job against the highlights); a fluent
    8-word extract of any sentence can score near 1. Because function words recur, distinctness
    also falls slowly as a summary grows (the CNN/DailyMail highlights score 0.33-0.88, mean 0.67),
    so among grounded summaries it prefers short ones.

    How degenerate summaries are kept low: the empty summary (or a document with no words)
    scores 0; copying the document, or writing more than it, scores 0 (compression); one word
    scores at most 1/8 (length_factor); text not drawn from the document loses its share of
    ungrounded words (grounding); repeating a word or phrase loses the repeated share
    (distinctness: the same word 20 times gives 1/20). Each factor is a ratio of counts, so the
    reward moves in small steps with every word added or changed and differs between realistic
    samples of one prompt, which is what gives a GRPO group non-zero advantages.

    Metrics: the four factors and ``summary_words``.
    """
    doc_words, sum_words = words(document), words(summary)
    if not doc_words or not sum_words:
        return RewardResult(0.0, {"length_factor": 0.0, "compression": 0.0, "grounding": 0.0,
                                  "distinctness": 0.0, "summary_words": float(len(sum_words))})
    n = len(sum_words)
    vocabulary = set(doc_words)
    length_factor = min(1.0, n / MIN_WORDS)
    compression = 1.0 - min(1.0, n / len(doc_words))
    grounding = sum(w in vocabulary for w in sum_words) / n
    distinctness = len(set(sum_words)) / n
    reward = length_factor * compression * grounding * distinctness
    return RewardResult(reward, {"length_factor": length_factor, "compression": compression,
                                 "grounding": grounding, "distinctness": distinctness,
                                 "summary_words": float(n)})


@functools.lru_cache(maxsize=1)
def _rouge_scorer():
    # Built once: the scorer loads NLTK's Porter stemmer, too slow to repeat for every sample.
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_reward(summary: str, highlights: str) -> RewardResult:
    """ROUGE-L F1 of ``summary`` against the reference ``highlights``, words stemmed with Porter's stemmer.

    Metrics: ``rouge1``, ``rouge2`` and ``rougeL`` F1. An empty summary or reference scores 0.
    """
    scores = _rouge_scorer().score(highlights, summary)  # rouge_score takes (target, prediction)
    metrics = {name: float(scores[name].fmeasure) for name in ("rouge1", "rouge2", "rougeL")}
    return RewardResult(metrics["rougeL"], metrics)
