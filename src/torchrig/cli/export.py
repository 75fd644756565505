"""``torchrig export``: a checkpoint's model as a torch.export program, ONNX, safetensors or a Hugging Face folder."""

from __future__ import annotations

from . import add_common, register_command


def cmd_export(args) -> int:
    from ..export import export_checkpoint

    done = export_checkpoint(args.checkpoint, args.format, args.output, inputs=args.input,
                             overrides=args.overrides, overwrite=args.overwrite, merge=args.merge,
                             quantize=args.quantize)
    print(done.line())
    return 0


@register_command
def _add(sub) -> None:
    from ..export import FORMATS

    p = sub.add_parser("export", help="export a checkpoint's model: torch-export (.pt2), onnx, safetensors, hf, "
                                      "adapter",
                       description="Write the model of a checkpoint in a format another runtime loads, load it "
                                   "back and check that it reproduces the model's outputs on example inputs "
                                   "(the first samples of the recipe's data, or --input) within 1e-5.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, run directory or .../latest")
    p.add_argument("--format", required=True, choices=list(FORMATS), metavar="FORMAT",
                   help="torch-export: a torch.export program (.pt2); onnx: ONNX through torch.onnx.export"
                        "(dynamo=True), checked in onnxruntime; safetensors: the weights; hf: save_pretrained "
                        "of a Hugging Face model (a folder); adapter: the peft adapter folder of a fine-tuned "
                        "checkpoint, for peft.PeftModel.from_pretrained(base, folder)")
    p.add_argument("--output", help="output file (a folder for hf); default RUN_DIR/export/CHECKPOINT.EXT")
    p.add_argument("--input", help="example inputs: a file or folder read as predict reads it (default: the first "
                                   "samples of the recipe's data)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--merge", action="store_true", help="a checkpoint of peft adapters: fold them into the base "
                                                        "(peft's merge_and_unload), checked against the adapted model, "
                                                        "and export the whole model")
    p.add_argument("--quantize", action="store_true", help="a quantize.qat checkpoint: convert its fake-quantised "
                                                           "layers (torchao), checked against them; with --format "
                                                           "torch-export")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of the checkpoint's config, as for evaluate (repeatable)")
    add_common(p)
    p.set_defaults(handler=cmd_export)
