"""The benchmarks' gates: each benchmark asserts its target or its regression gate on the device it runs on.

Pure functions of the measured figures (and, for a regression, the stored baseline): each returns the list of
failures, one line each naming the figure, the limit and where the limit comes from; an empty list passes. A gate
that has nothing to compare with (no baseline stored for this device) fails too, saying how to store one, so a
benchmark never passes by having no gate.

- decode (``test_bench_decode.py``): the in-process engine's step beats transformers' ``generate`` on every device
  (the claim the benchmark measures side by side); on CUDA also the targets of docs/performance.md (2 ms per step
  at 16 rows x 64 tokens, 3 ms at 64 x 256).
- peer (``test_bench_peer.py``): on CUDA the target, rlrunbook's step <= 0.25x TRL's; on every device the ratio
  within 15% of the one stored for the device and model, where one is stored (required where no target is).
- RL step (``test_bench_rl_step.py``): seconds per step within 2.5x of the stored figure for the device, model and
  shape (absolute times swing up to 2x between runs on shared cores: the gate catches what noise cannot make).
- custom loss (``test_bench_custom_loss.py``): a custom loss that computes ``cross_entropy`` takes at most 1.15x
  its time (the docs' claim: the same time).
- decode attention (``test_bench_decode_attention.py``, CPU): the time of a step grows with the positions read, no
  window costing more than 3x its share of the positions (a cache-aliasing cliff made 512 positions cost 5.7x 448;
  a head's transposed keys and its values outgrowing the core's L2 cache, as at 1,024 positions of SmolLM2's heads,
  cost 1.7-2.4x the median window's time per position, since the windows that fit became 1.8x faster), and reading
  a shared prefix once per group is never slower than once per row.
- training attention (``test_bench_training_attention.py``, CPU): attention forward and backward at the mini debate's
  training shape each reach at least 0.35x the FLOP rate of the fixed-order product in the same run (0.7-0.8x
  measured; the kernels that summed through one accumulator at a time reached 0.2-0.25x).
"""

from __future__ import annotations

from collections.abc import Mapping

DECODE_TARGETS_MS: dict[tuple[int, int], float] = {(16, 64): 2.0, (64, 256): 3.0}  # on CUDA, (rows, new tokens)
PEER_TARGETS: dict[str, float] = {"cuda": 0.25}  # rlrunbook / TRL step time, per device kind
PEER_REGRESSION = 1.15
RL_STEP_REGRESSION = 2.5
CUSTOM_LOSS_MAX_RATIO = 1.15
ATTENTION_PRODUCT_FRACTION_MIN = 0.35  # attention's GFLOP/s over the fixed-order product's, same machine and run
WINDOW_COST_MAX = 3.0  # ms per position of any window over the median of all windows' ms per position
UPDATE_ENV = "RLRUNBOOK_UPDATE_BENCH_BASELINE"


def device_kind(device: str) -> str:
    """``cuda:1`` -> ``cuda``: targets are per kind of device."""
    return device.split(":")[0]


CPU_VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}
# AMD's x86 family 25 (19h) holds two generations; these model ranges are Zen 4 (Genoa, Raphael, Phoenix, ...).
ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def cpu_generation(vendor: str, family: int, model: int) -> str:
    """A CPU's generation as baselines name it: ``amd-zen5`` (family 26), ``amd-zen4`` or ``amd-zen3`` (family 25),
    else the numbers themselves, ``<vendor>-family<F>-model<M>``. Generations of one vendor differ by more than a
    gate's tolerance: the same commit's peer step was 0.34x TRL's on a 2-core Zen 5 and 0.45x on a 2-core Zen 4,
    whose AVX-512 products run at half the width (docs/performance.md)."""
    if vendor == "amd" and family == 26:
        return "amd-zen5"
    if vendor == "amd" and family == 25:
        return "amd-zen4" if any(model in models for models in ZEN4_MODELS) else "amd-zen3"
    return f"{vendor}-family{family}-model{model}"


def baseline_device(device: str, cpuinfo: str | None = None) -> str:
    """The device part of a stored baseline's key: the device kind, and on CPU its vendor and generation
    (``cpu-amd-zen5``, ``cpu-amd-zen4``, ``cpu-intel-family6-model143``: :func:`cpu_generation`), read from
    ``cpuinfo`` (``/proc/cpuinfo``'s text; read here when not given). One generation's figures do not gate
    another's. A CPU whose vendor is not known here is ``cpu``; one whose family or model is not given,
    ``cpu-<vendor>``."""
    kind = device_kind(device)
    if kind != "cpu":
        return kind
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
                cpuinfo = file.read(65536)
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if not name.strip():
            break  # the first processor's fields only
        fields.setdefault(name.strip(), value.strip())
    vendor = CPU_VENDORS.get(fields.get("vendor_id", ""))
    if vendor is None:
        return "cpu"
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    if not (family.isdigit() and model.isdigit()):
        return f"cpu-{vendor}"
    return f"cpu-{cpu_generation(vendor, int(family), int(model))}"


def decode_failures(device: str, rows: int, new_tokens: int, engine_ms: float, generate_ms: float) -> list[str]:
    """The decode step's gate: faster than ``generate`` everywhere; on CUDA within the shape's target, if it has one."""
    failures = []
    if engine_ms >= generate_ms:
        failures.append(f"decode {engine_ms:.3g} ms/step at {rows} x {new_tokens} is not faster than transformers' "
                        f"generate ({generate_ms:.3g} ms/step) on {device}")
    target = DECODE_TARGETS_MS.get((rows, new_tokens)) if device_kind(device) == "cuda" else None
    if target is not None and engine_ms > target:
        failures.append(f"decode {engine_ms:.3g} ms/step at {rows} x {new_tokens} on {device} misses the target of "
                        f"{target:g} ms/step (docs/performance.md)")
    return failures


def regression_failures(what: str, key: str, measured: float, stored: Mapping[str, object] | None, field: str,
                        factor: float, unit: str = "") -> list[str]:
    """``measured`` against ``stored[field] * factor``; without a stored figure, the failure says how to store one."""
    if stored is None:
        return [f"{what}: no baseline stored for {key} in tests/benchmarks/baselines.json, so nothing gates this "
                f"device (measured {measured:.3g}{unit}); run once with {UPDATE_ENV}=1 on this machine to store it"]
    limit = float(stored[field]) * factor
    if measured > limit:
        return [f"{what} {measured:.3g}{unit} is more than {factor:g}x the stored {float(stored[field]):.3g}{unit} "
                f"({key}, {stored.get('machine', 'machine not recorded')}): a regression, or store a new baseline "
                f"with {UPDATE_ENV}=1 and say why"]
    return []


def peer_failures(device: str, key: str, ratio: float, stored: Mapping[str, object] | None) -> list[str]:
    """The peer benchmark's gate on ``device``: its target where it has one, the stored ratio's regression gate
    where one is stored, and at least one of the two."""
    target = PEER_TARGETS.get(device_kind(device))
    failures = []
    if target is not None and ratio > target:
        failures.append(f"rlrunbook/TRL step ratio {ratio:.3f} on {device} misses the target of {target:g}")
    if stored is not None or target is None:
        failures += regression_failures("rlrunbook/TRL step ratio", key, ratio, stored, "ratio", PEER_REGRESSION)
    return failures


def custom_loss_failures(ratio: float) -> list[str]:
    """A custom loss that computes ``cross_entropy`` takes at most ``CUSTOM_LOSS_MAX_RATIO`` times its time."""
    if ratio > CUSTOM_LOSS_MAX_RATIO:
        return [f"forward_backward_custom took {ratio:.3f}x the time of cross_entropy on the same batch (the claim: "
                f"the same time; the gate: <= {CUSTOM_LOSS_MAX_RATIO:g}x)"]
    return []


def decode_attention_failures(own_ms: Mapping[int, float], shared_ms: Mapping[int, float]) -> list[str]:
    """The fused decode attention's gate, from ms per call by window (positions read), each row reading its own
    cache (``own_ms``) and a shared prefix read once per group (``shared_ms``)."""
    failures = []
    for name, timings in (("own", own_ms), ("shared", shared_ms)):
        per_position = sorted(ms / window for window, ms in timings.items())
        typical = per_position[len(per_position) // 2]
        for window, ms in sorted(timings.items()):
            if ms / window > WINDOW_COST_MAX * typical:
                failures.append(f"decode attention ({name} prefixes) over {window} positions took {ms:.3g} ms, "
                                f"{ms / window / typical:.2f}x the median time per position (limit "
                                f"{WINDOW_COST_MAX}x): a layout whose stride aliases in the cache?")
    for window in sorted(own_ms.keys() & shared_ms.keys()):
        if shared_ms[window] > own_ms[window]:
            failures.append(f"decode attention over {window} positions: reading the shared prefix once per group "
                            f"({shared_ms[window]:.3g} ms) is slower than once per row ({own_ms[window]:.3g} ms)")
    return failures


def training_attention_failures(forward_gflops: float, backward_gflops: float, product_gflops: float) -> list[str]:
    """The training attention's gate: its forward and backward FLOP rates (``4 D`` and ``10 D`` FLOP per query, head
    and allowed key) each at least ``ATTENTION_PRODUCT_FRACTION_MIN`` of the fixed-order product's, measured beside
    it."""
    floor = ATTENTION_PRODUCT_FRACTION_MIN * product_gflops
    return [f"attention {name} ran at {rate:.3g} GFLOP/s, {rate / product_gflops:.2f}x the fixed-order product's "
            f"{product_gflops:.3g} (limit {ATTENTION_PRODUCT_FRACTION_MIN}x): its sums no longer keep several "
            "accumulators in flight?"
            for name, rate in (("forward", forward_gflops), ("backward", backward_gflops)) if rate < floor]
