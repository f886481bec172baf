"""scripts/gpu_report.py on hand-made result folders: what a part's section says is what its files say.

Every outcome is shown, failures first among equals: a failed or errored test or benchmark has its row, a skip of an
optional part of the gpu tier is counted as "not proven", a step's exit status is never read as success.
"""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
NOW = datetime.datetime(2026, 11, 25, 9, 30, tzinfo=datetime.timezone.utc)


def _report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPO_ROOT / "scripts" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(name: str, inner: str = "") -> str:
    return f'<testcase classname="tests.gpu" name="{name}">{inner}</testcase>'


def test_the_tier_counts_optional_parts_as_not_proven_and_other_skips_as_skips(tmp_path):
    cases = [
        _case("test_fp32_parity[tiny-T1-hf]"),
        _case("test_fp32_parity[tiny-T1-vllm]", '<skipped type="pytest.skip" message="not proven: optional part '
              'vllm, the vLLM sampler&apos;s parity cases: no server"/>'),
        _case("test_a_4bit_step[tiny]", '<skipped type="pytest.skip" message="not proven: optional part '
              'bitsandbytes, 4-bit base weights: bitsandbytes is not installed"/>'),
        _case("test_odd[tiny]", '<skipped type="pytest.skip" message="could not import &apos;flash_attn&apos;"/>'),
        _case("test_bf16_parity[smollm2-135m-T1-invariant]", '<failure message="assert 0.196 == 0.0"/>'),
        _case("test_stop[tiny]", '<error message="fixture &apos;host&apos; failed"/>'),
    ]
    (tmp_path / "gpu-tier.xml").write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    lines = _report()._tier(tmp_path)
    assert lines[0] == "gpu tier: 1 passed, 1 failed, 1 error, 2 not proven, 1 skipped"
    assert lines[1] == "not proven (optional parts missing on this machine): bitsandbytes, vllm"
    assert "| test_fp32_parity[tiny-T1-vllm] | not proven (vllm) |  |  |  |" in lines
    assert "| test_odd[tiny] | skipped |  |  |  |" in lines
    assert "| test_bf16_parity[smollm2-135m-T1-invariant] | failed |  |  |  |" in lines
    assert "| test_stop[tiny] | error |  |  |  |" in lines


def test_failed_and_errored_benchmarks_keep_their_rows(tmp_path):
    """A failed benchmark has no median in pytest-benchmark's JSON (or none at all): its row comes from the XML."""
    measured = {"benchmarks": [
        {"name": "test_decode_ms_per_step[16x64x32]", "stats": {"median": 1.133}, "extra_info": {"hf_ms_per_step": 11.66}},
        {"name": "test_bench_optim_step[tiny]", "stats": {"median": 0.0034}, "extra_info": {}}]}
    (tmp_path / "bench-gpu.json").write_text(__import__("json").dumps(measured))
    cases = [_case("test_decode_ms_per_step[16x64x32]", '<failure message="AssertionError: decode 11.7 ms/step at 16 x '
                   '64 on cuda misses the target of 2 ms/step&#10;second line"/>'),
             _case("test_rl_step[smollm2-135m-debate_rejection]", '<failure message="RunRefused: mismatch 0.0339"/>'),
             _case("test_bench_concurrent_single_sample_requests[smollm2-135m]", '<error message="CUDA OOM"/>'),
             _case("test_bench_optim_step[tiny]"),
             _case("test_rl_step_against_trl", '<skipped message="needs TRL for the peer benchmark: trl not installed"/>')]
    (tmp_path / "bench.xml").write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    lines = _report()._bench(tmp_path)
    assert lines[0] == "benchmarks: 1 passed, 2 failed, 1 error, 1 skipped"
    assert ("| test_decode_ms_per_step[16x64x32] | FAILED: AssertionError: decode 11.7 ms/step at 16 x 64 on cuda misses "
            "the target of 2 ms/step | 1.133 s | hf_ms_per_step 11.66 |") in lines
    assert "| test_rl_step[smollm2-135m-debate_rejection] | FAILED: RunRefused: mismatch 0.0339 | - |  |" in lines
    assert "| test_bench_concurrent_single_sample_requests[smollm2-135m] | ERROR: CUDA OOM | - |  |" in lines
    assert "| test_bench_optim_step[tiny] | passed | 0.0034 s |  |" in lines
    assert any(line.startswith("| test_rl_step_against_trl | SKIPPED: needs TRL") for line in lines)


def test_a_debate_that_exited_2_is_not_reported_as_rubric_failures_0(tmp_path):
    (tmp_path / "steps.tsv").write_text("mini-debate\t2\t80\tgated\n")
    (tmp_path / "mini-debate.log").write_text("step 3 ...\nerror: step 4 refused: mismatch/abs_logprob_diff 0.0348 "
                                              "nats/token > mismatch.max 0.03\n")
    run = tmp_path / "logs" / "20261128_debate_summary_mini"
    run.mkdir(parents=True)
    row = {"time/step_s": 11.5, "time/sample_s": 9.9, "mismatch/abs_logprob_diff": 0.0265}
    (run / "train_log.jsonl").write_text("".join(__import__("json").dumps(row) + "\n" for _ in range(4)))
    (line,) = _report()._debate(tmp_path)
    assert ("exit 2 (error: step 4 refused: mismatch/abs_logprob_diff 0.0348 nats/token > mismatch.max 0.03); "
            "4 steps") in line
    assert line.endswith("rubric not run (the run ended before it)") and "rubric failures" not in line
    (tmp_path / "steps.tsv").write_text("mini-debate\t1\t80\tgated\n")
    (tmp_path / "mini-debate.log").write_text("PASS finite_losses: ok\nFAIL reward_moves: flat\nPASS steps: 10\n")
    (line,) = _report()._debate(tmp_path)
    assert "exit 1;" in line and line.endswith("rubric failures 1 of 3 checks")


def test_a_section_carries_the_card_memory_and_a_summary_that_merge_tabulates_leaving_sections_as_written(
        tmp_path, monkeypatch):
    report = _report()
    monkeypatch.setattr(report, "_machine", lambda: ["- device: a test card"])
    tier, debate = tmp_path / "tier", tmp_path / "debate"
    for work in (tier, debate):
        work.mkdir()
    (tier / "steps.tsv").write_text("gpu-tier\t1\t241\tgated\n")
    (tier / "gpu-tier.xml").write_text("<testsuites><testsuite>" + _case("test_a[tiny]") + _case(
        "test_b[tiny]", '<failure message="no"/>') + _case("test_c[tiny]", '<skipped message="not proven: optional '
                                                             'part vllm, the vLLM sampler: no server"/>')
        + "</testsuite></testsuites>")
    (tier / "card-memory.csv").write_text("1200, 143771\n80600, 143771\n40000, 143771\nnot a reading\n")
    (debate / "steps.tsv").write_text("mini-debate\t2\t80\tgated\n")
    (debate / "mini-debate.log").write_text("error: refused\n")
    returned = tmp_path / "returned"
    returned.mkdir()
    texts = {}
    for part, work, status in (("tier", tier, 1), ("debate", debate, 1)):
        texts[part] = report.section(part, work, status=status, planned=6, seconds=241, dry_run=False, now=NOW)
        (returned / f"{part}.md").write_text(texts[part] + "\n")
    assert ("- card memory in use (nvidia-smi, every process on the card): at most 80,600 of 143,771 MiB over 3 "
            "readings") in texts["tier"]
    assert "- card memory in use: not recorded (no nvidia-smi readings)" in texts["debate"]
    doc = tmp_path / "record.md"
    doc.write_text("# record\n")
    assert report.merge(doc, [returned]) == ["tier", "debate"]
    merged = doc.read_text()
    for text in texts.values():
        assert text.strip() in merged  # each section exactly as the part wrote it
    assert ("| tier | 2026-11-25T09:30Z | SOME GATED CHECKS FAILED | steps: 1 exit 1; gpu tier: 1 passed, 1 failed, "
            "1 not proven | at most 80,600 of 143,771 MiB |") in merged
    assert ("| debate | 2026-11-25T09:30Z | SOME GATED CHECKS FAILED | steps: 1 exit 2; mini debate: exit 2 "
            "(error: refused), rubric not run (the run ended before it) | not recorded |") in merged
    assert merged.index("| part | ran (UTC) |") < merged.index("<!-- gpu-check part=tier")


def test_the_scale_section_marks_a_peak_above_its_plan(tmp_path):
    gib = 1 << 30
    figures = {"device": "cuda", "gpu": "a card", "dtype": "bfloat16", "planned_sampling_peak": 28 * gib,
               "planned_training_peak": 71 * gib, "sample_s": 1.0, "prefill_s": 0.1, "decode_steps": 3,
               "sampling_peak_bytes": 32 * gib, "plan_failures": ["sampling peak 32.00 GiB measured is above ..."],
               "plan_judged": ["sampling"]}
    (tmp_path / "scale.json").write_text(__import__("json").dumps(figures))
    assert _report()._scale(tmp_path)[1].endswith("peak 32.0 GiB measured, 28.0 GiB planned: ABOVE THE PLAN")
    assert _report()._found("scale", tmp_path).endswith("; peak above the plan: sampling")
