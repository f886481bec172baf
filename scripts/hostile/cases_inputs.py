"""Case tables of the hostile-input run, part one: what a user types or feeds in.

One function per class, each adding its cases in order through ``add``: ``controls`` (documented forms that
must be accepted), ``limits`` (numbers beyond limits), ``encodings`` (bytes that are not UTF-8),
``task_options`` (options of the wrong type), ``silent_accepts`` (options without effect, which must be refused
or warned about) and ``misleading`` (refusals that must name the real cause). Nothing runs here.
"""

from __future__ import annotations

import json

from .case import EVAL, EVAL_CK, TQA, Add, Case, T, data_case, qa_rows, w


def controls(add: Add) -> None:
    """Controls: documented forms that must be accepted."""
    add("controls",
        Case("ctl-train-preset", "", [a for a in T if not a.startswith("checkpoint.every=")] + ["checkpoint.every=1"],
             expect="accept", timeout=300),
        Case("ctl-train-qa", "", TQA + ["--num-groups", "2"], expect="accept", stop_at_run=True),
        Case("ctl-show-config", "", ["show-config", "--config-file", "tiny-cpu-smoke"], expect="accept"),
        Case("ctl-resolve-model", "", ["resolve-model", "tiny"], expect="accept"),
        Case("ctl-eval", "", EVAL, expect="accept"),
        Case("ctl-check-run", "", ["check-run", "{run}"], expect="accept", needs_run=True),
        Case("ctl-summarize", "", ["summarize", "{run}"], expect="accept", needs_run=True),
        Case("ctl-package", "", ["package", "{run}", "--out", "{work}/run.tar.gz"], expect="accept",
             needs_run=True),
        Case("ctl-resume", "", ["train", "--resume-from", "{ck1}"], expect="accept", needs_run=True, timeout=300),
        Case("ctl-jsonl-data", "", ["train", "--model", "tiny", "--env", "math", "--dataset", "{work}/data.jsonl",
                                    "-n", "4", "-s", "1", "--max-tokens", "8"], expect="accept",
             setup=lambda c: w(c.work / "data.jsonl", qa_rows()), stop_at_run=True),
        Case("ctl-unicode-name", "", TQA + ["--name", "résumé-測試"], expect="accept", stop_at_run=True),
        Case("ctl-eval-checkpoints", "", EVAL_CK + ["{run}"], expect="accept", needs_run=True, timeout=240),
        )


def limits(add: Add) -> None:
    """Numbers beyond limits: on the command line, in YAML and in data files."""
    big = str(10 ** 23)
    add("limits",
        Case("seed-1e23", "", TQA + ["--seed", big]),
        Case("seed-2**63", "", TQA + ["--seed", str(2 ** 63)]),
        Case("seed-2**64", "", TQA + ["--seed", str(2 ** 64)]),
        Case("seed-5001-digits", "", TQA + ["--seed", "9" * 5001]),
        Case("n-1e20", "", TQA[:-6] + ["-n", str(10 ** 20), "-s", "1", "--max-tokens", "8"], timeout=120),
        Case("n-2**31", "", TQA[:-6] + ["-n", str(2 ** 31), "-s", "1", "--max-tokens", "8"], timeout=120),
        Case("steps-1e20", "", TQA[:-4] + ["-s", str(10 ** 20), "--max-tokens", "8"], timeout=120),
        Case("max-tokens-1e12", "", TQA[:-2] + ["--max-tokens", str(10 ** 12)], timeout=120),
        Case("lora-rank-1e9", "", TQA + ["--lora-rank", str(10 ** 9)], timeout=120),
        Case("num-groups-1e20", "", TQA + ["--num-groups", str(10 ** 20)]),
        Case("temperature-1e400", "", TQA + ["--temperature", "1e400"]),
        Case("temperature-nan", "", TQA + ["--temperature", "nan"]),
        Case("lr-inf", "", TQA + ["--learning-rate", "inf"]),
        Case("kl-coef-1e308", "", TQA + ["--kl-coef", "1e308"], stop_at_run=True),
        Case("checkpoint-every-1e30", "", TQA + ["--checkpoint-every", str(10 ** 30)]),
        Case("val-samples-1e20", "", TQA + ["--val-every", "1", "--val-samples", str(10 ** 20)], timeout=120),
        Case("max-prompt-tokens-1e25", "", TQA + ["--max-prompt-tokens", str(10 ** 25)], timeout=120),
        Case("override-steps-5001-digits", "", TQA[:-4] + ["--max-tokens", "8", "steps=" + "1" * 5001]),
        Case("override-test-size-1e20", "", TQA + ["extra.test_size=" + str(10 ** 20)], timeout=120),
        Case("eval-samples-1e20", "", EVAL + ["--samples", str(10 ** 20)], timeout=120),
        Case("eval-resamples-1e20", "", EVAL + ["--resamples", str(10 ** 20)], timeout=120),
        Case("eval-ks-1e20", "", EVAL[:-4] + ["--ks", str(10 ** 20), "--resamples", "50"]),
        Case("eval-seed-1e23", "", EVAL + ["--seed", big]),
        Case("eval-num-problems-1e20", "", EVAL[:2] + ["--num-problems", str(10 ** 20), "--samples", "1",
                                                       "--ks", "1", "--max-tokens", "4"], timeout=120),
        Case("check-logprobs-seed-1e23", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "4",
                                              "--num-samples", "1", "--seed", big]),
        Case("check-logprobs-samples-1e20", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "4",
                                                 "--num-samples", str(10 ** 20)], timeout=120),
        Case("yaml-steps-1e30", "", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
             setup=lambda c: w(c.work / "cfg.yaml", f"steps: {10 ** 30}\nnum_rollouts: 4\n"), timeout=120),
        )
    lim = [
        data_case("data-5001-digit-answer", json.dumps({"question": "q?", "answer": "#### " + "7" * 5001}) + "\n"
                  + qa_rows(4)),
        data_case("data-5001-digit-int-field", '{"question": "q?", "answer": "#### 4", "id": ' + "9" * 5001 + "}\n"
                  + qa_rows(4)),
        data_case("data-nested-100000", lambda: ('{"question": "q?", "answer": "#### 4", "x": ' + "[" * 100000
                                                 + "]" * 100000 + "}\n" + qa_rows(4)).encode()),
        data_case("data-nested-objects-50000", lambda: ('{"question": "q?", "answer": "#### 4", "x": '
                                                        + '{"a":' * 50000 + "1" + "}" * 50000 + "}\n"
                                                        + qa_rows(4)).encode()),
        data_case("data-huge-line-64MB", lambda: (qa_rows(4) + '{"question": "' + "x" * (64 << 20)
                                                  + '", "answer": "#### 4"}\n').encode(), timeout=180),
        data_case("data-huge-line-no-newline-64MB", lambda: b"{" + b" " * (64 << 20), timeout=180),
        data_case("data-float-1e400", '{"question": "q?", "answer": "#### 1e400"}\n' + qa_rows(4)),
        data_case("data-NaN-literal", '{"question": "q?", "answer": NaN}\n' + qa_rows(4)),
        data_case("data-1M-rows", lambda: qa_rows(1) * 1_000_000, timeout=180),
        data_case("summary-article-8MB", json.dumps({"id": "a", "article": "word " * (2 << 20),
                                                     "highlights": "x."}) + "\n", env="summary", timeout=180),
    ]
    add("limits", *lim)


def encodings(add: Add) -> None:
    """Encodings: arguments, environment, YAML and data that are not UTF-8 or hold lone surrogates."""
    add("encoding",
        Case("arg-name-non-utf8", "", TQA + [b"--name", b"bad\xff\xfename"]),
        Case("arg-name-surrogate-bytes", "", TQA + [b"--name", b"x\xed\xa0\x80y"]),
        Case("arg-dataset-non-utf8-path", "", TQA[:6] + [b"/tmp/no\xffsuch.jsonl"] + TQA[7:]),
        Case("arg-override-non-utf8", "", TQA + [b"extra.note=\xff"], stop_at_run=True),
        Case("arg-model-non-utf8", "", ["train", "--model", b"ti\xffny"] + TQA[3:]),
        Case("arg-config-file-non-utf8-name", "", ["train", "--config-file", b"/tmp/c\xff.yaml", "--model", "tiny"]),
        Case("arg-log-root-non-utf8", "", TQA + [b"--log-root", b"{root}/l\xffogs"]),
        Case("arg-eval-out-non-utf8", "", EVAL + [b"--out", b"/tmp/e\xff.json"]),
        Case("arg-summarize-non-utf8-run", "", ["summarize", b"/tmp/r\xffun"]),
        Case("arg-package-non-utf8-run", "", ["package", b"/tmp/r\xffun"]),
        Case("arg-check-run-non-utf8", "", ["check-run", b"/tmp/r\xffun"]),
        Case("arg-resolve-model-non-utf8", "", ["resolve-model", b"m\xff"]),
        Case("arg-check-logprobs-prompt-non-utf8", "", ["check-logprobs", "--model", "tiny", "--max-tokens", "4",
                                                        "--num-samples", "1", "--prompt", b"What \xff is 2+2?"]),
        Case("arg-blocklist-non-utf8", "", TQA + [b"--blocklist", b"\xff\xfe"], stop_at_run=True),
        Case("env-log-root-non-utf8", "", TQA, env={"RLRUNBOOK_LOG_ROOT": b"{root}/l\xffogs"}),
        Case("env-storage-non-utf8", "", TQA, env={"TINKER_LOCAL_STORAGE": b"{root}/s\xfftore"}),
        Case("env-ascii-stdout-unicode-name", "", TQA + ["--name", "日本語"], env={"PYTHONIOENCODING": "ascii"},
             stop_at_run=True),
        Case("env-lc-all-c-unicode-name", "", TQA + ["--name", "日本語"], env={"LC_ALL": "C", "LANG": "C",
                                                                              "PYTHONUTF8": "0"}, stop_at_run=True),
        Case("yaml-non-utf8", "", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
             setup=lambda c: w(c.work / "cfg.yaml", b"name: caf\xe9\nsteps: 1\n")),
        Case("yaml-lone-surrogate-escape", "", ["train", "--config-file", "{work}/cfg.yaml", "--model", "tiny"],
             setup=lambda c: w(c.work / "cfg.yaml", 'name: "x\\ud800y"\nsteps: 1\nnum_rollouts: 4\n')),
        Case("yaml-utf16-bom", "", ["show-config", "--config-file", "{work}/cfg.yaml"],
             setup=lambda c: w(c.work / "cfg.yaml", "steps: 1\n".encode("utf-16"))),
        data_case("data-non-utf8-row", b'{"question": "caf\xe9?", "answer": "#### 4"}\n' + qa_rows(4).encode()),
        data_case("data-lone-surrogate-escape", '{"question": "x\\ud800y?", "answer": "#### 4"}\n' + qa_rows(4)),
        data_case("data-raw-surrogate-bytes", b'{"question": "x\xed\xa0\x80?", "answer": "#### 4"}\n'
                  + qa_rows(4).encode()),
        data_case("data-utf16", qa_rows(4).encode("utf-16")),
        data_case("data-utf8-bom", b"\xef\xbb\xbf" + qa_rows(4).encode(), stop_at_run=True),
        data_case("data-nul-bytes", b"\x00" * 100 + qa_rows(4).encode()),
        data_case("data-latin1-file", qa_rows(4).replace("What", "Qu\u00e9").encode("latin-1")),
        )


def task_options(add: Add) -> None:
    """Task options and overrides of the wrong type."""
    add("task-options",
        Case("extra-test-size-abc", "", TQA + ["extra.test_size=abc"]),
        Case("extra-test-size-negative", "", TQA + ["extra.test_size=-3"]),
        Case("extra-test-size-zero", "", TQA + ["extra.test_size=0"]),
        Case("extra-test-size-float", "", TQA + ["extra.test_size=2.5"]),
        Case("extra-test-size-list", "", TQA + ["extra.test_size=[1,2]"]),
        Case("extra-format-bonus-abc", "", TQA + ["extra.format_bonus=abc"]),
        Case("extra-format-bonus-nan", "", TQA + ["extra.format_bonus=nan"], stop_at_run=True),
        Case("override-no-equals", "", TQA + ["steps"]),
        Case("override-empty-key", "", TQA + ["=3"]),
        Case("override-unknown-field", "", TQA + ["stepz=3"]),
        Case("override-deep-unknown", "", TQA + ["loss.nope.deeper=1"]),
        Case("override-type-dict", "", TQA + ["loss=3"]),
        Case("override-steps-abc", "", TQA + ["steps=abc"]),
        Case("override-bool-maybe", "", TQA + ["deterministic=maybe"]),
        Case("sweep-no-equals", "", TQA + ["--sweep", "seed"]),
        Case("sweep-empty-values", "", TQA + ["--sweep", "seed="]),
        Case("sweep-unknown-key", "", TQA + ["--sweep", "nope=1,2"]),
        Case("sweep-bad-type", "", TQA + ["--sweep", "steps=a,b"]),
        )


def silent_accepts(add: Add) -> None:
    """Silent accepts: options without effect or nonsense values, which must be refused or warned about."""
    def sa(cid: str, argv: list, words: tuple, **kw) -> Case:
        kw.setdefault("stop_at_run", True)
        return Case(cid, "", argv, expect="refuse_or_warn", warn_words=words, **kw)

    no_proxy = sa("no-proxy-no-effect", TQA + ["--no-proxy"], ("proxy",), note="documented as accepted and ignored")
    add("silent-accept",
        sa("judge-model-single-turn", TQA + ["--judge-model", "tiny"], ("judge",)),
        sa("mock-judge-single-turn", TQA + ["--mock-judge"], ("judge",)),
        sa("mock-judge-with-judge-model", ["train", "--model", "tiny", "--mode", "debate", "--env", "qa", "-n", "4",
                                           "-s", "1", "--max-tokens", "4", "--mock-judge", "--judge-model", "tiny"],
           ("judge",)),
        sa("summary-max-words-in-qa", TQA + ["--summary-max-words", "10"], ("summary",)),
        sa("clip-with-importance-sampling", TQA + ["loss.clip_low_threshold=0.8", "loss.clip_high_threshold=1.2"],
           ("clip",)),
        sa("clip-with-dro", TQA + ["--loss-fn", "dro", "loss.clip_high_threshold=1.2"], ("clip",)),
        sa("kl-estimator-kl-off", TQA + ["--kl-estimator", "k3"], ("kl",)),
        sa("val-samples-val-off", TQA + ["--val-samples", "8"], ("valid", "val-")),
        sa("val-num-problems-val-off", TQA + ["validation.num_problems=3"], ("valid",)),
        sa("truncate-without-max-prompt", TQA + ["--truncate-prompts"], ("truncat", "max-prompt", "max_prompt")),
        sa("reject-blocklisted-no-list", TQA + ["--reject-blocklisted"], ("blocklist",)),
        sa("debate-grpo-reward-rejection", ["train", "--model", "tiny", "--mode", "debate", "-n", "4",
                                                           "-s", "1", "--max-tokens", "4", "--mock-judge",
                                                           "--debate-grpo-reward", "task"], ("grpo", "reward")),
        sa("misspelt-extra-test-size", TQA + ["extra.test_sise=4"], ("test_sise", "unknown", "extra")),
        sa("misspelt-extra-format-bonus", TQA + ["extra.formatbonus=0.5"], ("formatbonus", "unknown", "extra")),
        sa("unknown-extra-summary", ["train", "--config-file", "tiny-cpu-smoke", "steps=1", "extra.foo=1"],
           ("foo", "unknown", "extra")),
        sa("summary-max-words-0", T + ["--summary-max-words", "0"], ("summary",)),
        sa("summary-max-words-negative", T + ["--summary-max-words", "-5"], ("summary",)),
        sa("lr-1e12", TQA + ["--learning-rate", "1e12"], ("learning",)),
        sa("lr-zero", TQA + ["--learning-rate", "0"], ("learning",)),
        sa("seed-negative", TQA + ["--seed=-1"], ("seed",)),
        sa("lora-rank-negative", TQA + ["--lora-rank=-4"], ("rank",)),
        sa("max-tokens-negative", TQA[:-2] + ["--max-tokens=-4"], ("token",)),
        sa("checkpoint-every-negative", TQA + ["--checkpoint-every=-1"], ("checkpoint",)),
        sa("val-every-negative", TQA + ["--val-every=-1"], ("valid", "val")),
        sa("val-samples-negative", TQA + ["--val-every", "1", "--val-samples=-2"], ("valid", "sample")),
        sa("grad-clip-negative", TQA + ["--grad-clip-norm=-1"], ("clip",)),
        sa("kl-coef-negative", TQA + ["--kl-coef=-0.5"], ("kl",)),
        sa("entropy-coef-1e6", TQA + ["--entropy-coef", "1e6"], ("entropy",)),
        sa("temperature-1e6", TQA + ["--temperature", "1e6"], ("temperature",)),
        sa("steps-true-override", TQA[:-4] + ["--max-tokens", "8", "steps=true"], ("steps",)),
        sa("sweep-repeat-key", TQA + ["--sweep", "seed=1,2", "--sweep", "seed=3"], ("sweep", "seed"),
           stop_at_run=False, timeout=240),
        sa("sweep-repeat-point", TQA + ["--sweep", "seed=1,1"], ("sweep", "repeat", "duplicate"),
           stop_at_run=False, timeout=240),
        sa("sweep-show-config-repeat-point", ["show-config", "--model", "tiny", "--sweep", "seed=2,2"],
           ("sweep", "repeat", "duplicate"), stop_at_run=False),
        sa("name-newline", TQA + ["--name", "a\nb"], ("name",)),
        sa("name-carriage-return", TQA + ["--name", "a\rb"], ("name",)),
        sa("name-slash", TQA + ["--name", "../../escape"], ("name",)),
        sa("name-tab-escape", TQA + ["--name", "x\x1b[2Jy"], ("name",)),
        sa("name-empty", TQA + ["--name", ""], ("name",)),
        sa("name-300-chars", TQA + ["--name", "n" * 300], ("name",)),
        sa("package-non-run-dir", ["package", "{work}/notarun", "--out", "{work}/x.tar.gz"], ("run",),
           setup=lambda c: w(c.work / "notarun/hello.txt", "hi\n"), stop_at_run=False),
        sa("package-empty-dir", ["package", "{work}/empty", "--out", "{work}/x.tar.gz"], ("run",),
           setup=lambda c: (c.work / "empty").mkdir(), stop_at_run=False),
        sa("data-references-all-empty", ["train", "--model", "tiny", "--env", "math", "--dataset",
                                         "{work}/data.jsonl", "-n", "4", "-s", "1", "--max-tokens", "8"],
           ("empty", "reference", "answer"), stop_at_run=False, timeout=240,
           setup=lambda c: w(c.work / "data.jsonl", "".join(json.dumps({"question": f"q{i}?", "answer": ""}) + "\n"
                                                           for i in range(8)))),
        sa("data-summary-highlights-empty", ["train", "--config-file", "tiny-cpu-smoke", "steps=1", "--dataset",
                                             "{work}/data.jsonl"], ("empty", "highlight", "reference"),
           stop_at_run=False, timeout=240,
           setup=lambda c: w(c.work / "data.jsonl", "".join(json.dumps(
               {"id": str(i), "article": "The council met today. " * 20, "highlights": ""}) + "\n" for i in range(8)))),
        no_proxy,
        sa("eval-ks-above-samples", EVAL[:-2] + ["--ks", "16", "--resamples", "50"], ("k",), stop_at_run=False),
        sa("eval-threshold-above-max-reward", EVAL + ["--threshold", "5"], ("threshold",), stop_at_run=False),
        sa("num-groups-rs-grpo-no-reward", ["train", "--model", "tiny", "--mode", "debate", "-n", "4", "-s", "1",
                                            "--max-tokens", "4", "--mock-judge", "--blocklist", "x",
                                            "--judge-model", "tiny"], ("judge",)),
        )
    # the documented no-op option is a control: accepted with or without a warning (listed among these)
    no_proxy.expect, no_proxy.cls = "accept", "controls"


def misleading(add: Add) -> None:
    """Misleading messages: a refusal must name the real cause."""
    add("misleading",
        data_case("data-u2028-in-string", qa_rows(3) + '{"question": "a\u2028b 2+2?", "answer": "#### 4"}\n',
                  expect="accept", bad_msg=r"not valid JSON", stop_at_run=True),
        data_case("data-u0085-in-string", qa_rows(3) + '{"question": "a\u0085b 2+2?", "answer": "#### 4"}\n',
                  expect="accept", bad_msg=r"not valid JSON", stop_at_run=True),
        data_case("data-u2029-in-string", qa_rows(3) + '{"question": "a\u2029b 2+2?", "answer": "#### 4"}\n',
                  expect="accept", bad_msg=r"not valid JSON", stop_at_run=True),
        data_case("data-crlf-lines", qa_rows(4).replace("\n", "\r\n").replace("\\n", "\\n"), expect="accept",
                  bad_msg=r"not valid JSON", stop_at_run=True),
        Case("lr-minus-1", "", TQA + ["--learning-rate", "-1"], bad_msg=r"expected one argument"),
        Case("seed-minus-1-space", "", TQA + ["--seed", "-1"], bad_msg=r"expected one argument"),
        Case("kl-coef-minus-space", "", TQA + ["--kl-coef", "-0.1"], bad_msg=r"expected one argument"),
        Case("dtype-bf16-alias", "", TQA, env={"TINKER_LOCAL_DTYPE": "bf16"}, bad_msg=r"no update happened"),
        Case("dtype-garbage", "", TQA, env={"TINKER_LOCAL_DTYPE": "float7"}, bad_msg=r"no update happened"),
        Case("device-cuda-on-cpu", "", TQA, env={"TINKER_LOCAL_DEVICE": "cuda"}, bad_msg=r"data ?set|connection"),
        Case("gpu-preset-on-cpu", "", ["train", "--config-file", "h100-rlvr", "steps=1"],
             bad_msg=r"data ?set.*(connect|network)|ConnectionError|could not reach|hub", timeout=120),
        Case("gpu-preset-8b-on-cpu", "", ["train", "--config-file", "gpu-8b-lora-4bit", "steps=1"],
             bad_msg=r"data ?set.*(connect|network)|ConnectionError", timeout=120),
        Case("model-hub-id-offline", "", ["train", "--model", "Qwen/Qwen3-0.6B"] + TQA[3:],
             bad_msg=r"data ?set.*connect", timeout=120),
        Case("sampler-unknown", "", TQA, env={"TINKER_LOCAL_SAMPLER": "nope"}),
        Case("numerics-unknown", "", TQA, env={"TINKER_LOCAL_NUMERICS": "fast"}),
        Case("micro-batch-tokens-abc", "", TQA, env={"TINKER_LOCAL_MICRO_BATCH_TOKENS": "abc"}),
        Case("micro-batch-tokens-zero", "", TQA, env={"TINKER_LOCAL_MICRO_BATCH_TOKENS": "0"}),
        Case("grad-accum-negative", "", TQA, env={"TINKER_LOCAL_GRAD_ACCUM_STEPS": "-2"}),
        Case("env-seed-abc", "", TQA, env={"TINKER_LOCAL_SEED": "abc"}),
        Case("lora-alpha-abc", "", TQA, env={"TINKER_LOCAL_LORA_ALPHA": "abc"}),
        Case("unknown-mode", "", TQA + ["--mode", "multi_turn"]),
        Case("unknown-env", "", TQA + ["--env", "code"]),
        Case("unknown-loss", "", TQA + ["--loss-fn", "grpo"]),
        Case("unknown-reward-fn", "", TQA + ["--reward-fn", "rouge"]),
        Case("unknown-preset", "", ["train", "--config-file", "tiny-cpu-smok"]),
        Case("num-groups-not-dividing", "", TQA + ["--num-groups", "3"]),
        Case("expected-hash-wrong", "", TQA + ["--expected-dataset-hash", "00"]),
        Case("show-config-device-memory-garbage", "", ["show-config", "--device-memory", "lots"]),
        Case("show-config-device-memory-huge", "", ["show-config", "--model", "tiny", "--device-memory",
                                                    "1" + "0" * 40 + "GiB"]),
        Case("bench-history-missing-storage", "", ["bench-history", "--storage", "{root}/nope"]),
        Case("bench-history-storage-is-file", "", ["bench-history", "--storage", "{root}/f"],
             setup=lambda c: w(c.root / "f", "x")),
        )
