"""Case tables of the hostile-input run, part three: runs as they go.

One function per class, each adding its cases in order through ``add``: ``signals`` (SIGINT, SIGTERM and
SIGHUP at start-up, at exec and mid-run; the run must end 128+N and not read ``running``), ``cookbook`` (the
cookbook entry), ``api_backend`` (the API backend without a key, server or credential) and ``async_training``
(``--off-policy`` and what it is combined with). Nothing runs here.
"""

from __future__ import annotations

import signal

from .case import EVAL, EVAL_CK, EVAL_MID, T_LONG, TQA, Add, Case, qa_rows, run_status_check, w


def signals(add: Add) -> None:
    """Signals: SIGINT, SIGTERM and SIGHUP at start-up, at exec (blocked), at the run's start and mid-run."""
    sigs = {"int": signal.SIGINT, "term": signal.SIGTERM, "hup": signal.SIGHUP}
    for sname, signum in sigs.items():
        for when in (0.1, 0.5):
            add("signals", Case(f"train-sig{sname}-{when}s", "", TQA, expect="signal", sig=(signum, when),
                                post=run_status_check))
        add("signals", Case(f"train-sig{sname}-at-exec-blocked", "", TQA, expect="signal", sig=(signum, 0.0),
                            blocked=True, post=run_status_check))
        add("signals", Case(f"train-sig{sname}-mid-run", "", T_LONG,
                            expect="signal",
                            sig=(signum, r"^\[data\]", 2.0), post=run_status_check, timeout=240))
        add("signals", Case(f"train-sig{sname}-at-run-start", "", TQA, expect="signal",
                            sig=(signum, r"^\[run\]", 0.0), post=run_status_check))
    add("signals",
        Case("eval-sigint-mid", "", EVAL_MID,
             expect="signal", sig=(signal.SIGINT, r"^\[eval\]|Loading weights", 0.3)),
        Case("eval-sigint-0.5s", "", EVAL, expect="signal", sig=(signal.SIGINT, 0.5)),
        Case("eval-sigterm-mid", "", EVAL_MID,
             expect="signal", sig=(signal.SIGTERM, r"^\[eval\]|Loading weights", 0.3)),
        Case("eval-sighup-mid", "", EVAL_MID,
             expect="signal", sig=(signal.SIGHUP, r"^\[eval\]|Loading weights", 0.3)),
        Case("eval-checkpoints-sigint", "", EVAL_CK + ["{run}"], expect="signal", needs_run=True,
             sig=(signal.SIGINT, r"Loading weights|^\[data\]", 0.5), timeout=240),
        Case("check-logprobs-sigint", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "16",
                                           "--num-samples", "2"], expect="signal",
             sig=(signal.SIGINT, r"Loading weights", 0.2)),
        Case("package-sigint-0.3s", "", ["package", "{run}", "--out", "{work}/p.tar.gz"], expect="signal",
             needs_run=True, sig=(signal.SIGINT, 0.3)),
        Case("summarize-sigterm-0.3s", "", ["summarize", "{run}"], expect="signal", needs_run=True,
             sig=(signal.SIGTERM, 0.3)),
        Case("resume-sigint-mid", "", ["train", "--resume-from", "{ck1}"], expect="signal", needs_run=True,
             sig=(signal.SIGINT, r"^\[data\]", 0.0), post=run_status_check, timeout=240),
        Case("cookbook-sigint-0.5s", "", ["cookbook", "tinker_cookbook.recipes.rl_loop", "model_name=tiny"],
             expect="signal", sig=(signal.SIGINT, 0.5)),
        )


def cookbook(add: Add) -> None:
    """The cookbook entry: unknown modules and recipes, bad arguments, and the README's forms (accepted)."""
    add("cookbook",
        Case("cookbook-no-args", "", ["cookbook"]),
        Case("cookbook-unknown-module", "", ["cookbook", "no_such_module.train"]),
        Case("cookbook-unknown-recipe", "", ["cookbook", "tinker_cookbook.recipes.no_such_recipe"]),
        Case("cookbook-module-not-recipe", "", ["cookbook", "json"], timeout=90),
        Case("cookbook-empty-module", "", ["cookbook", ""]),
        Case("cookbook-dotted-garbage", "", ["cookbook", "...."]),
        Case("cookbook-path-not-module", "", ["cookbook", "/etc/passwd"]),
        Case("cookbook-unknown-renderer", "", ["cookbook", "--renderer", "nope", "tinker_cookbook.recipes.rl_loop",
                                               "model_name=tiny", "max_steps=1"], timeout=120),
        Case("cookbook-hf-dataset-missing-file", "", ["cookbook", "--hf-dataset", "openai/gsm8k={work}/nope.jsonl",
                                                      "tinker_cookbook.recipes.rl_loop", "model_name=tiny"],
             timeout=120),
        Case("cookbook-hf-dataset-no-equals", "", ["cookbook", "--hf-dataset", "openai/gsm8k",
                                                   "tinker_cookbook.recipes.rl_loop", "model_name=tiny"]),
        Case("cookbook-renderer-only", "", ["cookbook", "--renderer", "qwen3_instruct"]),
        Case("cookbook-bad-recipe-arg", "", ["cookbook", "tinker_cookbook.recipes.rl_loop", "model_name=tiny",
                                             "no_such_arg=1"], timeout=120),
        Case("cookbook-doc-form-renderer-hf-dataset", "",
             ["cookbook", "--renderer", "qwen3_instruct", "--hf-dataset", "openai/gsm8k={work}/gsm8k.jsonl",
              "tinker_cookbook.recipes.rl_loop", "model_name=tiny", "batch_size=2", "group_size=2", "max_tokens=4",
              "loss_fn=importance_sampling", "max_steps=1", "log_path={work}/runs/rl_loop"],
             expect="accept", setup=lambda c: w(c.work / "gsm8k.jsonl", qa_rows()), timeout=300,
             bad_msg=r"unrecognized arguments", note="the README's own form"),
        Case("cookbook-doc-form-renderer-only", "",
             ["cookbook", "--renderer", "qwen3_instruct", "tinker_cookbook.recipes.math_rl.train", "model_name=tiny",
              "env=arithmetic", "group_size=2", "groups_per_batch=2", "max_tokens=4", "max_steps=1", "eval_every=0",
              "loss_fn=importance_sampling",  # the recipe's default (stable_reinforce) is refused by name locally
              "save_every=0", "log_path={work}/runs/math_rl"], expect="accept", timeout=300,
             bad_msg=r"unrecognized arguments"),
        )


def api_backend(add: Add) -> None:
    """The API backend without a key, a reachable server or a working credential command."""
    blackhole = {"TINKER_BACKEND": "api", "TINKER_API_KEY": "tml-" + "a" * 40,
                 "TINKER_BASE_URL": "http://10.255.255.1:81", "HTTPS_PROXY": "", "HTTP_PROXY": ""}
    refused = dict(blackhole, TINKER_BASE_URL="http://127.0.0.1:9")
    add("api-backend",
        Case("api-no-key", "", TQA, env={"TINKER_BACKEND": "api"}, unset=("TINKER_API_KEY",)),
        Case("api-empty-key", "", TQA, env={"TINKER_BACKEND": "api", "TINKER_API_KEY": ""}),
        Case("api-key-blackhole", "", TQA, env=blackhole, timeout=150),
        Case("api-key-conn-refused", "", TQA, env=refused, timeout=150),
        Case("api-key-bad-url", "", TQA, env=dict(blackhole, TINKER_BASE_URL="not a url"), timeout=150),
        Case("api-eval-no-key", "", EVAL, env={"TINKER_BACKEND": "api"}, unset=("TINKER_API_KEY",)),
        Case("api-eval-blackhole", "", EVAL, env=blackhole, timeout=150),
        Case("api-check-logprobs-no-key", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "4"],
             env={"TINKER_BACKEND": "api"}, unset=("TINKER_API_KEY",)),
        Case("backend-unknown", "", TQA, env={"TINKER_BACKEND": "nope"}),
        Case("api-credential-cmd-fails", "", TQA, env={"TINKER_BACKEND": "api", "TINKER_CREDENTIAL_CMD": "false"},
             unset=("TINKER_API_KEY",)),
        Case("api-credential-cmd-hangs", "", TQA, env={"TINKER_BACKEND": "api",
                                                        "TINKER_CREDENTIAL_CMD": "sleep 1000"},
             unset=("TINKER_API_KEY",), timeout=150),
        )


def async_training(add: Add) -> None:
    """Asynchronous training: --off-policy values and the options it is combined with."""
    T3 = TQA[:-4] + ["-s", "3", "--max-tokens", "8"]
    add("async",
        Case("off-policy-negative", "", T3 + ["--off-policy", "-1"]),
        Case("off-policy-not-a-number", "", T3 + ["--off-policy", "one"]),
        Case("off-policy-1e20", "", T3 + ["--off-policy", str(10 ** 20)]),
        Case("off-policy-65", "", T3 + ["--off-policy", "65"]),
        Case("off-policy-at-steps", "", T3 + ["--off-policy", "3"]),
        Case("off-policy-yaml-float", "", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
             setup=lambda c: w(c.work / "cfg.yaml", "steps: 3\nnum_rollouts: 4\noff_policy: 1.5\n")),
        Case("off-policy-api-backend", "", T3 + ["--off-policy", "1"],
             env={"TINKER_BACKEND": "api", "TINKER_API_KEY": "tml-" + "x" * 40,
                  "TINKER_BASE_URL": "http://127.0.0.1:9"}, timeout=150),
        Case("off-policy-generate-sampler", "", T3 + ["--off-policy", "1", "backend.sampler=generate"],
             stop_at_run=True),
        Case("off-policy-correction-none", "", T3 + ["--off-policy", "1", "mismatch.correction=none"],
             stop_at_run=True),
        Case("off-policy-cap-without-truncate", "", T3 + ["--off-policy", "1", "mismatch.correction=mask",
                                                          "mismatch.cap=3"]),
        Case("concurrent-sampling-2", "", T3 + ["--off-policy", "1"], env={"TINKER_LOCAL_CONCURRENT_SAMPLING": "2"}),
        Case("timeline-into-a-file-as-folder", "", T3 + ["--off-policy", "1"],
             env={"TINKER_LOCAL_TIMELINE": "{work}/f/timeline.jsonl"}, setup=lambda c: w(c.work / "f", "x")),
        Case("timeline-dev-full", "", T3 + ["--off-policy", "1"], env={"TINKER_LOCAL_TIMELINE": "/dev/full"}),
        Case("resume-sync-checkpoint-with-off-policy", "", ["train", "--resume-from", "{ck1}", "--off-policy", "1"],
             needs_run=True, timeout=240),
        Case("cookbook-max-steps-off-policy-negative", "",
             ["cookbook", "--renderer", "qwen3_instruct", "tinker_cookbook.recipes.math_rl.train", "model_name=tiny",
              "env=arithmetic",
              "max_steps_off_policy=-1", "loss_fn=importance_sampling", "max_steps=1"], timeout=240),
        Case("ctl-off-policy-1", "", T3 + ["--off-policy", "1"], expect="accept", timeout=300),
        )
