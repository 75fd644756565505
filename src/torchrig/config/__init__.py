"""Typed configuration: every key declared once, YAML files and ``--set a.b=c`` overrides.

Every key a user can write is a field of :class:`Config`, of one of its sections, or of a section
that a recipe adds with :func:`register_section` (``image``, ``text``, ``pix2pix`` …: this layer knows
no recipe). Each field is declared with :func:`key`: its type, default, rule, Trainer keyword and
help, from which the checks, the Trainer's keyword table, ``torchrig config`` and the README's
reference are derived. An unknown key is an error with the closest valid key suggested. Only the
standard library and PyYAML (imported lazily) are used here.

Modules: ``schema`` (how a key is declared), ``rules`` (the rules of values), ``sections`` (the
built-in sections), ``root`` (``Config``, the top-level keys and the recipe sections), ``coerce``
(values to a key's type), ``loading`` (YAML, overrides, mappings), ``checks`` (``validate``),
``reference`` (the listings), ``files`` (safe file reading).
"""

from __future__ import annotations

from .checks import validate
from .loading import flat_keys, from_dict, load_config, read_yaml, set_key, to_dict
from .root import Config, aliases, declared_keys, get_key, groups, near_keys, register_section, sections
from .schema import ConfigError, Key, Refused, Rule, key
from .sections import (CheckpointConfig, DataConfig, DistConfig, LogConfig, ModelConfig, OptimConfig,
                       ParallelConfig, PeftConfig, ProfileConfig, QuantizeConfig, SchedulerConfig)

# The rule of every key of the top-level and built-in sections (recipe sections bring their own).
RULES: dict[str, Rule] = {k.name: k.rule for k in declared_keys() if k.name.split(".")[0] not in sections()}

__all__ = [
    "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig", "SchedulerConfig", "CheckpointConfig",
    "LogConfig", "ProfileConfig", "DistConfig", "ParallelConfig", "PeftConfig", "QuantizeConfig", "load_config", "read_yaml", "to_dict", "from_dict", "flat_keys", "validate",
    "get_key", "set_key", "register_section", "sections", "key", "Key", "Rule", "Refused", "declared_keys",
    "aliases", "groups", "near_keys",
]
