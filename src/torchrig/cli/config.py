"""``torchrig config [SECTION|KEY ...]``: every config key with its default, Trainer keyword, help and the
values it accepts, from the keys' declarations (the README's reference is written from the same)."""

from __future__ import annotations

import shutil

from . import add_common, register_command


def cmd_config(args) -> int:
    import torchrig.recipes  # noqa: F401  (registers the recipes' sections)

    from ..config.reference import listing

    print(listing(args.names, width=min(shutil.get_terminal_size((80, 24)).columns, 100)))
    return 0


@register_command
def _add(sub) -> None:
    p = sub.add_parser("config", help="list the config keys: default, Trainer keyword, help, accepted values",
                       description="List the config keys (YAML keys and --set KEY=VALUE): each key's default, the "
                                   "Trainer keyword that sets it, what it does and the values it accepts.")
    p.add_argument("names", nargs="*", metavar="SECTION|KEY", help="sections (optim) or keys (optim.lr) to list; "
                                                                   "none: every key")
    add_common(p)
    p.set_defaults(handler=cmd_config)
