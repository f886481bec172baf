#!/usr/bin/env python3
"""Steps per hour of synchronous (K = 0) and asynchronous (K = 1, 2) training, side by side, with a timeline.

Each workload (``single``: single-turn GRPO on the built-in qa set; ``debate``: the main job's shape, the
mini debate RS→GRPO on CNN/DailyMail summaries with the mock judge) runs ``rlrunbook train --off-policy K``
for every K, alternating (K = 0, 1, 2, 0, 1, 2, ...), so that drift of a shared machine hits every K alike.
Steps per hour come from the steps after the first (which pays for loading and warm-up): 3600 / median
``time/step_s``. Every run records the backend's calls (``TINKER_LOCAL_TIMELINE``); the last repeat's
timelines are drawn, two steps each, one panel per K, into ``timeline_<workload>.png`` (what ran when, on
the training worker and on the sampling worker).

Usage::

    python scripts/async_bench.py --out /tmp/async-bench                       # in-process sampler, tiny
    python scripts/async_bench.py --model smollm2-135m --workloads single --steps 5
    python scripts/async_bench.py --sampler vllm --model tiny-vllm          # a managed vLLM server per run

Writes ``results.json`` and ``results.md`` (a table per workload: median seconds per step, steps per hour,
ratio to K = 0, mean wait of the trainer for its batch) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKLOADS = {
    "single": ["--env", "qa", "--dataset", "test", "-n", "16", "--num-groups", "2", "--max-tokens", "32"],
    "debate": ["--mode", "debate", "--env", "summary", "--dataset", "cnn_dailymail", "--reward-fn", "compression",
               "-n", "16", "--num-groups", "2", "--max-tokens", "32", "--mock-judge", "--debate-train", "rs_grpo",
               "--debate-grpo-reward", "task"],
}
# Training calls and sampling calls, as the timeline names them (rlrunbook.backend.timeline.call_name).
TRAINING_CALLS = ("forward_backward", "optim_step")


def run_one(args: argparse.Namespace, workload: str, k: int, repeat: int, out: Path) -> dict:
    name = f"{workload}-k{k}-r{repeat}"
    timeline = out / "timelines" / f"{name}.jsonl"
    timeline.unlink(missing_ok=True)
    env = dict(os.environ, TINKER_LOCAL_TIMELINE=str(timeline), TINKER_LOCAL_DEVICE=args.device)
    if args.sampler == "vllm":  # each run starts its own server unless --vllm-url names one
        env.update(TINKER_LOCAL_SAMPLER="vllm", **({"TINKER_LOCAL_VLLM_URL": args.vllm_url} if args.vllm_url else {}))
    argv = [sys.executable, "-m", "rlrunbook", "train", "--model", args.model, *WORKLOADS[workload],
            "-s", str(args.steps), "--off-policy", str(k), "--seed", "0", "--name", name,
            "--log-root", str(out / "runs"), "--no-proxy"]
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: the run finished but failed its rubric (short runs may)
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    runs = sorted((out / "runs").glob(f"*_{name}"))
    rows = [json.loads(line) for line in (runs[-1] / "train_log.jsonl").read_text().splitlines()]
    steps = [row["time/step_s"] for row in rows]
    return {"workload": workload, "k": k, "repeat": repeat, "wall_s": round(wall, 2), "step_s": steps,
            "wait_s": [row.get("async/wait_s", 0.0) for row in rows],
            "sample_s": [row.get("async/sample_s") for row in rows], "timeline": str(timeline),
            "run": str(runs[-1])}


def summarize(results: list[dict], ks: list[int]) -> dict:
    table = {}
    for workload in dict.fromkeys(r["workload"] for r in results):
        rows = {}
        for k in ks:
            steady = [s for r in results if r["workload"] == workload and r["k"] == k for s in r["step_s"][1:]]
            waits = [w for r in results if r["workload"] == workload and r["k"] == k for w in r["wait_s"][1:]]
            median = statistics.median(steady)
            rows[k] = {"median_step_s": round(median, 3), "steps_per_hour": round(3600 / median),
                       "mean_wait_s": round(statistics.fmean(waits), 3), "steps_measured": len(steady)}
        for k in ks:
            rows[k]["ratio_to_k0"] = round(rows[k]["median_step_s"] / rows[ks[0]]["median_step_s"], 3)
        table[workload] = rows
    return table


def markdown(table: dict, args: argparse.Namespace) -> str:
    lines = [f"model `{args.model}`, sampler `{args.sampler}`, device `{args.device}`, {args.steps} steps a run "
             f"(the first left out), {args.repeats} repeats, K alternating", ""]
    for workload, rows in table.items():
        lines += [f"**{workload}**", "", "| K | median s/step | steps/hour | ratio to K=0 | trainer's mean wait (s) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {k} | {r['median_step_s']} | {r['steps_per_hour']} | {r['ratio_to_k0']} | {r['mean_wait_s']} |"
                  for k, r in rows.items()]
        lines.append("")
    return "\n".join(lines)


def draw(results: list[dict], workload: str, path: Path) -> None:
    """Two steps of the last repeat's timeline for each K: one row per worker, a bar per call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlrunbook.backend.timeline import read_timeline

    last = max(r["repeat"] for r in results)
    chosen = [r for r in results if r["workload"] == workload and r["repeat"] == last]
    fig, axes = plt.subplots(len(chosen), 1, figsize=(11, 1.6 * len(chosen) + 0.6), squeeze=False)
    colors = {"train": "tab:blue", "sample": "tab:orange", "gate": "tab:green", "other": "tab:gray"}
    for ax, result in zip(axes[:, 0], chosen, strict=True):
        records = read_timeline(Path(result["timeline"]))
        ends = [r["end"] for r in records if "optim_step" in r["call"]]
        if len(ends) >= 4:  # from the end of step 2's optimizer step to the end of step 4's: two steady steps
            lo, hi = ends[1], ends[3]
        else:
            lo, hi = records[0]["start"], records[-1]["end"]
        for r in records:
            if r["end"] < lo or r["start"] > hi:
                continue
            kind = ("train" if any(c in r["call"] for c in TRAINING_CALLS)
                    else "sample" if r["call"].endswith("_sample_batch")
                    else "gate" if r["call"].endswith("forward_on_sampler_weights") else "other")
            y = 1 if r["worker"] == "rlrunbook-sampler" else 0
            ax.barh(y, r["end"] - r["start"], left=r["start"] - lo, color=colors[kind], height=0.6)
        ax.set_yticks([0, 1], ["training worker", "sampling worker"])
        ax.set_xlim(0, hi - lo)
        ax.set_title(f"{workload}, K = {result['k']}: two steps, {hi - lo:.2f} s", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["forward_backward / optim_step", "sampling", "mismatch gate's forward at the "
                         "sampling weights", "other calls"], loc="upper right",
               fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("async-bench"))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sampler", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--vllm-url", default=None, help="an external vLLM server serving --model (with --sampler "
                        "vllm; default: each run starts its own, see docs/vllm.md)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", default="single,debate")
    parser.add_argument("--ks", default="0,1,2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    workloads = [w for w in args.workloads.split(",") if w]
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for repeat in range(args.repeats):
        for workload in workloads:
            for k in ks:
                result = run_one(args, workload, k, repeat, args.out)
                results.append(result)
                print(f"[async-bench] {workload} K={k} repeat {repeat}: wall {result['wall_s']} s, step_s "
                      f"{[round(s, 2) for s in result['step_s']]}", flush=True)
    table = summarize(results, ks)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "table": table, "runs": results}, indent=1))
    text = markdown(table, args)
    (args.out / "results.md").write_text(text)
    for workload in workloads:
        draw(results, workload, args.out / f"timeline_{workload}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
