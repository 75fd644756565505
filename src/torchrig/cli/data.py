"""``torchrig data …``: data tools. ``export-digits DIR`` writes the embedded digits as PNG class folders."""

from __future__ import annotations

from . import add_common, register_command


def cmd_export_digits(args) -> int:
    from ..data.datasets.images import export_digits

    counts = export_digits(args.dir, overwrite=args.overwrite)
    print(f"wrote {sum(counts.values())} PNG images to {args.dir}: "
          + ", ".join(f"{split}/ {n} (10 class folders)" for split, n in counts.items()))
    print(f"train on them: torchrig train --recipe image-classification --set data.path={args.dir}")
    return 0


@register_command
def _add(sub) -> None:
    p = sub.add_parser("data", help="data tools (export-digits)",
                       description="Data tools. export-digits writes the embedded 8x8 digits as PNG image folders.")
    add_common(p)
    actions = p.add_subparsers(dest="data_command", metavar="ACTION")
    actions.required = True
    e = actions.add_parser("export-digits", help="write the embedded digits as PNGs: DIR/{train,test}/<digit>/*.png",
                           description="Write the 1,797 embedded 8x8 digits as grayscale PNGs in class folders, "
                                       "DIR/train/<digit>/ and DIR/test/<digit>/ (the fixed 80/20 split): a real "
                                       "image folder for demos and tests of the image-classification recipe.")
    e.add_argument("dir", help="output folder (must not exist or be empty)")
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
    add_common(e)
    e.set_defaults(handler=cmd_export_digits)
