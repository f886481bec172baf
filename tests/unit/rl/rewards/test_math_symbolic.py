r"""The math checker's symbolic step (math-verify in a worker process): equal pairs, unequal pairs, malformed
LaTeX, and the timeout that a hostile answer cannot defeat (off the main thread too, no orphan process).

Every pair here was written by hand; "unequal" pairs are the false positives a looser checker makes
(decimal approximations of irrationals, reordered tuples, letters read as products).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from rlrunbook.rl.rewards.math import compare_math_answers, math_answers_equal, math_reward
from rlrunbook.rl.rewards.symbolic import SymbolicChecker

EQUAL = [
    # the pairs
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\pi/2", r"\frac{\pi}{2}"),
    (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
    ("x^2+2x+1", "(x+1)^2"),
    (r"\{1,2\}", r"\{2,1\}"),
    (r"\sqrt 3", r"\sqrt{3}"),
    # more, by hand: 12 = 4 * 3; 2^10 = 1024; (1/2)^2 = 1/4; sin^2 + cos^2 = 1; sqrt(1/4) = 1/2 exactly
    (r"\sqrt{12}", r"2\sqrt{3}"),
    ("2^{10}", "1024"),
    (r"\left(\frac{1}{2}\right)^2", r"\frac14"),
    (r"\sin^2 x + \cos^2 x", "1"),
    (r"\sqrt{0.25}", r"\frac{1}{2}"),
    (r"\{3, 1, 2\}", r"\{1,2,3\}"),
    (r"\frac{\pi}{4}", r"0.25\pi"),
]
UNEQUAL = [
    (r"\sqrt{8}", "3"),
    (r"\pi/2", r"\pi/3"),
    ("x^2+1", "(x+1)^2"),
    (r"\{1,2\}", r"\{1,3\}"),
    ("(1,2)", "(2,1)"),  # ordered pairs / open intervals
    ("[1,2]", "(1,2)"),  # closed vs open interval
    ("2x", "2y"),
    # decimal approximations are not the irrational (math-verify's own rounding would accept these)
    ("1.414", r"\sqrt{2}"),
    ("3.141592653589793", r"\pi"),
    ("e", "2.718281828"),
    (r"\sqrt{2}+1.4142135623730951", r"2\sqrt{2}"),
    # words are not products of letters: n*o == o*n would make these equal
    ("no", "on"),
    ("ab", "ba"),
]
MALFORMED = [r"\frac{1}{", "}{", r"\sqrt{", "$$", r"\left(", "^^", r"\frac{}{}", r"\begin{matrix}", "{{{{", "", " "]


@pytest.mark.parametrize(("pred", "ref"), EQUAL)
def test_equivalent_answers_are_equal_both_ways(pred, ref):
    assert math_answers_equal(pred, ref) and math_answers_equal(ref, pred)
    verdict = compare_math_answers(pred, ref)
    assert verdict.method in ("symbolic", "exact", "string")


@pytest.mark.parametrize(("pred", "ref"), UNEQUAL)
def test_different_answers_are_never_equal(pred, ref):
    assert not math_answers_equal(pred, ref) and not math_answers_equal(ref, pred)


@pytest.mark.parametrize("bad", MALFORMED)
def test_malformed_latex_scores_zero_and_never_raises(bad):
    for ref in ("1", r"\frac{1}{2}", bad):
        if ref == bad and bad.strip():
            continue  # a string equals itself (string step): not the point here
        assert not math_answers_equal(bad, ref)
    assert math_reward(rf"\boxed{{{bad}}}", "2").reward == 0.0


def test_math_reward_flags_symbolic_matches():
    result = math_reward(r"so the answer is \boxed{2\sqrt{2}}", r"\sqrt{8}")
    assert result.reward == 1.0 and result.metrics["symbolic"] == 1.0 and result.metrics["symbolic_timeout"] == 0.0


# A hostile answer: 10^(10^10) has ten billion digits; evaluating it keeps sympy busy far past any timeout.
HOSTILE = "10^{10^{10}}"


def test_a_hostile_answer_times_out_and_the_checker_recovers():
    checker = SymbolicChecker()
    try:
        assert checker.compare(r"\sqrt{4}", "2").equal  # started once
        started = time.monotonic()
        verdict = checker.compare(HOSTILE, "1", timeout_s=0.5)
        elapsed = time.monotonic() - started
        assert verdict.timed_out and not verdict.equal
        assert elapsed < 0.5 + 1.5, elapsed  # the timeout plus the kill, not math-verify's 5 s or sympy's minutes
        # the busy worker was killed; the next comparison starts a fresh one and works
        assert checker.compare(r"\sqrt{9}", "3").equal and checker.started == 2
    finally:
        checker.close()


def test_the_timeout_holds_off_the_main_thread():
    # signal.alarm (math-verify's own timeout) cannot fire outside the main thread; the worker's kill can.
    checker = SymbolicChecker()
    verdicts = []
    thread = threading.Thread(target=lambda: verdicts.append(checker.compare(HOSTILE, "1", timeout_s=0.5)))
    try:
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive() and verdicts[0].timed_out
    finally:
        checker.close()


def test_math_reward_counts_a_timeout_and_scores_zero():
    result = math_reward(rf"\boxed{{{HOSTILE}}}", "1", timeout_s=0.5)
    assert result.reward == 0.0 and result.metrics["symbolic_timeout"] == 1.0


DIES_WITH_WORKER = """
import os, signal, sys
from rlrunbook.rl.rewards.symbolic import SymbolicChecker
checker = SymbolicChecker()
checker.compare(r"\\sqrt{4}", "2")
print(checker._process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the parent dies without any cleanup
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_the_worker_never_outlives_a_killed_parent():
    done = subprocess.run([sys.executable, "-c", DIES_WITH_WORKER], capture_output=True, text=True,
                          env={**os.environ}, timeout=60, check=False)
    assert done.returncode == -9, done.stderr
    worker = int(done.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), f"symbolic worker {worker} outlived its parent"
