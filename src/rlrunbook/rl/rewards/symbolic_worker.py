r"""The worker process of :mod:`rlrunbook.rl.rewards.symbolic`: math-verify equivalence, one request per line.

Protocol (JSON lines): the worker first writes ``{"ready": true}`` (or ``{"error": "..."}`` when math-verify
cannot be imported); then for each request line ``{"pred": str, "ref": str}`` it writes ``{"equal": bool}``.
End of input ends the worker. It is started by :class:`rlrunbook.rl.rewards.symbolic.SymbolicChecker`,
which kills it when a comparison outlives the timeout.

Where this departs from ``math_verify.verify``'s defaults: every decimal literal becomes the exact
rational it writes (``1.414`` is 707/500) before comparing, and numeric differences are evaluated at 50
digits instead of 15, so a decimal approximation never equals an irrational (``1.414`` is not
``\sqrt{2}``, ``3.141592653589793`` is not ``\pi``; math-verify's own rounding would accept both). The
rest is math-verify: symbolic simplification, sets, intervals, equations.
"""

from __future__ import annotations

import json
import signal
import sys

NUMERIC_DIGITS = 50  # digits at which (a - b) must vanish; 15 (math-verify's default) lets approximations pass


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (even by SIGKILL): no orphan if the run is killed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed pipe still ends an idle worker
        pass


def _exact(expr):
    """``expr`` with every sympy Float replaced by the rational its decimal digits write."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return expr
    floats = expr.atoms(sympy.Float)
    return expr.xreplace({f: sympy.Rational(str(f)) for f in floats}) if floats else expr


def compare(pred: str, ref: str) -> bool:
    """Whether ``pred`` and ``ref`` (LaTeX or plain expressions, without ``$``) are the same mathematical answer."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    # No math-verify timeouts (signal.alarm): the parent process enforces one by killing this process.
    gold = parse(f"${ref}$", extraction_config=configs, parsing_timeout=None)
    target = parse(f"${pred}$", extraction_config=configs, parsing_timeout=None)
    if not gold or not target:
        return False
    return bool(verify([_exact(g) for g in gold], [_exact(t) for t in target], numeric_precision=NUMERIC_DIGITS,
                       timeout_seconds=None))


def main() -> int:
    _die_with_parent()
    # Ctrl-C reaches the whole process group; the parent decides when this worker ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = sys.stdout
    try:
        import logging

        import math_verify  # noqa: F401

        logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it warns once that its timeout is off
    except ImportError as error:
        out.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        out.flush()
        return 1
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            equal = compare(request["pred"], request["ref"])
        except Exception:  # noqa: BLE001 - malformed input that math-verify raises on is simply not equal
            equal = False
        out.write(json.dumps({"equal": equal}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
