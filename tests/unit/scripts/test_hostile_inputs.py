"""The hostile-input harness (scripts/hostile_inputs.py, the package scripts/hostile/): its outcome classifier,
pure, no process started, and its case table, built and not run."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

# scripts/ is sys.path[0] when the script runs; here it is put there only for these imports.
_SCRIPTS = str(Path(__file__).resolve().parents[3] / "scripts")
sys.path.insert(0, _SCRIPTS)
try:
    from hostile import classify as hc
    from hostile.cases import cases
finally:
    sys.path.remove(_SCRIPTS)

TB = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
      "ValueError: Overflow when unpacking long long\n")
RUN = "[run] /tmp/logs/20260101-000000_grpo_qa_run\n[data] qa data 'test': generated\n"


def c(**kw):
    kw.setdefault("expect", "no_crash")
    kw.setdefault("rc", 0)
    kw.setdefault("output", "")
    return hc.classify(**kw)


def test_clear_error_passes_with_its_message():
    assert c(rc=2, output="error: -n 0 must be >= 1. Pass positive counts.\n") == (
        "error", "error: -n 0 must be >= 1. Pass positive counts.")


def test_traceback_beats_a_clean_exit_code_and_names_the_exception():
    assert c(rc=2, output=TB) == ("traceback", "ValueError: Overflow when unpacking long long")
    assert c(rc=0, output=RUN + TB)[0] == "traceback"


def test_keyboard_interrupt_traceback_after_a_signal_is_still_a_traceback():
    out = "Traceback (most recent call last):\n  File \"a\", line 1\nKeyboardInterrupt\n"
    assert c(expect="signal", rc=130, output=out, signum=signal.SIGINT) == ("traceback", "KeyboardInterrupt")


def test_hang_wins_over_everything():
    assert c(rc=-9, output=TB, timed_out=True)[0] == "hang"


@pytest.mark.parametrize("rc", [-15, -6, 129, 3, 255])
def test_other_exit_codes_are_bad_exits(rc):
    outcome, msg = c(rc=rc, output="something\n")
    assert outcome == "bad_exit" and f"exit {rc}" in msg


def test_signal_exit_128_plus_n_is_interrupted_only_for_the_signal_sent():
    assert c(expect="signal", rc=143, signum=signal.SIGTERM, output="interrupted\n")[0] == "interrupted"
    assert c(expect="signal", rc=130, signum=signal.SIGTERM, output="x\n")[0] == "bad_exit"
    assert c(expect="signal", rc=-1 * signal.SIGHUP, signum=signal.SIGHUP)[0] == "bad_exit"


def test_overwrite_and_secret_and_post_check_outcomes():
    assert c(rc=0, changed=("run/run_metadata.json",))[0] == "overwrite"
    assert c(rc=2, output="error: x\n", secrets=("logs/r/run_metadata.json",))[0] == "secret_written"
    assert c(rc=0, extra=("bad_state", "still running")) == ("bad_state", "still running")
    # an unhandled signal is reported as such before a post-check's finding
    assert c(expect="signal", rc=-1, signum=1, extra=("bad_state", "still running"))[0] == "bad_exit"
    assert c(expect="signal", rc=129, signum=1, extra=("bad_state", "still running"))[0] == "bad_state"


def test_refuse_or_warn():
    assert c(expect="refuse_or_warn", rc=0, output=RUN)[0] == "silent_accept"
    assert c(expect="refuse_or_warn", rc=2, output="error: --judge-model has no effect in single_turn\n")[0] == "error"
    warned = "warning: --judge-model has no effect in single_turn mode\n" + RUN
    assert c(expect="refuse_or_warn", rc=0, output=warned, warn_words=("judge",)) == (
        "warned", "warning: --judge-model has no effect in single_turn mode")
    # a warning about something else does not count
    assert c(expect="refuse_or_warn", rc=0, output="warning: low disk\n" + RUN, warn_words=("judge",))[0] == \
        "silent_accept"
    # the dynamic sampler's step skip is not a warning about the input
    skip = RUN + "warning: step 0 skipped, no update: only 0 of 1 groups had reward spread\n"
    assert c(expect="refuse_or_warn", rc=0, output=skip)[0] == "silent_accept"
    # killed by the harness once started: accepted, so silent unless warned
    assert c(expect="refuse_or_warn", rc=-9, output=RUN, stopped_at_run=True)[0] == "silent_accept"
    assert c(expect="no_crash", rc=-9, output=RUN, stopped_at_run=True)[0] == "accepted"


def test_a_train_run_that_started_and_failed_its_rubric_counts_as_run_not_refused():
    out = RUN + "FAIL loss.present: no readable training_step\n"
    assert c(expect="refuse_or_warn", rc=1, output=out)[0] == "silent_accept"
    assert c(expect="no_crash", rc=1, output=out)[0] == "accepted"


def test_misleading_false_refusal_and_no_message():
    bad = "error: data.jsonl: line 4: is not valid JSON (Unterminated string)\n"
    assert c(expect="accept", rc=2, output=bad, bad_msg=r"not valid JSON")[0] == "misleading"
    assert c(expect="accept", rc=2, output="error: nope\n")[0] == "false_refusal"
    assert c(rc=2, output="\n\n") == ("no_message", "exit 2 with no output")


def test_output_lines_drop_progress_bars_and_split_carriage_returns():
    out = "train:   0%|     | 0/1 [00:00<?, ?step/s]\rwarning: --kl-estimator k3 has no effect\r\nok\n"
    assert hc.output_lines(out) == ["warning: --kl-estimator k3 has no effect", "ok"]
    assert hc.warning_lines("mismatch:\n  warn: 0.01\n") == []  # show-config's YAML is not a warning
    assert hc.warning_lines("[data] warning: 3 rows have an empty answer\n", ("empty",)) == [
        "[data] warning: 3 rows have an empty answer"]


def test_case_table_is_well_formed():
    table = cases()
    ids = [case.id for case in table]
    assert len(ids) == len(set(ids)) and len(table) >= 220
    assert {case.expect for case in table} <= {"no_crash", "accept", "refuse_or_warn", "signal"}
    for cls in ("limits", "filesystem", "model-folder", "encoding", "yaml", "resume", "task-options", "signals",
                "cookbook", "api-backend", "async", "overwrite", "silent-accept", "secrets", "misleading", "controls"):
        assert any(case.cls == cls for case in table), cls
    assert all(case.sig is not None for case in table if case.expect == "signal")


SITE_KI = ("Traceback (most recent call last):\n  File \"/usr/lib/python3.11/site.py\", line 73, in <module>\n"
           "KeyboardInterrupt\n")


@pytest.mark.parametrize(("signum", "rc", "output"), [(signal.SIGTERM, -15, ""), (signal.SIGHUP, -1, ""),
                                                      (signal.SIGINT, 1, SITE_KI), (signal.SIGINT, -2, "")])
def test_a_default_death_before_the_handlers_existed_is_before_start(signum, rc, output):
    outcome, msg = c(expect="signal", rc=rc, output=output, signum=signum, before_handlers=True)
    assert outcome == "before_start" and "before rlrunbook's handlers" in msg


def test_the_same_deaths_once_the_handlers_existed_fail():
    assert c(expect="signal", rc=-15, signum=signal.SIGTERM)[0] == "bad_exit"
    assert c(expect="signal", rc=1, output=SITE_KI, signum=signal.SIGINT)[0] == "traceback"


def test_before_the_handlers_anything_but_the_default_death_is_judged_as_usual():
    # another exception in start-up, another exit code, a signal other than the one sent: not before_start
    assert c(expect="signal", rc=1, output=TB, signum=signal.SIGINT, before_handlers=True)[0] == "traceback"
    assert c(expect="signal", rc=-9, signum=signal.SIGTERM, before_handlers=True)[0] == "bad_exit"
    assert c(expect="signal", rc=143, output="interrupted (SIGTERM)\n", signum=signal.SIGTERM,
             before_handlers=True)[0] == "interrupted"
