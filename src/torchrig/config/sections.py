"""The built-in config sections (``data``, ``model``, ``optim``, ``scheduler``, ``checkpoint``, ``log``,
``profile``, ``dist``, ``parallel``, ``peft``, ``quantize``, ``spike``): every key once, with its type, default, rule, Trainer keyword and help."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from .rules import (AUTO_BOOL, BOOL, MAPPING, POSITIVE, TEXT, Rule, accept, choice, integer, is_int, list_of,
                    mapping_of, number, optional, or_auto, pair, pattern)
from .schema import key

FACTORY = pattern("a 'module:attribute' string such as mypkg.models:build_model",
               r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
TRACKERS = ("csv", "tensorboard", "mlflow", "wandb")
_BACKEND = r"(?:(?:cpu|cuda|xpu):)?(?:gloo|nccl|mpi|ucc|xccl)"


def _input_keys(v: Any) -> list:
    accept(isinstance(v, (list, tuple)) and len(v) > 0, v)
    return [accept(isinstance(k, str) and k.strip() != "", k) for k in v]


def _steps(v: Any) -> list:
    """[] (off) or two optimizer steps [first, last], first >= 1, last >= first."""
    accept(isinstance(v, (list, tuple)) and len(v) in (0, 2) and all(is_int(x) for x in v), v)
    return accept(not v or 1 <= v[0] <= v[1], list(v))


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _checkpointing(v: Any) -> Any:
    if v in ("full", "selective"):
        return v
    return list_of(TEXT, "a list of sub-module names").check(v)


def _plot(v: Any) -> Any:
    if v == "inline":  # shown in the notebook's cell output as well
        return v
    return True if v == "background" else BOOL.check(v)  # "background": an older run's setting, drawn before fit returns


@dataclass
class DataConfig:
    """How batches are loaded; sizes are per process."""

    batch_size: int = key(64, integer(1), "samples per loaded batch, per process", alias="batch_size")
    global_batch_size: Optional[int] = key(
        None, optional(integer(1)),
        "samples per optimizer step over all processes; set: data.batch_size and accumulate are derived from it, "
        "the world size and data.micro_batch_size, and stay the same mathematics on any number of processes",
        alias="global_batch_size")
    micro_batch_size: Union[int, str, None] = key(
        None, optional(or_auto(integer(1), "an integer >= 1 or 'auto'")),
        "rows per forward/backward: each loaded batch is cut into pieces of this size, accumulated into the same "
        "optimizer step (less activation memory); auto: the loaded batch, halved on a CUDA out-of-memory error",
        alias="micro_batch_size")
    eval_batch_size: Optional[int] = key(None, optional(integer(1)),
                                         "batch size of evaluation and prediction; null: data.batch_size",
                                         alias="eval_batch_size")
    num_workers: Union[int, str] = key(
        "auto", or_auto(integer(0)),
        "DataLoader worker processes; auto: none for in-memory tensors or samples cheaper to make than to receive "
        "(timed on a few), else min(16, cores per local rank - 1); samples are seeded alike either way",
        alias="num_workers")
    pin_memory: Union[bool, str] = key("auto", AUTO_BOOL, "page-locked host batches; auto: on when training on CUDA",
                                       alias="pin_memory")
    persistent_workers: bool = key(True, BOOL, "loader workers live for the whole fit (training's, and a validation "
                                               "Dataset's)", alias="persistent_workers")
    prefetch_factor: Optional[int] = key(None, optional(integer(1)),
                                         "batches each loader worker prepares ahead; null: PyTorch's default")
    shuffle: bool = key(True, BOOL, "a new training order every epoch, a function of (seed, epoch)", alias="shuffle")
    drop_last: bool = key(False, BOOL, "drop the short last training batch of an epoch", alias="drop_last")
    fast_path: bool = key(True, BOOL, "in-memory TensorDataset batches gathered with one indexing op (into pinned "
                                      "memory when pinning, or on the GPU when the tensors are there)",
                          alias="fast_path")
    path: Optional[str] = key(None, optional(TEXT), "recipe data source, a folder or file; null: the recipe's "
                                                    "embedded data")
    sources: dict = key({}, mapping_of(TEXT, "a mapping {name: folder or file}"),
                        "named training sources mixed by data.mixture, each a folder or file read as data.path is "
                        "(the language-model recipe); {}: data.path")
    mixture: dict = key({}, mapping_of(POSITIVE, "a mapping {source name: weight > 0}"),
                        "weight of each data.sources name in every epoch's samples (any scale; each logged row shows "
                        "the shares as data/share/NAME); {}: by the sources' sizes")
    val_path: Optional[str] = key(None, optional(TEXT), "recipe validation data, a folder or file")
    test_path: Optional[str] = key(None, optional(TEXT), "recipe test data, a folder or file (torchrig evaluate)")
    val_fraction: float = key(0.0, number(0, 1, hi_open=True),
                              "share of the training data held out for validation (recipes)")
    pack: bool = key(False, BOOL, "token documents packed into rows of lm.block_size tokens, attention and positions "
                                  "kept within each document (language-model recipe, finetune.task=causal-lm; see "
                                  "docs/your-code.md); false: documents joined with [SEP] and cut into blocks")
    skip_bad_samples: bool = key(False, BOOL, "skip samples that cannot be read, listing them, instead of stopping")
    options: dict = key({}, MAPPING, "recipe-specific data options")
    input_keys: Optional[list] = key(None, optional(Rule("a non-empty list of batch keys", _input_keys)),
                                     "dict batches: the keys passed to forward; null: those its signature accepts",
                                     alias="input_keys")
    label_key: Optional[str] = key(None, optional(TEXT), "dict batches: the target's key; null: labels, label, "
                                                         "target, targets or y", alias="label_key")
    factory: Optional[str] = key(None, optional(FACTORY),
                                 "module:function building your data from the config: train, (train, val[, test]) or "
                                 "a dict (torchrig train --data)")
    steps_per_epoch: Optional[int] = key(
        None, optional(integer(1)),
        "optimizer steps per epoch; null: the data's length, or for a stream without one, until it runs out; "
        "caps the epoch of other data",
        alias="steps_per_epoch")


@dataclass
class ModelConfig:
    """The model: which one, its weights and how it runs."""

    name: str = key("digits_cnn", TEXT, "the model to build: digits_cnn, mlp, small_resnet, bert, …, or a "
                                        "torchvision / timm name (torchvision:NAME, timm:NAME) in the image recipe")
    options: dict = key({}, MAPPING, "keyword arguments for the model builder")
    weights: Optional[str] = key(None, optional(TEXT), "local weights file to start from (safetensors or a "
                                                       "state_dict .pt)")
    init: Optional[str] = key(None, optional(TEXT), "weight initialisation, e.g. xavier_uniform, kaiming_normal, "
                                                    "normal(0, 0.02); null: the model's own")
    channels_last: Union[bool, str] = key("auto", AUTO_BOOL, "channels_last memory format; auto: on for "
                                                             "convolutional models on CUDA", alias="channels_last")
    compile: bool = key(False, BOOL, "torch.compile the model (each network of a ModuleDict)", alias="compile")
    compile_mode: str = key(
        "default", choice(*COMPILE_MODES),
        "torch.compile's mode with model.compile: default, reduce-overhead (CUDA graphs: static shapes, a short last "
        "batch dropped), max-autotune, max-autotune-no-cudagraphs", alias="compile_mode")
    activation_checkpointing: Union[list, str] = key(
        [], Rule("full, selective or a list of sub-module names", _checkpointing),
        "recompute activations in backward (less memory): a list of sub-module names (as in named_modules()), each "
        "recomputed whole; full: every block (the model's top-level ModuleList); selective: every block, keeping the "
        "matrix products' outputs and recomputing the cheap ops", alias="activation_checkpointing")
    activation_offload: bool = key(False, BOOL, "keep the activations saved for backward in host memory (pinned on "
                                                "CUDA) until backward needs them: less device memory, copies each "
                                                "way", alias="activation_offload")
    fused_head: Optional[str] = key(
        None, optional(TEXT),
        "name of the model's vocabulary projection (an nn.Linear whose output is the model's output): in training "
        "it computes its logits and their cross-entropy together in chunks, never the whole logits (Liger-Kernel on "
        "CUDA when installed, chunked PyTorch ops elsewhere); needs loss cross_entropy; training metrics are then "
        "reported by evaluation only", alias="fused_head")
    factory: Optional[str] = key(None, optional(FACTORY), "module:function building your model from the config "
                                                          "(torchrig train --model)")
    python_class: Optional[str] = key(None, optional(TEXT), "module:qualname of a model given to Trainer in "
                                                            "Python, recorded in config.yaml (not rebuilt from it)")


@dataclass
class OptimConfig:
    """The optimizer of every parameter group."""

    name: str = key("adamw", TEXT, "sgd, adam, adamw, adagrad or rmsprop", alias="optimizer")
    lr: float = key(1e-3, POSITIVE, "the learning rate (optim.group_lr sets it per module)", alias="lr")
    weight_decay: float = key(0.0, number(0), "weight decay (an L2 penalty; decoupled in adamw)",
                               alias="weight_decay")
    momentum: float = key(0.9, number(0, 1, hi_open=True), "momentum of sgd and rmsprop", alias="momentum")
    nesterov: bool = key(False, BOOL, "Nesterov momentum (sgd)", alias="nesterov")
    betas: tuple = key((0.9, 0.999), pair(number(0, 1, hi_open=True), "two numbers in [0, 1)"),
                       "the coefficients of Adam's running averages", alias="betas")
    eps: float = key(1e-8, POSITIVE, "term added to the denominator for numerical stability")
    group_lr: dict = key({}, mapping_of(POSITIVE, "a mapping of module-name prefix to lr > 0"),
                         "learning rate by module-name prefix, e.g. {backbone: 1e-4, head: 1e-2}", alias="group_lr")
    options: dict = key({}, MAPPING, "any other keyword arguments of the optimizer")


@dataclass
class SchedulerConfig:
    """The learning-rate schedule."""

    name: Optional[str] = key(None, optional(TEXT), "step, multistep, cosine, onecycle, warmup_cosine; null or "
                                                    "none: a constant learning rate", alias="scheduler")
    interval: Optional[str] = key(None, optional(choice("step", "epoch")),
                                  "step (every optimizer step) or epoch; null: step and multistep per epoch, the "
                                  "others per step; a scheduler object given is stepped as its class implies",
                                  alias="scheduler_interval")
    step_size: int = key(30, integer(1), "step: decay every this many intervals")
    gamma: float = key(0.1, POSITIVE, "step, multistep: the factor of each decay")
    milestones: list = key([], list_of(integer(1), "a list of integers >= 1"),
                           "multistep: the intervals at which to decay")
    warmup_steps: int = key(0, integer(0), "warmup_cosine: linear warm-up, in optimizer steps", alias="warmup_steps")
    min_lr: float = key(0.0, number(0), "cosine, warmup_cosine: the final learning rate")
    max_lr: Optional[float] = key(None, optional(POSITIVE), "onecycle: the peak learning rate; null: optim.lr")
    pct_start: float = key(0.3, number(0, 1, lo_open=True, hi_open=True),
                           "onecycle: the share of the cycle spent raising the learning rate")


@dataclass
class CheckpointConfig:
    """When checkpoints are saved and which are kept."""

    every_steps: int = key(0, integer(0), "save every N optimizer steps; 0: off", alias="checkpoint_every")
    every_epochs: int = key(1, integer(0), "save at the end of every N epochs; 0: off",
                            alias="checkpoint_every_epochs")
    keep_last: int = key(2, integer(1), "the most recent checkpoints kept", alias="keep_last")
    keep_best: int = key(1, integer(0), "the best checkpoints kept, by checkpoint.monitor (a tie: the lower loss of "
                                        "the same split, val/loss, then the later step)", alias="keep_best")
    monitor: Optional[str] = key(None, optional(TEXT), "the value that ranks checkpoints and early stopping, e.g. "
                                                       "val/accuracy; null: the first val metric, else val/loss",
                                 alias="monitor")
    mode: Optional[str] = key(None, optional(choice("min", "max")), "whether a lower (min) or higher (max) monitor "
                                                                    "is better; null: what the monitored metric declares, else "
                                                                    "inferred from its name",
                              alias="monitor_mode")
    save_final: bool = key(True, BOOL, "save a checkpoint when training ends")
    async_save: bool = key(True, BOOL, "write in a background thread (DCP async_save under FSDP2); training waits "
                                       "only for the copy to host memory")
    verify: bool = key(True, BOOL, "check every checkpoint file read against the sha256 its meta.json recorded, and "
                                   "refuse a checkpoint without that record; false: load unchecked (said on every load)")
    include_base: bool = key(False, BOOL, "with peft.method set: also save the frozen base model's weights (the whole "
                                          "model per checkpoint); false: the trained weights, their optimizer state "
                                          "and the base's identity (its config and a sha256 of its weights)")


@dataclass
class LogConfig:
    """Progress, metrics files, trackers and plots (rank 0)."""

    every_steps: int = key(50, integer(0), "progress lines and metrics.jsonl rows every N optimizer steps; 0: at "
                                           "epoch ends only", alias="log_every")
    progress: str = key("auto", choice("auto", "bar", "lines", "none"),
                        "auto (a bar on a terminal, plain lines otherwise), bar, lines or none", alias="progress")
    tensorboard: Union[bool, str] = key("auto", AUTO_BOOL, "TensorBoard event files; auto: when tensorboard is "
                                                           "installed", alias="tensorboard")
    plot: Union[bool, str] = key(True, Rule("true, false or 'inline'", _plot),
                                 "PNG curves (RUN_DIR/plots/curves.png), drawn before fit returns; inline: also shown "
                                 "in a Jupyter notebook's cell output; false: none", alias="plot")
    trackers: list = key([], list_of(choice(*TRACKERS), f"a list of {', '.join(TRACKERS)}"),
                         "experiment trackers: csv, tensorboard, mlflow, wandb", alias="trackers")
    mlflow_uri: Optional[str] = key(None, optional(TEXT), "MLflow tracking store; null: MLFLOW_TRACKING_URI, else "
                                                          "sqlite:///<run dir's parent>/mlruns/mlflow.db")
    project: Optional[str] = key(None, optional(TEXT), "MLflow experiment / W&B project; null: "
                                                       "MLFLOW_EXPERIMENT_NAME / WANDB_PROJECT, else torchrig")
    run_name: Optional[str] = key(None, optional(TEXT), "tracker run name; null: WANDB_NAME (W&B), else the run "
                                                        "directory's name")
    flops: bool = key(False, BOOL, "count FLOPs per sample once; rows get flops_per_s, and mfu on a known GPU",
                      alias="flops")
    summary: bool = key(True, BOOL, "print the model summary at the start of fit: top-level modules, parameters "
                                    "(trainable, frozen), sizes, memory of weights + gradients + optimizer state",
                        alias="summary")


@dataclass
class ProfileConfig:
    """torch.profiler over a few optimizer steps."""

    steps: list = key([], Rule("[] or [first, last] with 1 <= first <= last", _steps),
                      "[first, last] optimizer steps recorded with torch.profiler (RUN_DIR/profile); []: off")
    memory_snapshot: bool = key(False, BOOL, "also write a CUDA memory snapshot of those steps (GPU only)")


@dataclass
class DistConfig:
    """Several processes: the group, DDP and FSDP2 settings, stop signals."""

    strategy: str = key("auto", choice("auto", "none", "ddp", "dp", "fsdp"),
                        "auto (ddp with several processes, else none), none, ddp, dp (nn.DataParallel) or fsdp "
                        "(FSDP2)", alias="strategy")
    backend: Optional[str] = key(
        None, optional(pattern("a backend (gloo, nccl, mpi, ucc, xccl; per device: cpu:gloo,cuda:nccl)",
                               rf"{_BACKEND}(?:,{_BACKEND})*")),
        "process-group backend; null: by device (cpu:gloo,cuda:nccl)", alias="backend")
    init_method: Optional[str] = key(
        None, optional(pattern("a tcp://HOST:PORT, file:///PATH or env:// address",
                               r"(?:tcp://\S+:\d+|file:///\S+|env://\S*)")),
        "where the processes meet without torchrun, with dist.rank and dist.world_size", alias="init_method")
    rank: Optional[int] = key(None, optional(integer(0)), "this process's rank, with dist.init_method; null: from "
                                                          "torchrun's environment", alias="rank")
    world_size: Optional[int] = key(None, optional(integer(1)), "processes in the group, with dist.init_method; "
                                                                "null: from torchrun's environment",
                                    alias="world_size")
    timeout: float = key(1800.0, POSITIVE, "seconds a collective may wait", alias="dist_timeout")
    find_unused_parameters: bool = key(False, BOOL, "DDP: allow parameters that get no gradient in a step",
                                       alias="find_unused_parameters")
    static_graph: bool = key(False, BOOL, "DDP: the parameters used never change between steps",
                             alias="static_graph")
    bucket_cap_mb: Optional[float] = key(None, optional(POSITIVE), "DDP: gradient bucket size in MiB; null: "
                                                                   "PyTorch's default", alias="bucket_cap_mb")
    gradient_as_bucket_view: bool = key(True, BOOL, "DDP: gradients are views into its buckets (one copy less)")
    sync_batchnorm: bool = key(False, BOOL, "BatchNorm layers become SyncBatchNorm (statistics over all ranks)",
                               alias="sync_batchnorm")
    broadcast_buffers: Union[bool, str] = key("auto", AUTO_BOOL, "DDP's buffer broadcast at each forward; auto: "
                                                                 "off when the model has SyncBatchNorm",
                                              alias="broadcast_buffers")
    fsdp_wrap: list = key([], list_of(TEXT, "a list of module class names"),
                          "FSDP2: module class names sharded block by block", alias="fsdp_wrap")
    fsdp_min_params: int = key(0, integer(0), "FSDP2: or shard every module with at least this many parameters")
    fsdp_cpu_offload: bool = key(False, BOOL, "FSDP2: parameters and gradients kept in host memory")
    fsdp_reshard_after_forward: bool = key(True, BOOL, "FSDP2: free the gathered parameters after the forward")
    requeue: bool = key(False, BOOL, "Slurm: scontrol requeue the job after a signal's checkpoint")
    stop_timeout: float = key(10.0, POSITIVE, "seconds without progress after a stop signal before exiting without "
                                              "a checkpoint (a stuck step or peer)")
    hang_timeout: float = key(
        300.0, number(0),
        "seconds a training step, a collective or a data load may make no progress before every rank writes where it "
        "is (RUN_DIR/hang), rank 0 names the stuck ranks and their lines in one summary, and the job stops with exit "
        "code 75, keeping its checkpoints; until the first optimizer step, dist.timeout applies; 0: off")
    straggler_factor: float = key(
        2.0, number(1, lo_open=True),
        "at log steps, a rank whose own time per step (its data wait and its forward) exceeds the other ranks' median "
        "by this factor for dist.straggler_steps log steps in a row is named, with its host and device; every rank's "
        "figures go to metrics.jsonl")
    straggler_steps: int = key(3, integer(1), "log steps in a row a rank must be slow to be named a straggler")
    health_check: bool = key(
        False, BOOL, "before training: time a matmul and an allocation on every device, a ring exchange and an "
                     "all-reduce between the ranks, and stop, naming a device or host under half the others' median "
                     "(torchrig doctor --gpus)")
    fault_tolerance: str = key(
        "none", choice("none", "torchft"),
        "torchft: data-parallel replica groups (torchrig launch --replica-groups N, one process each) train on when "
        "one is lost, which torchrun restarts and which copies a live group's state; a lost group's share of a step "
        "is skipped, said in one line (docs/scaling-out.md); none: a lost process stops the run")


def _degree(v: Any) -> int:
    """A parallel degree: a positive integer, or -1 for "the ranks the other degrees leave"."""
    return accept(is_int(v) and (v >= 1 or v == -1), v)


DEGREE = Rule("an integer >= 1, or -1 for the ranks the other degrees leave", _degree)
AUTO_DEGREE = or_auto(DEGREE, "an integer >= 1, -1 (the rest) or 'auto'")


def _tp_plan(v: Any) -> Any:
    if v == "auto":
        return v
    accept(isinstance(v, dict) and len(v) > 0, v)
    return {accept(isinstance(k, str) and k.strip() != "", k): TEXT.check(s) for k, s in v.items()}


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")


def _pp_split(v: Any) -> Any:
    if v == "auto":
        return v
    if isinstance(v, str):  # --set parallel.pp_split=transformer.h.6,transformer.h.12
        v = [part.strip() for part in v.split(",")]
    accept(isinstance(v, (list, tuple)) and len(v) > 0, v)
    # an nn.Sequential's blocks are named 0, 1, ...: --set 'parallel.pp_split=[4]' means the block '4'
    return [str(k) if isinstance(k, int) and not isinstance(k, bool) else accept(isinstance(k, str) and k.strip() != "", k)
            for k in v]


@dataclass
class ParallelConfig:
    """How one model is spread over the processes: data-parallel replicas and shards, the context-parallel, the
    tensor-parallel and the pipeline-parallel degrees on one device mesh (their product is the world size)."""

    dp_replicate: Union[int, str] = key("auto", AUTO_DEGREE, "data-parallel replicas (DDP, or HSDP's replicas); "
                                                             "auto: the rest of the ranks under dist.strategy=ddp, "
                                                             "else 1", alias="dp_replicate")
    dp_shard: Union[int, str] = key("auto", AUTO_DEGREE, "data-parallel shards (FSDP2); auto: the rest of the ranks "
                                                         "under dist.strategy=fsdp, else 1", alias="dp_shard")
    cp: int = key(1, DEGREE, "context-parallel degree: ranks that split each sequence (PyTorch's context_parallel: "
                             "ring attention over F.scaled_dot_product_attention, load-balanced for causal attention); "
                             "they hold the same parameters and see the same samples", alias="cp")
    tp: int = key(1, DEGREE, "tensor-parallel degree: ranks that split each planned layer (parallel.tp_plan)",
                  alias="tp")
    pp: int = key(1, DEGREE, "pipeline-parallel degree: ranks that each hold consecutive blocks of the model "
                             "(parallel.pp_split), passing activations on; the accumulation window's micro-batches "
                             "are the pipeline's", alias="pp")
    pp_split: Union[list, str] = key(
        "auto", Rule("'auto' or a list of module names", _pp_split),
        "with pp > 1: the blocks where stages 2, 3, ... begin (e.g. [transformer.h.6]), or auto: the model's "
        "top-level sequence of blocks (an nn.Sequential, or its longest ModuleList not inside a block) cut into stages of about "
        "equal parameter count", alias="pp_split")
    pp_schedule: str = key("1f1b", choice(*PP_SCHEDULES),
                           "with pp > 1: the pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, "
                           "interleaved_1f1b and interleaved_zero_bubble (several stages per rank: "
                           "parallel.pp_stages_per_rank), zbv_zero_bubble (two stages per rank, in a V)",
                           alias="pp_schedule")
    pp_stages_per_rank: int = key(1, integer(1), "with pp > 1: stages each rank holds (interleaved schedules)",
                                  alias="pp_stages_per_rank")
    tp_plan: Union[dict, str, None] = key(
        None, optional(Rule("'auto' or a mapping of module-name patterns to styles", _tp_plan)),
        "with tp > 1: {module pattern: colwise, rowwise, colwise_rep, rowwise_rep, sequence_parallel, "
        "embedding_rowwise, embedding_colwise, colwise_loss_parallel}; auto: the model's own plan (its tp_plan "
        "attribute, or a Hugging Face config's base_model_tp_plan)", alias="tp_plan")
    loss_parallel: Union[bool, str] = key(
        "auto", AUTO_BOOL, "the cross-entropy of logits left split by class (an output layer planned "
        "colwise_loss_parallel) without gathering them; auto: on with such a layer and a cross-entropy loss",
        alias="loss_parallel")


def _targets(v: Any) -> Any:
    if v == "all-linear":
        return v
    if isinstance(v, str):  # --set peft.target_modules=c_attn,c_proj
        v = [part.strip() for part in v.split(",")]
    accept(isinstance(v, (list, tuple)) and len(v) > 0, v)
    return [accept(isinstance(k, str) and k.strip() != "", k) for k in v]


TARGETS = Rule("'all-linear' or a non-empty list of module-name patterns", _targets)
BASE_DTYPES = ("bf16", "fp16", "nf4", "fp4")


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning through the peft package: LoRA adapters train, the base model stays frozen."""

    method: Optional[str] = key(None, optional(choice("lora")),
                                "lora: low-rank adapters (peft's LoRA) on peft.target_modules train and the rest of the "
                                "model is frozen; checkpoints then hold what trains (checkpoint.include_base); null: "
                                "every parameter trains", alias="peft")
    r: int = key(8, integer(1), "LoRA rank: the inner size of each adapter", alias="lora_r")
    alpha: float = key(16.0, POSITIVE, "LoRA scale: an adapter's output is multiplied by alpha / r",
                       alias="lora_alpha")
    dropout: float = key(0.0, number(0, 1, hi_open=True), "dropout on the adapters' inputs")
    target_modules: Union[str, list] = key(
        "all-linear", TARGETS,
        "the modules that get adapters: all-linear (every Linear layer but a Hugging Face model's output layer), or "
        "module-name patterns (fnmatch on named_modules() names; a bare name such as c_attn matches at any depth)")
    modules_to_save: list = key([], list_of(TEXT, "a list of module-name patterns"),
                                "modules trained in full beside the adapters, e.g. a classification head (patterns as "
                                "in peft.target_modules)")
    base_dtype: Optional[str] = key(
        None, optional(choice(*BASE_DTYPES)),
        "the frozen base's weights: bf16 or fp16 (adapters and their optimizer state stay fp32; needs precision "
        "bf16 / fp16), nf4 or fp4 (4-bit through bitsandbytes: QLoRA, CUDA only); null: as the model was built")


QAT_SCHEMES = ("int8-dynamic-act-int4-weight", "int4-weight-only")


@dataclass
class QuantizeConfig:
    """Quantisation-aware training through torchao: training with fake-quantised Linear layers, then
    ``torchrig export --quantize`` converts them to quantised ones."""

    qat: Optional[str] = key(None, optional(choice(*QAT_SCHEMES)),
                             "torchao's QAT scheme: int8-dynamic-act-int4-weight (int8 activations per token, int4 "
                             "weights per group) or int4-weight-only (int4 weights per group); null: off", alias="qat")
    group_size: int = key(32, integer(1), "input features per weight quantisation group (each quantised Linear "
                                          "layer's in_features must be a multiple)")


FLOAT8_RECIPES = ("tensorwise", "rowwise")


@dataclass
class Float8Config:
    """float8 training through torchao: the model's Linear layers compute their matrix products in float8 (H100 and
    later); weights, gradients, optimizer state and checkpoints keep the model's own dtype."""

    recipe: Optional[str] = key(None, optional(choice(*FLOAT8_RECIPES)),
                                "torchao's float8 scaling: tensorwise (one scale per tensor, fastest) or rowwise (a scale "
                                "per row, closer to bf16); null: off", alias="float8")
    skip: list = key([], list_of(TEXT, "a list of module-name patterns"),
                     "Linear layers left in high precision besides the last one (the output head) and those whose "
                     "dimensions are not multiples of 16 (fnmatch patterns on named_modules() names)")
    fsdp_all_gather: bool = key(True, BOOL, "under FSDP2 with the tensorwise recipe, all-gather the weights in float8 "
                                            "(half the bytes of bf16), as torchao recommends; false: in their own "
                                            "dtype. torchao has no float8 all-gather for rowwise: there the weights "
                                            "are all-gathered in their own dtype")


__all__ = ["CheckpointConfig", "DataConfig", "DistConfig", "Float8Config", "LogConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig", "PeftConfig", "ProfileConfig", "QuantizeConfig", "SchedulerConfig", "SpikeConfig"]



@dataclass
class SpikeConfig:
    """What counts as a loss spike under ``on_spike: rollback``, and how far back a rollback goes."""

    factor: float = key(10.0, number(1, lo_open=True), "a step's loss or gradient norm above this multiple of its "
                                                        "mean over the last spike.window steps is a spike")
    window: int = key(50, integer(1), "optimizer steps whose mean loss and gradient norm a step is compared with")
    warmup_steps: int = key(10, integer(1), "steps of the run watched before any comparison (the statistics settle)")
    snapshot_every: int = key(10, integer(0), "optimizer steps between in-memory snapshots of the run (a copy of the "
                                              "weights and optimizer state) a rollback returns to; 0: the last "
                                              "checkpoint on disk")
    max_rollbacks: int = key(3, integer(1), "rollbacks in a row (without passing the spike's step) before the run "
                                            "stops")
