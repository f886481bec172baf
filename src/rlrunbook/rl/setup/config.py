"""The training run's configuration: one validated pydantic model, checked before any model loads.

Flat fields keep the runbook's flag names (``-n`` → ``num_rollouts``, ``--debate-train`` → ``debate_train``);
the options added for trustworthy runs live in sections (``loss.kl_coef``, ``checkpoint.every``, ...),
addressable as dotted keys from a config file, ``key.sub=value`` overrides and the CLI alike (see
:mod:`rlrunbook.rl.setup.config_sources` for how those layers are merged and recorded).

Types and bounds are checked by pydantic when a config is made (an unknown key or a wrong type is refused
with its dotted name); every other check of a config is in :mod:`rlrunbook.rl.setup.config_checks`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict

from rlrunbook.models.registry import DEFAULT_MODEL
from rlrunbook.rl.rollout.guards import Blocklist, PromptLimit
from rlrunbook.rl.rollout.paradigms import RolloutSettings
from rlrunbook.rl.setup.conditional_options import CLIP_LOSSES, inapplicable

CONFIG_VERSION = 1  # bump when a field changes meaning; files stating another version are refused

DebateTrain = Literal["rejection", "rs_grpo"]
KlEstimator = Literal["k1", "k3", "low_var_kl"]
Finetune = Literal["lora", "full"]


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("true/false is not a number here (YAML and Python read it as 1/0); give the number")
    return value


def _on_off(value: Any) -> Any:
    if isinstance(value, bool):  # YAML 1.1 reads an unquoted on / off (a file's, an override's) as true / false
        return "on" if value else "off"
    return value


# Strict numbers, so ``steps: true`` is not read as 1 nor ``deterministic: 1`` as true: an int field takes
# only an int (not a bool, not 2.0, not "2"); a float field takes a number or a numeric string (YAML 1.1
# reads ``1e-4`` as a string), never a bool; a bool field takes only true or false.
Int = Annotated[int, Strict()]
Float = Annotated[float, BeforeValidator(_not_a_bool)]
Bool = Annotated[bool, Strict()]
Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]


class _Section(BaseModel):
    # allow_inf_nan=False: an infinite or NaN number is refused by its dotted name, here, before anything runs.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class LossSettings(_Section):
    """Regularisers of the policy-gradient loss (the offline GRPO trainer's knobs)."""

    kl_coef: Float = Field(0.0, ge=0, description="weight of the KL to the reference policy (base model, "
                                                   "adapter disabled); 0 = off")
    kl_estimator: KlEstimator | None = Field(None, description="per-token KL estimator: k1 | k3 | low_var_kl (k3 "
                                                               "clamped to [-10, 10]); with kl_coef > 0 only, "
                                                               "null there: low_var_kl")
    entropy_coef: Float = Field(0.0, ge=0, description="weight of the entropy bonus; 0 = off")
    clip_low_threshold: Float | None = Field(None, ge=0, description="ppo/cispo/gspo: lower bound of the importance "
                                                                     "ratio (None: the loss's, ppo 0.8, cispo 0, "
                                                                     "gspo 0.9997)")
    clip_high_threshold: Float | None = Field(None, gt=0, description="ppo/cispo/gspo: upper bound of the importance "
                                                                      "ratio (None: the loss's, ppo 1.2, cispo 4, "
                                                                      "gspo 1.0004)")
    grad_clip_norm: Float = Field(0.0, ge=0, description="clip the global gradient norm to this; 0 = off")


class MismatchSettings(_Section):
    """The sampler-trainer mismatch: a gate (on by default) and a correction (off by default on-policy; truncate
    with ``off_policy`` > 0).

    The mismatch is a step's mean |sampler - trainer| logprob over the trained tokens, like with like:
    both under the sampled distribution (logits / T and the filters). Thresholds are stated at T = 1
    and divided by T below 1 (a logit rounding error δ becomes δ / T). Defaults from measurements on
    SmolLM2-135M in bf16 (16 x 128 tokens): transformers' own numerics 0.036-0.045 on this CPU and on an
    H100, the default ``invariant`` numerics 0 on CPU; third-party vLLM-vs-trainer runs 0.003-0.011.
    The correction needs the local backend (the hosted service does not know its keys).
    """

    warn: Float = Field(0.01, gt=0, description="log a warning when a step's mean mismatch exceeds this")
    max: Float = Field(0.03, gt=0, description="stop the run, before the optimizer step, when it exceeds this")
    correction: Literal["none", "truncate", "mask"] | None = Field(
        None, description="none | truncate: advantages x min(p/q, cap) (truncated importance sampling) | "
                          "mask: drop tokens whose p/q lies outside [mask_low, mask_high]; null: truncate "
                          "with off_policy > 0, else none (resolved when the config is validated)")
    cap: Float | None = Field(None, ge=1, description="truncate only: the cap of the importance ratio (null: 2.0)")
    mask_low: Float | None = Field(None, gt=0, lt=1, description="mask only: lowest ratio kept (null: 0.125)")
    mask_high: Float | None = Field(None, gt=1, description="mask only: highest ratio kept (null: 8.0)")


class CheckpointSettings(_Section):
    """Periodic checkpoints of everything a resume needs."""

    every: Int = Field(0, ge=0, description="save a checkpoint every N steps (and after the last); 0 = off")


class ValidationSettings(_Section):
    """The in-training validation hook: pass@k / mean@k on held-out problems."""

    every: Int = Field(0, ge=0, description="validate every N steps (and before the first); 0 = off")
    samples: Int | None = Field(None, ge=1, description="completions per validation problem (k of pass@k); with "
                                                        "every > 0 only, null there: 4")
    num_problems: Int | None = Field(None, ge=1, description="held-out problems per validation; with every > 0 "
                                                             "only, null there: 16")
    threshold: Float | None = Field(None, description="a sample passes at reward >= this; with every > 0 only, "
                                                      "null there: 1.0")


class DataSettings(_Section):
    """How the data set is loaded and how prompts are bounded."""

    cache: Bool = Field(False, description="keep a normalised copy of the data set and train from it")
    cache_dir: str | None = Field(None, description="with cache only: where cached data sets live (default: "
                                                    "datasets/ under the model cache, $RLRUNBOOK_CACHE_DIR)")
    max_prompt_tokens: Int | None = Field(None, ge=1, description="longest prompt allowed, in tokens; None = no limit")
    truncate_prompts: Bool = Field(False, description="cut over-long prompts to max_prompt_tokens instead of "
                                                      "refusing the run")


class RewardSettings(_Section):
    """Reward shaping: the blocklist guard and the multi-signal weights."""

    blocklist: tuple[str, ...] = Field((), description="substrings that must not appear in a completion")
    reject_blocklisted: Bool = Field(False, description="give reward 0 to completions containing a blocklisted "
                                                        "substring (else they are only counted)")
    verify_weight: Float | None = Field(None, ge=0, description="multi_signal only: α, weight of the verified "
                                                                "answer (null: 1.0)")
    format_weight: Float | None = Field(None, ge=0, description="multi_signal only: β, weight of the answer format "
                                                                "(null: 0.5)")
    reflect_weight: Float | None = Field(None, ge=0, description="multi_signal only: γ, weight of the self-check "
                                                                 "(null: 0.5)")


class DynamicSamplingSettings(_Section):
    """Dynamic sampling (DAPO): tied groups are replaced by new ones (see ``rlrunbook.rl.training.dynamic_sampling``)."""

    max_rounds: Int = Field(4, ge=1, description="sampling rounds per step, each drawing the groups still missing "
                                                 "after tied ones are dropped; 1 = no refill")
    max_skipped_steps: Int = Field(3, ge=1, description="stop the run (no learning signal) when this many steps in "
                                                        "a row are skipped for lack of groups with reward spread")


class BackendSettings(_Section):
    """Local backend knobs a run states itself; unset ones come from the TINKER_LOCAL_* environment."""

    device: str | None = Field(None, description="torch device (default: cuda if available, else cpu)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="parameter dtype (default: bfloat16 on cuda, float32 on cpu)")
    load_in_4bit: Bool = Field(False, description="load the frozen base model 4-bit (bitsandbytes, cuda only)")
    grad_accum_steps: Int | None = Field(None, ge=1, description="chunks per forward_backward batch (at least)")
    micro_batch_tokens: Int | None = Field(
        None, ge=0, description="most distinct tokens per forward/backward pass (0: no limit; default "
                                "TINKER_LOCAL_MICRO_BATCH_TOKENS, else derived from the device's memory)")
    activation_checkpointing: Switch | None = Field(
        None, description="decoder layers recompute activations in backward: auto (where memory needs it), on, "
                          "off; default TINKER_LOCAL_ACTIVATION_CHECKPOINTING")
    sampler: Literal["hf", "generate", "vllm"] | None = Field(
        None, description="sampling engine: hf or generate (in process), vllm (a vLLM server); "
                          "default TINKER_LOCAL_SAMPLER; 4-bit base weights need generate or vllm")


class TrainConfig(BaseModel):
    """One training run. Every field documents itself (``description``); sections group the newer knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    version: Int = Field(CONFIG_VERSION, description="config schema version")
    mode: str = Field("single_turn", description="interaction protocol: single_turn, debate (3 rounds), or a registered "
                                                        "paradigm")
    env: str = Field("qa", description="task: qa, summary, math, or a registered plug-in")
    dataset: str | None = Field(None, description="data set: the task's default when null (qa: test, the built-in "
                                                      "arithmetic; summary: cnn_dailymail; math: gsm8k), a hub name "
                                                      "or a JSONL path")
    num_rollouts: Int = Field(16, description="rollouts per step, split evenly into question groups")
    num_groups: Int = Field(1, description="question groups per step; each group shares one question")
    steps: Int = Field(1, description="optimizer steps")
    off_policy: Int = Field(0, ge=0, description="asynchronous RL: batches sampled ahead while the trainer trains; "
                                                 "batch i is sampled from the weights after step max(0, i - off_policy); "
                                                 "0 = the synchronous loop")
    name: str = Field("run", description="run name, last part of the run directory's name")
    seed: Int = Field(0, description="seeds data order, LoRA init and sampling")
    temperature: Float = Field(1.0, description="sampling temperature of the policy")
    max_tokens: Int = Field(64, description="tokens per completion (per debate turn)")
    min_p: Float = Field(0.0, description="min-p filter (local backend only)")
    reward_fn: str | None = Field(None, description="qa: numeric|text|multi_signal; summary: compression|rouge; "
                                                    "math: math|multi_signal")
    mock_judge: Bool = Field(False, description="debate: deterministic judge (higher task reward wins)")
    judge_model: str | None = Field(None, description="debate with a model judge only: the judge's model (null: "
                                                      "the base model)")
    debate_train: DebateTrain | None = Field(None, description="debate: train on winners (rejection, the default "
                                                               "in debate mode), or RS then GRPO (rs_grpo); "
                                                               "null in single_turn mode")
    debate_grpo_reward: Literal["task"] | None = Field(None, description="rs_grpo's reward: the winners' task reward")
    model: str = Field(DEFAULT_MODEL, description="built-in name, local folder or hub id")
    log_root: str | None = Field(None, description="root of run directories (else RLRUNBOOK_LOG_ROOT, else ./logs)")
    learning_rate: Float = Field(1e-4, description="AdamW learning rate")
    finetune: Finetune = Field("lora", description="which weights train: lora (an adapter of lora_rank) or full "
                                                    "(every weight; sharded with FSDP2 over torchrun's ranks)")
    lora_rank: Int | None = Field(None, description="LoRA rank; with finetune lora only, null there: 16")
    train_unembed: Bool | None = Field(None, description="LoRA on the output layer (lm_head) too; vLLM serves it "
                                                         "for Llama-family models, not for Qwen2 (set false there); "
                                                         "with finetune lora only, null there: true")
    loss_fn: str = Field("importance_sampling", description="the Tinker loss trained with: importance_sampling, ppo, cispo, "
                                                             "dro or gspo")
    summary_max_words: Int | None = Field(None, description="summary only: the article is cut to this many words "
                                                            "(null: 150)")
    deterministic: Bool = Field(False, description="seed Python/NumPy/torch, deterministic torch algorithms")
    expected_dataset_hash: str | None = Field(None, description="refuse the run if the data set's fingerprint differs")
    extra: dict[str, Any] = Field(default_factory=dict, description="task plug-in options")
    loss: LossSettings = Field(default_factory=LossSettings)
    mismatch: MismatchSettings = Field(default_factory=MismatchSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    reward: RewardSettings = Field(default_factory=RewardSettings)
    dynamic_sampling: DynamicSamplingSettings = Field(default_factory=DynamicSamplingSettings)
    backend: BackendSettings = Field(default_factory=BackendSettings)

    @property
    def group_size(self) -> int:
        return self.num_rollouts // self.num_groups

    @property
    def run_mode(self) -> str:
        """Name used in the run directory: grpo, rejection or rs_grpo."""
        return "grpo" if self.mode == "single_turn" else (self.debate_train or "rejection")

    def to_dict(self) -> dict:
        """Plain JSON-able values, sections as nested dicts (the form config files use)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> TrainConfig:
        """A config recorded by a run or a checkpoint. Records made before ``debate_train`` became null
        outside debate mode hold its old default, ``rejection``, for single-turn runs: read as null."""
        stored = dict(stored)
        if stored.get("mode", "single_turn") != "debate" and stored.get("debate_train") == "rejection":
            stored["debate_train"] = None
        config = cls.model_validate(stored)
        return config.with_values(dict.fromkeys(inapplicable(config)))  # see conditional_options.inapplicable

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with top-level fields changed."""
        return TrainConfig.model_validate({**self.model_dump(), **changes})

    def with_values(self, changes: dict[str, Any]) -> TrainConfig:
        """A validated copy with the dotted keys of ``changes`` set (``loss.kl_estimator``, ``steps``)."""
        tree = self.model_dump()
        for dotted, value in changes.items():
            *sections, leaf = dotted.split(".")
            node = tree
            for section in sections:
                node = node[section]
            node[leaf] = value
        return TrainConfig.model_validate(tree)

    def rollout_settings(self) -> RolloutSettings:
        """What rollouts need of this run: sampling, group size, seed, prompt limit and blocklist."""
        return RolloutSettings(
            group_size=self.group_size, seed=self.seed, max_tokens=self.max_tokens, temperature=self.temperature,
            min_p=self.min_p, prompt_limit=PromptLimit(self.data.max_prompt_tokens, self.data.truncate_prompts),
            blocklist=Blocklist(tuple(self.reward.blocklist), self.reward.reject_blocklisted))

    def loss_fn_config(self, local: bool = False) -> dict[str, float | str]:
        """The ``loss_fn_config`` sent with forward_backward: clip bounds for ppo/cispo/gspo, regularisers if on.

        ``local`` (the local backend): also the sampler's transform, so the mismatch the trainer
        reports compares like with like, and the mismatch correction when one is asked for.
        """
        config = self._tinker_loss_config()
        if local:
            config.update(sampling_temperature=self.temperature, sampling_min_p=self.min_p)
            if self.mismatch.correction not in (None, "none"):  # knobs left null take the backend's defaults
                config["is_correction"] = self.mismatch.correction
                knobs = {"is_cap": self.mismatch.cap, "is_mask_low": self.mismatch.mask_low,
                         "is_mask_high": self.mismatch.mask_high}
                config.update({key: value for key, value in knobs.items() if value is not None})
        return config

    def _tinker_loss_config(self) -> dict[str, float | str]:
        settings = self.loss
        config: dict[str, float | str] = {}
        if self.loss_fn in CLIP_LOSSES:
            for key in ("clip_low_threshold", "clip_high_threshold"):
                if getattr(settings, key) is not None:
                    config[key] = getattr(settings, key)
        if settings.kl_coef > 0:  # a null estimator takes the backend's default, low_var_kl
            config["kl_coef"] = settings.kl_coef
            if settings.kl_estimator is not None:
                config["kl_estimator"] = settings.kl_estimator
        if settings.entropy_coef > 0:
            config["entropy_coef"] = settings.entropy_coef
        return config
