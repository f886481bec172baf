"""Rubric checks of ``training_step_<k>.json``: datums, advantages, mask, loss, trained tokens.

Datum-level checks look only at steps whose ``training_data`` is a non-empty list; missing or
corrupt step files are reported once, by ``training_steps_present``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlrunbook.run.checks import CheckResult, is_int, is_number, result
from rlrunbook.run.load import RunFiles
from rlrunbook.run.schema import COMPLETION_ARRAYS, LOSS_EPSILON, LOSS_METRIC


def training_steps_present(run: RunFiles) -> CheckResult:
    problems = list(run.step_problems)
    if run.steps is None:
        problems.append(f"cannot tell which steps to expect: {run.steps_problem}")
    datums = 0
    for step, doc in sorted(run.step_docs.items()):
        name = f"training_step_{step}.json"
        if doc.get("step") != step:
            problems.append(f"{name}: step field is {doc.get('step')!r}")
        data = doc.get("training_data")
        marked = doc.get("skipped") is True
        if marked != (step in run.skipped_steps):  # dynamic sampling marks a skipped step in both files
            problems.append(f"{name} and its train_log.jsonl row disagree on whether the step was skipped")
        elif marked:
            continue  # skipped by dynamic sampling: no datum by design
        if not isinstance(data, list) or not data:
            problems.append(f"{name}: training_data is not a non-empty list (no accepted datum)")
        else:
            datums += len(data)
    skipped = sorted(k for k in run.skipped_steps if k in run.step_docs)
    if run.step_docs and len(skipped) == len(run.step_docs):
        problems.append(f"every step was skipped by dynamic sampling ({skipped}): nothing was trained")
    note = f" ({len(skipped)} skipped for lack of reward spread: {skipped})" if skipped else ""
    return result("training_steps.present", problems, f"{len(run.step_docs)} step files, {datums} datums{note}")


def step_datums(run: RunFiles) -> Iterator[tuple[str, list[Any]]]:
    """``(file name, training_data)`` of every loaded step whose training_data is a non-empty list."""
    for step, doc in sorted(run.step_docs.items()):
        data = doc.get("training_data")
        if isinstance(data, list) and data:
            yield f"training_step_{step}.json", data


def _datum_problems(datum: Any) -> list[str]:
    if not isinstance(datum, dict):
        return [f"is {type(datum).__name__}, not an object"]
    problems = []
    prompt = datum.get("prompt_tokens")
    if not isinstance(prompt, list) or not prompt or not all(is_int(t) for t in prompt):
        problems.append("prompt_tokens is not a non-empty list of ints")
    arrays = {name: datum.get(name) for name in COMPLETION_ARRAYS}
    not_lists = [name for name, value in arrays.items() if not isinstance(value, list)]
    if not_lists:
        return [*problems, f"{not_lists} missing or not lists"]
    if not arrays["completion_tokens"] or not all(is_int(t) for t in arrays["completion_tokens"]):
        problems.append("completion_tokens is not a non-empty list of ints")
    for name in ("completion_logprobs", "completion_advantages"):
        if not all(is_number(x) for x in arrays[name]):
            problems.append(f"{name} holds a non-number or non-finite value")
    if not all(m in (0, 1) for m in arrays["completion_mask"]):
        problems.append("completion_mask holds values other than 0/1")
    lengths = {name: len(value) for name, value in arrays.items()}
    if len(set(lengths.values())) > 1:
        problems.append("unequal lengths " + ", ".join(f"{k}={v}" for k, v in lengths.items()))
    meta = datum.get("metadata")
    if not isinstance(meta, dict) or not is_number(meta.get("reward")):
        problems.append("metadata.reward is missing or not a finite number")
    return problems


def datum_shapes(run: RunFiles) -> CheckResult:
    problems, count = [], 0
    for name, data in step_datums(run):
        for i, datum in enumerate(data):
            count += 1
            problems += [f"{name} datum {i}: {p}" for p in _datum_problems(datum)]
    if not count:
        problems.append("no datums to check (no readable training_step_<k>.json with training_data)")
    return result("datums.shapes", problems, f"{count} datums well-formed, completion arrays of equal length")


def _floats(datum: Any, key: str) -> list[Any]:
    value = datum.get(key) if isinstance(datum, dict) else None
    return value if isinstance(value, list) else []


def nonzero_advantages(run: RunFiles) -> CheckResult:
    problems, counts = [], []
    for name, data in step_datums(run):
        advantages = [a for d in data for a in _floats(d, "completion_advantages")]
        nonzero = sum(1 for a in advantages if is_number(a) and a != 0)
        counts.append(nonzero)
        if not nonzero:
            problems.append(f"{name}: all {len(advantages)} advantages are 0 (no learning signal)")
    if not counts:
        problems.append("no training step with datums to check")
    return result(
        "datums.nonzero_advantages",
        problems,
        f"non-zero advantages in each of {len(counts)} readable steps (fewest {min(counts, default=0)})",
    )


def mask_advantages(run: RunFiles) -> CheckResult:
    """Tokens with mask 0 (the opponent's or the judge's, injected in debates) must carry advantage 0."""
    problems, masked, checked = [], 0, 0
    for name, data in step_datums(run):
        for i, datum in enumerate(data):
            mask, adv = _floats(datum, "completion_mask"), _floats(datum, "completion_advantages")
            if len(mask) != len(adv):
                continue  # reported by datums.shapes
            checked += 1
            leaks = [
                j
                for j, (m, a) in enumerate(zip(mask, adv, strict=True))
                if m == 0 and is_number(a) and a != 0
            ]
            masked += sum(1 for m in mask if m == 0)
            if leaks:
                problems.append(
                    f"{name} datum {i}: {len(leaks)} mask-0 tokens have non-zero advantage "
                    f"(first at token {leaks[0]}: {adv[leaks[0]]})"
                )
    if not checked:
        problems.append("no datum with comparable completion_mask and completion_advantages")
    return result("datums.mask_advantages", problems, f"{masked} mask-0 tokens, all with advantage 0")


GRAD_NORM_METRIC = "grad_norm:mean"  # what the optimizer step reports (results.optim_metrics)


def _loss(doc: dict[str, Any]) -> Any:
    results = doc.get("results")
    metrics = results.get("metrics") if isinstance(results, dict) else None
    return metrics.get(LOSS_METRIC) if isinstance(metrics, dict) else None


def _trained(run: RunFiles) -> dict[int, dict[str, Any]]:
    """The step documents of steps that trained (all but those dynamic sampling skipped)."""
    return {k: doc for k, doc in run.step_docs.items()
            if not (doc.get("skipped") is True and k in run.skipped_steps)}


def loss_present(run: RunFiles) -> CheckResult:
    problems = [
        f"training_step_{k}.json: results.metrics[{LOSS_METRIC!r}] is {_loss(doc)!r}, not a finite number"
        for k, doc in sorted(_trained(run).items())
        if not is_number(_loss(doc))
    ]
    if not _trained(run):
        problems.append("no readable training_step_<k>.json of a trained step")
    return result("loss.present", problems, f"{LOSS_METRIC} in each of {len(_trained(run))} trained steps")


def _grad_norm(doc: dict[str, Any]) -> Any:
    results = doc.get("results")
    optim = results.get("optim_metrics") if isinstance(results, dict) else None
    return optim.get(GRAD_NORM_METRIC) if isinstance(optim, dict) else None


def loss_nonzero(run: RunFiles) -> CheckResult:
    """Not 0 in every step; or, where it is, a gradient norm > 0 recorded by the optimizer step shows the update.

    A policy-gradient loss on fresh samples sums to 0 up to rounding (ratio 1, advantages centred per group):
    in float32 the rounding usually leaves ~1e-7, in bfloat16 often exactly 0, and the update is real then.
    """
    trained = _trained(run)
    losses = {k: _loss(doc) for k, doc in sorted(trained.items()) if is_number(_loss(doc))}
    problems = []
    if not losses:
        problems.append(f"no step has a numeric results.metrics[{LOSS_METRIC!r}]")
    elif all(abs(v) <= LOSS_EPSILON for v in losses.values()):
        moved = [k for k, doc in sorted(trained.items()) if is_number(_grad_norm(doc)) and _grad_norm(doc) > 0]
        if moved:
            return result("loss.nonzero", [], f"{LOSS_METRIC} is 0 in every step (on-policy: ratio 1, centred "
                                              f"advantages) but {GRAD_NORM_METRIC} > 0 in steps {moved}: updated")
        problems.append(f"{LOSS_METRIC} is 0 in every step {sorted(losses)} and no step records "
                        f"results.optim_metrics[{GRAD_NORM_METRIC!r}] > 0: no update happened")
    largest = max((abs(v) for v in losses.values()), default=0.0)
    return result("loss.nonzero", problems, f"max |{LOSS_METRIC}| = {largest:.4g}")


def trained_tokens(run: RunFiles) -> CheckResult:
    trained = _trained(run)
    problems = [
        f"training_step_{k}.json: num_trained_tokens is {doc.get('num_trained_tokens')!r}, not > 0"
        for k, doc in sorted(trained.items())
        if not (is_int(doc.get("num_trained_tokens")) and doc["num_trained_tokens"] > 0)
    ]
    if not trained:
        problems.append("no readable training_step_<k>.json of a trained step")
    return result(
        "trained_tokens.positive",
        problems,
        f"num_trained_tokens > 0 in each of {len(trained)} trained steps",
    )
