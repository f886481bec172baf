"""The built-in ``test`` QA set: single-digit arithmetic generated from a seed.

Operands are single digits because SmolLM2-135M gets multi-digit arithmetic wrong almost always
("37 + 48" comes back as 104), which leaves every group with zero reward spread and
GRPO with no signal; single digits give groups of mixed right and wrong answers. Subtraction
puts the larger operand first, so no answer is negative and a leading minus sign never has to be
generated. The set needs no network and no files, so it is what the fast tests train on.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence

from rlrunbook.errors import ConfigError
from rlrunbook.rl.data.records import QARecord

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
DIGITS = range(1, 10)  # 0 is left out: "x * 0" and "x + 0" are free answers that dilute the signal.


def arithmetic_problems(n: int, seed: int, ops: Sequence[str] = ("+", "-", "*")) -> list[QARecord]:
    """``n`` questions like ``"What is 7 * 8?"`` with answers ``("56",)``, deterministic in ``seed``.

    Problem ``i`` depends only on ``seed`` and the problems before it, so a smaller ``n`` gives a
    prefix of a larger one. Ids are ``arith-<seed>-<i>``; ``solution`` is ``"7 * 8 = 56"``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n={n!r} must be a positive number of problems.")
    if isinstance(ops, str) or not ops or any(op not in OPERATORS for op in ops):
        raise ConfigError(f"ops={ops!r} must be a non-empty sequence drawn from {sorted(OPERATORS)}, "
                          "for example ('+', '-').")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        op = rng.choice(list(ops))
        a, b = rng.choice(DIGITS), rng.choice(DIGITS)
        if op == "-" and a < b:
            a, b = b, a
        answer = str(OPERATORS[op](a, b))
        records.append(QARecord(id=f"arith-{seed}-{i}", question=f"What is {a} {op} {b}?",
                                answers=(answer,), solution=f"{a} {op} {b} = {answer}"))
    return records
