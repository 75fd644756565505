""":func:`validate`: every key against its rule, then every check that involves several keys.

The checks here need nothing but the config. Those that need a fact of the run (the world size, the
model, the optimizer class, what was logged) are made where that fact is known, in the trainer.
"""

from __future__ import annotations

from ..errors import suggest
from .root import Config, declared_keys, get_key, sections
from .schema import ConfigError, check_value


def validate(cfg: Config) -> Config:
    """Check (and normalise) every declared key against its rule, then what no single key can express:
    the cross-key checks below, and each recipe section's own ``validate()`` method."""
    for k in declared_keys():
        section, _, name = k.name.rpartition(".")
        owner = get_key(cfg, section) if section else cfg
        setattr(owner, name, check_value(k.name, k.rule, getattr(owner, name)))
    for check in (_ranks, _resume, _trackers, _micro_batches, _mixture, _parallel, _finetune, _speed):
        check(cfg)
    for name in sections():
        section_check = getattr(getattr(cfg, name), "validate", None)
        if section_check is not None:
            section_check()
    return cfg


def _ranks(cfg: Config) -> None:
    d = cfg.dist
    if d.rank is not None and d.world_size is not None and d.rank >= d.world_size:
        raise ConfigError(f"config key 'dist.rank': expected an integer < dist.world_size ({d.world_size}), "
                          f"got {d.rank}")
    for key, value, other in (("rank", d.rank, "world_size"), ("world_size", d.world_size, "rank")):
        if value is not None and (getattr(d, other) is None or d.init_method is None):
            missing = [f"dist.{k}" for k in (other, "init_method") if getattr(d, k) is None]
            raise ConfigError(f"config key 'dist.{key}': {value} is used only with dist.{other} and dist.init_method "
                              f"(tcp://HOST:PORT or file:///PATH), and {' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not set; set them too, or start the job with "
                              f"torchrun (torchrig launch), which gives every process its rank")


def _resume(cfg: Config) -> None:
    if cfg.overwrite and cfg.resume in ("latest", "best"):
        raise ConfigError(f"config key 'overwrite': true would remove the run that resume={cfg.resume!r} continues; "
                          f"set one of them")


def _trackers(cfg: Config) -> None:
    if cfg.log.tensorboard is False and "tensorboard" in cfg.log.trackers:
        raise ConfigError("config key 'log.tensorboard': false, but log.trackers lists tensorboard; remove one of them")


def _micro_batches(cfg: Config) -> None:
    setting = cfg.data.micro_batch_size
    if setting is not None and cfg.loss_normalization == "micro_batches":
        raise ConfigError(f"config key 'data.micro_batch_size': {setting!r} needs loss_normalization auto, "
                          f"samples or tokens (micro_batches weighs every micro-batch alike, so cutting a "
                          f"batch would change the loss); set one of them, or data.micro_batch_size=null")
    if setting == "auto" and cfg.dist.strategy == "fsdp":
        raise ConfigError("config key 'data.micro_batch_size': 'auto' is not supported with dist.strategy=fsdp "
                          "(FSDP2's sharded gradients); set data.micro_batch_size to an integer")


def _mixture(cfg: Config) -> None:
    """``data.sources`` and ``data.mixture``: the weights name the sources, each of them, and nothing else."""
    d = cfg.data
    names = list(d.sources)
    if d.sources and d.path is not None:
        raise ConfigError(f"config key 'data.sources': {names} are the training data, and data.path "
                          f"'{d.path}' is set too; set one of them")
    bad = [n for n in names if "/" in n or n != n.strip()]
    if bad:
        raise ConfigError(f"config key 'data.sources': the name {bad[0]!r} holds '/' or spaces at its ends (it names "
                          f"the logged data/share/NAME); rename it")
    if d.mixture and not d.sources:
        raise ConfigError(f"config key 'data.mixture': {d.mixture} weighs the sources data.sources names, and "
                          f"data.sources is empty; set data.sources: {{name: folder or file}}")
    for name in d.mixture:
        if name not in d.sources:
            raise ConfigError(f"config key 'data.mixture': '{name}' is no name of data.sources ({', '.join(names)})"
                              f"{suggest(name, names)}")
    missing = [n for n in names if d.mixture and n not in d.mixture]
    if missing:
        raise ConfigError(f"config key 'data.mixture': data.sources '{missing[0]}' has no weight; give every source "
                          f"a weight, or remove it from data.sources")


def _parallel(cfg: Config) -> None:
    """What the degrees of ``parallel`` and ``dist.strategy`` can say without the world size (the product is
    checked against it when the mesh is built)."""
    p, strategy = cfg.parallel, cfg.dist.strategy
    degrees = {k: getattr(p, k) for k in ("dp_replicate", "dp_shard", "tp", "pp")}
    rest = [k for k, v in degrees.items() if v == -1]
    if len(rest) > 1:
        raise ConfigError(f"config key 'parallel.{rest[1]}': -1 (the rest of the ranks) is already given to "
                          f"parallel.{rest[0]}; give -1 to one degree at most")
    split = [f"parallel.{k}={degrees[k]}" for k in ("tp", "pp") if degrees[k] != 1]
    if strategy == "dp" and (split or degrees["dp_shard"] not in ("auto", 1)):
        what = split[0] if split else f"parallel.dp_shard={degrees['dp_shard']}"
        raise ConfigError(f"config key 'dist.strategy': 'dp' (nn.DataParallel, one process) cannot be combined with "
                          f"{what}; use dist.strategy=auto under torchrig launch")
    if strategy == "ddp" and degrees["dp_shard"] not in ("auto", 1):
        raise ConfigError(f"config key 'parallel.dp_shard': {degrees['dp_shard']} shards the model, but dist.strategy=ddp "
                          f"replicates it; set dist.strategy=fsdp (or auto), or parallel.dp_replicate instead")
    if p.tp != 1 and p.tp_plan is None:
        raise ConfigError(f"config key 'parallel.tp_plan': parallel.tp={p.tp} splits the layers a plan names, and no "
                          f"plan is set; set parallel.tp_plan=auto (the model's own plan) or a mapping such as "
                          f"{{'layers.*.fc1': colwise, 'layers.*.fc2': rowwise}}")
    if p.pp != 1:
        _pipeline(cfg)


def _pipeline(cfg: Config) -> None:
    """``parallel.pp``: what a pipeline cannot be combined with (the micro-batches against the schedule, the split
    against the model, are checked when the stages are built)."""
    p, pp = cfg.parallel, f"parallel.pp={cfg.parallel.pp}"
    single = p.pp_schedule in ("gpipe", "1f1b")
    if single and p.pp_stages_per_rank != 1:
        raise ConfigError(f"config key 'parallel.pp_stages_per_rank': {p.pp_stages_per_rank} stages per rank need a "
                          f"schedule that runs several (interleaved_1f1b, interleaved_zero_bubble, zbv_zero_bubble); "
                          f"parallel.pp_schedule={p.pp_schedule} runs one")
    if p.pp_schedule == "zbv_zero_bubble" and p.pp_stages_per_rank != 2:
        raise ConfigError(f"config key 'parallel.pp_stages_per_rank': {p.pp_stages_per_rank}, but "
                          f"parallel.pp_schedule=zbv_zero_bubble runs exactly 2 stages per rank (in a V); set "
                          f"parallel.pp_stages_per_rank=2")
    if cfg.data.micro_batch_size == "auto":
        raise ConfigError(f"config key 'data.micro_batch_size': 'auto' with {pp}: the out-of-memory halving re-runs a "
                          f"window on one rank, which a pipeline cannot; set data.micro_batch_size to an integer")
    if cfg.ema_decay is not None:
        raise ConfigError(f"config key 'ema_decay': an EMA of the weights is not supported with {pp} (each rank "
                          f"holds its stage's weights only); set ema_decay=null")
    if cfg.precision == "fp16":
        raise ConfigError(f"config key 'precision': fp16 with {pp}: each stage's GradScaler would decide on its own "
                          f"gradients whether a step overflowed; use precision=bf16 (no loss scaling) or fp32")
    if cfg.model.compile:
        raise ConfigError(f"config key 'model.compile': true with {pp}: the pipeline cuts the model's own forward at "
                          f"its blocks, which torch.compile cannot trace; set model.compile=false")


def _finetune(cfg: Config) -> None:
    """``peft`` and ``quantize``: what adapters and fake quantisation cannot be combined with."""
    p, q = cfg.peft, cfg.quantize
    if p.base_dtype is not None and p.method is None:
        raise ConfigError(f"config key 'peft.base_dtype': {p.base_dtype} casts the frozen base of an adapted model, "
                          f"and peft.method is null (nothing is frozen); set peft.method=lora, or peft.base_dtype=null")
    if p.base_dtype in ("bf16", "fp16") and cfg.precision != p.base_dtype:
        raise ConfigError(f"config key 'peft.base_dtype': {p.base_dtype} keeps the frozen base in {p.base_dtype} and the "
                          f"adapters in fp32, which only autocast computes together; set precision={p.base_dtype}")
    split = [f"parallel.{k}={getattr(cfg.parallel, k)}" for k in ("tp", "pp") if getattr(cfg.parallel, k) != 1]
    if p.method is not None and split:
        why = ("a tensor-parallel plan splits nn.Linear and nn.Embedding layers, and LoRA replaces them with peft's "
               "layers" if split[0].startswith("parallel.tp") else
               "each stage would have to save its own adapters and base identity, which torchrig does not do yet")
        raise ConfigError(f"config key 'peft.method': {p.method} with {split[0]} is not supported ({why}); use "
                          f"dist.strategy=ddp or fsdp (FSDP2 shards the frozen base)")
    if p.method is not None and cfg.ema_decay is not None:
        raise ConfigError(f"config key 'ema_decay': an EMA with peft.method={p.method} would average the frozen base "
                          f"too (a second copy of the whole model, in every checkpoint), which is not supported; set "
                          f"ema_decay=null")
    if q.qat is not None and p.method is not None:
        raise ConfigError(f"config key 'quantize.qat': {q.qat} with peft.method={p.method} is not supported (torchao's "
                          f"fake-quantised layers and peft's adapters would wrap the same Linear layers); set one of them")
    if q.qat is not None and split:
        raise ConfigError(f"config key 'quantize.qat': {q.qat} with {split[0]} is not supported (each rank would "
                          f"quantise its piece of a weight with scales of its own); use dist.strategy=ddp or fsdp")


def _speed(cfg: Config) -> None:
    """``model.compile_mode``, ``model.fused_head`` and ``float8``: what they cannot be combined with."""
    m, f8 = cfg.model, cfg.float8
    if m.compile_mode != "default" and not m.compile:
        raise ConfigError(f"config key 'model.compile_mode': {m.compile_mode} is torch.compile's mode, and "
                          f"model.compile is false; set model.compile=true too, or leave model.compile_mode=default")
    split = [f"parallel.{k}={getattr(cfg.parallel, k)}" for k in ("tp", "pp") if getattr(cfg.parallel, k) != 1]
    if m.fused_head is not None and (split or cfg.parallel.loss_parallel is True):
        what = split[0] if split else "parallel.loss_parallel=true"
        raise ConfigError(f"config key 'model.fused_head': {m.fused_head} with {what} is not supported (the fused head "
                          f"needs the whole vocabulary projection on one rank); set model.fused_head=null")
    if f8.recipe is not None and (cfg.quantize.qat is not None or cfg.peft.method is not None):
        other = f"quantize.qat={cfg.quantize.qat}" if cfg.quantize.qat is not None else f"peft.method={cfg.peft.method}"
        raise ConfigError(f"config key 'float8.recipe': {f8.recipe} with {other} is not supported (both replace the "
                          f"model's Linear layers); set one of them")
    if f8.recipe is not None and cfg.parallel.tp != 1:
        raise ConfigError(f"config key 'float8.recipe': {f8.recipe} with parallel.tp={cfg.parallel.tp} is not supported "
                          f"yet (the tensor-parallel plans would need torchao's float8 variants); use dist.strategy="
                          f"fsdp or ddp, or set float8.recipe=null")
    if f8.recipe is not None and cfg.precision == "fp16":
        raise ConfigError(f"config key 'float8.recipe': {f8.recipe} with precision=fp16 is not supported (float8 "
                          f"training keeps bf16 or fp32 around its matrix products); set precision=bf16")
