"""Typed recipe: one frozen config per component (torchtitan style), validated on construction.

Field-level checks live in ``__post_init__`` and raise ``ValueError`` naming the field; the loader
prefixes the section path (``grpo.eps_high: ...``). Cross-component checks are in ``Recipe``; what a
stage refuses given the ranks it runs on is ``Recipe.check_stage``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from osvl.config.parallel import ParallelConfig

Stage = Literal["sft", "grpo"]
FatalMode = Literal["vanilla", "hard_mask", "fatal_mask", "fatal_clamp"]
FatalErrors = Literal["policy", "all", "execution"]
InfraRollouts = Literal["drop", "keep"]
Estimator = Literal["grpo", "rloo", "drgrpo"]
LossAgg = Literal["seq-mean-token-mean", "seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm"]
DataFormat = Literal["auto", "osvl", "sharegpt", "verl_parquet", "text"]
ToolProfileName = Literal["paper", "release"]
OldLogprobs = Literal["engine", "trainer"]
Correction = Literal["off", "token", "sequence"]
CorrectionMode = Literal["truncate", "mask"]
StaleGroups = Literal["drop", "regenerate"]
PartialRollouts = Literal["keep", "restart"]

DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
TOOL_PROFILES: tuple[str, ...] = get_args(ToolProfileName)
STAGE_FORMATS = {"sft": ("auto", "osvl", "sharegpt", "text"), "grpo": ("auto", "osvl", "verl_parquet")}

PAPER_PRESETS = ("qwen3_vl_8b", "qwen3_vl_30b_a3b", "qwen3_vl_32b")
TINY_PRESETS = ("tiny", "tiny_moe", "small")  # CPU sizes, osvl.trainer.policy.CPU_SIZES


def _positive(obj: object, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(obj, name)}")


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(obj, name)}")


@dataclass(frozen=True)
class JobConfig:
    name: str = "run"
    stage: Stage = "sft"
    run_dir: str = "runs/run"
    seed: int = 0
    world_size: int = 0  # the recipe's target topology (GPUs); 0 = whatever torchrun starts
    # How long a collective may wait for the slowest rank before it fails (gloo and NCCL); 0 = derived from the
    # recipe (osvl.trainer.watchdog): a GRPO step's rollout deadline plus room for the update, sync and a checkpoint
    collective_timeout_s: float = 0.0
    gpu_memory_gib: float = 0.0  # memory of one target GPU; --dry-run checks the plan against it (0 = no check)
    description: str = ""

    def __post_init__(self) -> None:
        _non_negative(self, "world_size", "seed", "gpu_memory_gib", "collective_timeout_s")
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"  # qwen3_vl_8b | qwen3_vl_30b_a3b | qwen3_vl_32b | tiny | tiny_moe | small
    pretrained: str = ""  # HF checkpoint directory; "" = random init (tiny recipes, dry runs)
    attn_backend: Literal["sdpa", "varlen"] = "sdpa"
    freeze_vision: bool = False  # the paper fine-tunes the vision tower and projector too
    # decoder layers of a model built from the preset (random init; a checkpoint has its own); 0 = the preset's
    layers: int = 0

    def __post_init__(self) -> None:
        if self.preset not in PAPER_PRESETS + TINY_PRESETS:
            raise ValueError(f"preset must be one of {PAPER_PRESETS + TINY_PRESETS}, got {self.preset!r}")
        _non_negative(self, "layers")


@dataclass(frozen=True)
class DataConfig:
    train_path: str = ""  # SFT: trajectories JSONL (osvl.rl); GRPO: prompts JSONL
    # osvl: osvl JSONL; sharegpt: LLaMA-Factory ShareGPT JSON/JSONL (SearchVL-SFT-36k);
    # verl_parquet: verl RL parquet (SearchVL-RL-8k); text: {"text": ...} JSONL, loss on every token
    # (continued pretraining, SFT stage only); auto: .parquet -> verl_parquet, a JSON record with
    # "conversations" -> sharegpt, a record whose only key is "text" -> text, anything else -> osvl
    format: DataFormat = "auto"
    image_root: str = ""  # sharegpt: directory the image paths are relative to; "" = the data file's directory
    system_prompt: str = (
        ""  # a text file with the system prompt the policy sees; "" = none (a ShareGPT record's own wins)
    )
    tokenizer: str = ""  # tokenizer.json (or a directory holding one); "" = the pretrained checkpoint's
    max_tokens: int = 32768  # packed tokens per micro-batch (image tokens included)
    max_patches: int = 0  # vision patches per micro-batch; 0 = unbounded
    min_pixels: int = 65536
    max_pixels: int = 16777216
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.format not in DATA_FORMATS:
            raise ValueError(f"format must be one of {list(DATA_FORMATS)}, got {self.format!r}")
        if self.image_root and self.format not in ("auto", "sharegpt"):
            raise ValueError(f"image_root applies to the sharegpt format only, got format={self.format!r}")
        _positive(self, "max_tokens", "min_pixels", "max_pixels")
        _non_negative(self, "max_patches")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")


@dataclass(frozen=True)
class MoEConfig:
    """Router losses of MoE models, as Megatron-Core defines them (osvl.model.moe_losses): per MoE layer,
    summed over layers. The router always computes its logits in fp32."""

    aux_loss_coef: float = 0.0  # load-balance loss (Switch; 1.0 at uniform load) per layer; 0 = off
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE): mean squared logsumexp of the router logits; 0 = off

    def __post_init__(self) -> None:
        _non_negative(self, "aux_loss_coef", "z_loss_coef")


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    # a step whose global gradient norm is inf or nan: "stop" the run before the update, or "skip" the
    # update (the weights stay, the step is counted in the metrics as nonfinite_skipped)
    on_nonfinite: Literal["stop", "skip"] = "stop"

    def __post_init__(self) -> None:
        _positive(self, "lr", "eps")
        _non_negative(self, "weight_decay", "grad_clip")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f'on_nonfinite must be "stop" or "skip", got {self.on_nonfinite!r}')
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")


@dataclass(frozen=True)
class SchedulerConfig:
    kind: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr

    def __post_init__(self) -> None:
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must lie in [0, 1), got {self.warmup_ratio}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class SFTConfig:
    epochs: int = 1
    global_batch: int = 256  # trajectories per optimizer step, over all data-parallel ranks
    max_steps: int = 0  # 0 = epochs * steps_per_epoch
    loss_chunk: int = 4096  # rows of hidden states per lm_head + cross-entropy chunk

    def __post_init__(self) -> None:
        _positive(self, "epochs", "global_batch", "loss_chunk")
        _non_negative(self, "max_steps")


@dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 8  # G rollouts per prompt
    batch_prompts: int = 256  # prompts per rollout batch
    mini_batch_prompts: int = 64  # prompts per optimizer step (PPO mini-batch)
    epochs: int = 1
    max_steps: int = 0  # 0 = epochs over the prompt set
    temperature: float = 0.7
    top_p: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    estimator: Estimator = "rloo"
    loss_agg: LossAgg = "seq-mean-token-sum"
    fatal_mode: FatalMode = "fatal_clamp"
    fatal_k: int = 3  # consecutive counted tool errors that make a step fatal
    # which errors count: the policy's own (default), or every tool-execution failure, infra_error
    # (a back-end's 5xx / 429 / timeout) included, as the paper counts "cascading tool-execution failures",
    # or "execution": only calls a tool ran and failed, nothing the policy writes alone (osvl.rl.fatal)
    fatal_errors: FatalErrors = "policy"
    # a rollout that met a tool's infra_error: drop (retried, else out of the loss and its group's
    # statistics) or keep (scored like any other; the fatal rule decides its mask). "all" needs "keep".
    infra_rollouts: InfraRollouts = "drop"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    max_prompt_tokens: int = 8192
    max_response_tokens: int = 32768
    loss_chunk: int = 4096
    check_loss_inputs: bool = False  # the fused loss's host-side value checks, one sync per micro-batch (debug)
    # The PPO ratio's old policy: "engine" takes the engine's logprobs (no extra forward; exact only when engine
    # and trainer agree and nothing is stale); "trainer" recomputes them with a no-grad forward of the trainer's
    # weights before the step's first update (verl, slime, AReaL; the proximal policy of decoupled PPO).
    old_logprobs: OldLogprobs = "engine"
    # Rollout-training mismatch correction (osvl_kernels.RolloutCorrection): each token's policy-gradient term is
    # weighted by exp(old_trainer - engine) ("token") or by its sequence's product of them ("sequence"), truncated
    # at rollout_correction_cap (TIS) or zeroed outside it ("mask"). Needs old_logprobs = "trainer".
    rollout_correction: Correction = "off"
    rollout_correction_mode: CorrectionMode = "truncate"
    rollout_correction_cap: float = 2.0  # C

    def __post_init__(self) -> None:
        _positive(
            self,
            "group_size",
            "batch_prompts",
            "mini_batch_prompts",
            "epochs",
            "temperature",
            "fatal_k",
            "max_prompt_tokens",
            "max_response_tokens",
            "loss_chunk",
            "rollout_correction_cap",
        )
        _non_negative(self, "max_steps", "eps_low", "eps_high", "kl_coef", "entropy_coef")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (a group-relative advantage needs peers), got {self.group_size}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.batch_prompts % self.mini_batch_prompts:
            raise ValueError(
                f"mini_batch_prompts {self.mini_batch_prompts} must divide batch_prompts {self.batch_prompts}"
            )
        if self.fatal_errors == "all" and self.infra_rollouts == "drop":
            raise ValueError(
                "fatal_errors 'all' counts infra errors toward the fatal rule, but infra_rollouts 'drop' "
                "removes every rollout that met one before the rule could mask it: set "
                "infra_rollouts = 'keep'"
            )
        if self.rollout_correction != "off" and self.old_logprobs != "trainer":
            raise ValueError(
                f"rollout_correction {self.rollout_correction!r} weighs exp(old_trainer - engine): it "
                f'needs old_logprobs = "trainer", got {self.old_logprobs!r}'
            )


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["local", "sglang", "vllm"] = "local"  # local: an in-process engine per rank (CPU form)
    sglang_urls: tuple[str, ...] = ()  # where /generate goes: the servers, or one sglang-router URL
    sglang_update_urls: tuple[str, ...] = ()  # the servers that take weight updates; () = sglang_urls
    vllm_urls: tuple[str, ...] = ()  # engine 'vllm': the vLLM servers rollouts go to
    vllm_update_urls: tuple[str, ...] = ()  # the vLLM servers that take weight updates; () = vllm_urls
    text_only_export: bool = False  # servers serve the language model as a Qwen3 text checkpoint (vLLM on CPU)
    # disk: HF safetensors in weights_dir (vLLM: reloaded through /collective_rpc, the CPU path);
    # distributed: broadcast (SGLang's update group; vLLM's NCCL weight transfer, GPUs only)
    weight_sync: Literal["disk", "distributed"] = "disk"
    weights_dir: str = ""  # shared by trainer and servers; "" = <run_dir>/weights (last 2 versions kept)
    weight_sync_bucket_mb: int = 512  # distributed: bytes per /update_weights_from_distributed bucket
    weight_sync_master_addr: str = "127.0.0.1"  # distributed: where the servers reach trainer rank 0
    weight_sync_port: int = 0  # distributed: the update group's store port; 0 = any free port
    request_timeout_s: float = 600.0  # one engine HTTP request
    server_reconnect_s: float = 600.0  # an SGLang server that went away (a restart) is waited for this long
    max_logprob_diff: float = 0.05  # pre-flight: mean |engine - trainer| logprob allowed on a probe
    server_tp: int = 1  # each SGLang server's tensor-parallel size (osvl.serve, the serving memory plan)
    server_mem_fraction: float = 0.85  # SGLang --mem-fraction-static: share of a server GPU for weights + KV cache
    server_gpu_gib: float = 96.0  # memory of one server GPU (H20: 96), for the serving memory plan
    max_in_flight: int = 64
    max_turns: int = 16
    trajectory_deadline_s: float = 900.0
    max_retries: int = 2
    # The longest a rank waits for its step's scored groups before the run stops loudly (every rank, with what it
    # waited for, after a checkpoint); 0 = derived from the recipe (osvl.trainer.watchdog.step_deadline_s)
    step_deadline_s: float = 0.0
    # Rollouts that do not depend on which requests share a generation batch (that depends on timing):
    # the local engine decodes each request on its own (tiny_grpo, decode-bound: 1.9x step time,
    # bench/rollout/bench_deterministic.py); SGLang servers must run --enable-deterministic-inference
    deterministic: bool = False
    # Asynchronous GRPO (osvl.rollout.generator): generation runs up to max_staleness rollout steps ahead of the
    # trainer; a group whose oldest token came from weights more than max_staleness weight syncs older than the
    # trainer's is never trained on. 0 = the synchronous on-policy step.
    max_staleness: int = 0
    stale_groups: StaleGroups = "drop"  # a group past the bound is dropped (counted), or regenerated on new weights
    # A trajectory in flight when the weights change: "keep" its tokens (their engine logprobs and versions) and go
    # on with the new weights, or "restart" it from its prompt on the new weights.
    partial_rollouts: PartialRollouts = "keep"

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_in_flight",
            "max_turns",
            "trajectory_deadline_s",
            "weight_sync_bucket_mb",
            "request_timeout_s",
            "server_reconnect_s",
            "max_logprob_diff",
            "server_tp",
            "server_gpu_gib",
        )
        if not 0.0 < self.server_mem_fraction <= 1.0:
            raise ValueError(f"server_mem_fraction must lie in (0, 1], got {self.server_mem_fraction}")
        _non_negative(self, "max_retries", "weight_sync_port", "max_staleness", "step_deadline_s")
        if self.engine == "sglang" and not self.sglang_urls:
            raise ValueError("engine 'sglang' needs sglang_urls")
        if self.engine == "vllm" and not self.vllm_urls:
            raise ValueError("engine 'vllm' needs vllm_urls")
        for name in ("sglang_urls", "sglang_update_urls", "vllm_urls", "vllm_update_urls"):
            bad = [u for u in getattr(self, name) if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"{name} must be http(s) base URLs, got {bad}")


@dataclass(frozen=True)
class ValidationConfig:
    """In-training evaluation of the GRPO stage on held-out prompts (verl's val_* settings): every
    ``every_steps`` steps and at the last step, the whole file is rolled out in batches of
    ``batch_prompts`` with the training tools and turn budget, scored like training, and logged with
    the step's metrics as ``val/...``."""

    path: str = ""  # held-out prompts, in a format data.train_path accepts; "" = no validation
    every_steps: int = 10
    batch_prompts: int = 64  # prompts rolled out together
    samples_per_prompt: int = 1
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 0.95

    def __post_init__(self) -> None:
        _positive(self, "every_steps", "batch_prompts", "samples_per_prompt")
        _non_negative(self, "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class ToolsConfig:
    backend: Literal["offline", "online"] = "offline"  # offline: the embedded world; online: config_file's APIs
    servers: tuple[str, ...] = ()  # osvl.tools.server URLs; when set, calls go there instead of a local pool
    config_file: str = ""  # online back-ends: a TOML file as `osvl.eval --tools` reads (keys via *_key_env)
    profile: ToolProfileName = "paper"  # paper: osvl's tool schema; release: the released checkpoints' names/arguments
    python_interpreter: bool = False  # register the sandboxed python_interpreter tool (off by default)
    # the boundary it runs behind; unsafe_no_boundary (a Python audit hook only) must be chosen by name
    python_sandbox: Literal["namespaces", "sandbox_fusion", "unsafe_no_boundary"] = "namespaces"
    sandbox_fusion_url: str = ""  # SandboxFusion base URL (POST {url}/run_code) for python_sandbox = sandbox_fusion
    world_dir: str = ""  # the embedded mini-world for the offline backend
    workers: int = 4
    call_deadline_s: float = 60.0
    fault_rate: float = 0.0  # injected tool faults, independent per call (demo / tests)
    # injected back-end outages (osvl.tools.faults.OutageModel): per rollout, with probability
    # outage_rate the back-end of outage_tools fails from a turn drawn uniformly in [0, outage_start_turns)
    # for outage_mean_turns turns on average (geometric; 0 = to the rollout's end): every call to those
    # tools then answers 503 / 429 / a timeout as infra_error
    outage_rate: float = 0.0
    outage_start_turns: int = 4
    outage_mean_turns: float = 0.0
    outage_tools: tuple[str, ...] = ("text_search", "image_search")

    def __post_init__(self) -> None:
        if self.profile not in TOOL_PROFILES:
            raise ValueError(f"profile must be one of {list(TOOL_PROFILES)}, got {self.profile!r}")
        _positive(self, "workers", "call_deadline_s", "outage_start_turns")
        _non_negative(self, "outage_mean_turns")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must lie in [0, 1], got {self.fault_rate}")
        if not 0.0 <= self.outage_rate <= 1.0:
            raise ValueError(f"outage_rate must lie in [0, 1], got {self.outage_rate}")
        if 0.0 < self.outage_mean_turns < 1.0:
            raise ValueError(
                f"outage_mean_turns must be 0 (to the rollout's end) or >= 1, got {self.outage_mean_turns}"
            )
        if self.outage_rate > 0.0 and not self.outage_tools:
            raise ValueError("outage_rate > 0 needs outage_tools: the tools whose back-end goes down")
        if self.python_sandbox == "sandbox_fusion" and not self.sandbox_fusion_url.startswith(("http://", "https://")):
            raise ValueError(
                f"python_sandbox 'sandbox_fusion' needs an http(s) sandbox_fusion_url, got {self.sandbox_fusion_url!r}"
            )
        bad = [u for u in self.servers if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"servers must be http(s) base URLs, got {bad}")


@dataclass(frozen=True)
class JudgesConfig:
    accuracy: Literal["exact", "llm"] = "exact"
    # heuristic: four search-process proxies; chain: the share of a chain question's lookups issued on the
    # entities the agent's own evidence named (osvl.rl.chain.EvidenceChainQueryJudge); llm: the rubric judge
    query: Literal["heuristic", "chain", "llm"] = "heuristic"
    url: str = ""  # OpenAI-compatible chat endpoint for the llm judges
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the key ("" or unset = no key)
    alpha: float = 0.8  # weight of accuracy against query quality in the composite reward
    timeout_s: float = 60.0  # one judge request
    max_attempts: int = 5  # per verdict; past them the sample is unscored, never 0
    overload_wait_s: float = 120.0  # per verdict: 429/503 answers asked again this long without using attempts
    max_concurrency: int = 32  # judge calls in flight per rank
    cache_size: int = 100_000  # verdicts kept, keyed by judge prompt version, question and answer

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        _positive(self, "timeout_s", "max_attempts", "max_concurrency")
        _non_negative(self, "cache_size", "overload_wait_s")
        if "llm" in (self.accuracy, self.query) and not (self.url and self.model):
            raise ValueError("llm judges need url and model")


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 0  # DCP save cadence; 0 = only at exit
    keep_last: int = 2
    resume: bool = True  # continue from the newest checkpoint in run_dir
    export_hf: bool = True  # write HF safetensors at exit
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"

    def __post_init__(self) -> None:
        _non_negative(self, "every_steps")
        _positive(self, "keep_last")


@dataclass(frozen=True)
class WandbConfig:
    """A Weights & Biases run beside ``metrics.jsonl`` (the ``wandb`` extra). ``offline`` writes it under ``dir``
    without a network, for ``wandb sync`` later; ``online`` needs a login or ``WANDB_API_KEY``."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "osvl"
    entity: str = ""  # "" = the account's default entity
    dir: str = ""  # where its wandb/ folder goes; "" = job.run_dir

    def __post_init__(self) -> None:
        if self.mode not in ("disabled", "offline", "online"):
            raise ValueError(f'mode must be "disabled", "offline" or "online", got {self.mode!r}')
        if not self.project:
            raise ValueError("project must not be empty")


@dataclass(frozen=True)
class MLflowConfig:
    """An MLflow run beside ``metrics.jsonl`` (the ``mlflow`` extra): the recipe as its params, every step's values
    as its metrics."""

    enabled: bool = False
    tracking_uri: str = ""  # "" = a SQLite store in job.run_dir (mlflow.db), no server; else http://host:5000, ...
    experiment: str = "osvl"

    def __post_init__(self) -> None:
        if not self.experiment:
            raise ValueError("experiment must not be empty")


@dataclass(frozen=True)
class MetricsConfig:
    log_every: int = 1
    tensorboard: bool = True  # the tensorboard extra (torchtitan installs it too); missing while on: an error
    console: bool = True
    peak_tflops: float = 0.0  # dense bf16 per GPU for MFU (H100/H200 989, H20 148); 0 = detect, unknown = no MFU
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)

    def __post_init__(self) -> None:
        _positive(self, "log_every")
        _non_negative(self, "peak_tflops")


@dataclass(frozen=True)
class Recipe:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    judges: JudgesConfig = field(default_factory=JudgesConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "ep"):
            if getattr(self.parallel, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self.parallel, name)}")
        if self.parallel.dp_shard == 0 or self.parallel.dp_shard < -1:
            raise ValueError(f"parallel.dp_shard must be -1 or >= 1, got {self.parallel.dp_shard}")
        moe = self.model.preset in ("qwen3_vl_30b_a3b", "tiny_moe")
        if self.parallel.ep > 1 and not moe:
            raise ValueError(
                f"parallel.ep: expert parallelism needs an MoE preset, got model.preset={self.model.preset!r}"
            )
        if self.parallel.ep > 1 and self.parallel.tp > 1:
            raise ValueError(
                f"parallel.ep: ep={self.parallel.ep} with tp={self.parallel.tp} needs sequence "
                "parallelism, which osvl does not enable; use tp=1 with ep"
            )
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self.moe, name) and not moe:
                raise ValueError(
                    f"moe.{name}: router losses need an MoE preset, got model.preset={self.model.preset!r}"
                )
        if self.validation.path and self.job.stage != "grpo":
            raise ValueError(
                f"validation.path: in-training validation is a grpo-stage hook, got stage {self.job.stage!r}"
            )
        w = self.job.world_size
        if w:
            dp_shard = self.parallel.resolved_dp_shard(w)
            if dp_shard * self.parallel.dp_replicate * self.parallel.tp != w:
                raise ValueError(
                    f"parallel: dp_replicate({self.parallel.dp_replicate}) * dp_shard({dp_shard}) * "
                    f"tp({self.parallel.tp}) != job.world_size({w}): set parallel.dp_shard=-1 (the rest of the world "
                    "after dp_replicate and tp), or make parallel.dp_replicate, parallel.dp_shard, parallel.tp and "
                    "job.world_size agree"
                )
            if w % self.parallel.ep:
                raise ValueError(f"parallel.ep: {self.parallel.ep} must divide job.world_size {w}")
        if self.data.format not in STAGE_FORMATS[self.job.stage]:
            raise ValueError(
                f"data.format: the {self.job.stage} stage reads {list(STAGE_FORMATS[self.job.stage])}, "
                f"got {self.data.format!r}"
            )
        if self.job.stage == "sft" and w and self.sft.global_batch % self.data_parallel_size(w):
            raise ValueError(
                f"sft.global_batch {self.sft.global_batch} must be a multiple of the "
                f"data-parallel size {self.data_parallel_size(w)}"
            )

    def check_stage(self, dp_size: int) -> None:
        """What this recipe's stage refuses before it starts, given the data-parallel size it runs on:
        settings valid one by one that the stage cannot run together. The stage and ``--dry-run``
        call it, so both refuse the same recipes with the same message; checks of live services
        (servers, judges, sandboxes) are the stage's pre-flight."""
        if self.job.stage == "grpo":
            self._check_grpo(dp_size)

    def _check_grpo(self, dp_size: int) -> None:
        g, t, r = self.grpo, self.tools, self.rollout
        if g.kl_coef:
            raise ValueError(
                "grpo.kl_coef > 0 needs a reference policy, which the grpo stage does not keep (the "
                "paper uses no KL loss)"
            )
        if g.mini_batch_prompts % dp_size:
            raise ValueError(
                f"grpo.mini_batch_prompts {g.mini_batch_prompts} must be a multiple of the data-parallel size {dp_size}"
            )
        if not t.servers and t.backend == "online" and not t.config_file:
            raise ValueError(
                "tools.backend = 'online' needs tools.config_file (the online back-ends, keys named by "
                "*_key_env fields) or tools.servers (tool servers that hold them)"
            )
        if r.engine == "local" and self.model.preset in PAPER_PRESETS:
            raise ValueError(
                f"rollout.engine = 'local' keeps an unsharded generation copy of the policy in every "
                f"trainer rank, the CPU form only; serve {self.model.preset} with rollout.engine = "
                f"'sglang' (python -m osvl.serve --recipe ... prints the servers' commands)"
            )
        if r.engine == "vllm" and r.deterministic:
            raise ValueError(
                "rollout.deterministic: osvl cannot check or switch on batch-invariant inference in a "
                "vLLM server; use rollout.engine = 'sglang' (--enable-deterministic-inference) or 'local'"
            )
        if not t.servers and t.backend == "offline" and not t.world_dir:
            raise ValueError(
                "tools.world_dir must name a world directory for the offline backends (or set tools.servers)"
            )

    def data_parallel_size(self, world_size: int) -> int:
        return self.parallel.resolved_dp_shard(world_size) * self.parallel.dp_replicate
