"""Speed settings of a run: backend switches, memory format, activation checkpointing, torch.compile.

Each default is the one a performance engineer picks on a GPU and changes nothing on a CPU run:
``cudnn.benchmark`` and TF32 matmuls unless the run is deterministic, ``channels_last`` for
convolutional models. A value the user chose (a config key, or ``torch.set_float32_matmul_precision``
called before the Trainer) is kept.
"""

from __future__ import annotations

import os
import types
from typing import Any, Optional, Union

import torch
from torch import nn

from ..errors import TorchrigError, suggest


class AccelConfigError(TorchrigError, ValueError):
    """A speed setting names something the model does not have."""


def configure_backends(deterministic: bool = False, cudnn_benchmark: Union[bool, str] = "auto",
                       device: Any = None) -> None:
    """cuDNN autotuning and TF32 matmuls on CUDA (``auto``), never in a deterministic run.

    ``cudnn_benchmark`` true / false is applied as given (off anyway when deterministic); ``auto`` turns it
    on for a CUDA run only. TF32 (``set_float32_matmul_precision("high")``) is set for a CUDA run unless the
    run is deterministic or the process already chose: a precision other than the default ``highest``, or
    ``torch.backends.cuda.matmul.fp32_precision`` set to ``ieee`` or ``tf32`` (PyTorch's newer switch).
    """
    cuda = device is not None and torch.device(device).type == "cuda"
    if cudnn_benchmark == "auto":
        if cuda:
            torch.backends.cudnn.benchmark = not deterministic
    else:
        torch.backends.cudnn.benchmark = bool(cudnn_benchmark) and not deterministic
    if cuda and not deterministic and not user_chose_matmul_precision():
        torch.set_float32_matmul_precision("high")
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        if torch.get_float32_matmul_precision() == "high" and cuda:
            torch.set_float32_matmul_precision("highest")


def user_chose_matmul_precision() -> bool:
    """Whether this process already chose how float32 matrix products run (``torch.set_float32_matmul_precision``
    or ``torch.backends.cuda.matmul.fp32_precision``), which torchrig then leaves as it is."""
    chosen = getattr(getattr(torch.backends.cuda, "matmul", None), "fp32_precision", "none")
    return chosen in ("ieee", "tf32") or torch.get_float32_matmul_precision() != "highest"


def tf32_in_force() -> bool:
    """Whether float32 matrix products run on TF32 tensor cores (what ``set_float32_matmul_precision("high")``
    or ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` chose)."""
    chosen = getattr(getattr(torch.backends.cuda, "matmul", None), "fp32_precision", None)
    if chosen in ("tf32", "ieee"):
        return chosen == "tf32"
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


_STRIDE_ERROR = "view size is not compatible with input tensor's size and stride"


def channels_last_breaks(model: nn.Module, forward: Any, device: Any) -> Optional[str]:
    """Whether ``model`` cannot run with channels_last weights: one probe ``forward()`` (give it a one-row batch)
    in eval mode, without gradients and with the random generators untouched. Returns the error's first line
    when the forward fails on the memory format (a ``.view`` of a convolution's output), else None; any other
    error is left for the training step to report in its own words."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            forward()
    except Exception as exc:  # noqa: BLE001 - any other error is the training step's to report
        return _STRIDE_ERROR if _STRIDE_ERROR in str(exc) else None
    finally:
        for m, training in modes:
            m.training = training
    return None


def has_conv(model: nn.Module) -> bool:
    """Whether the model has a 2-D convolution (the layers channels_last speeds up)."""
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def wants_channels_last(model: nn.Module, setting: Union[bool, str], device: Any) -> bool:
    """``model.channels_last``: true / false as given; ``auto``: on for a conv model on CUDA."""
    if setting == "auto":
        return torch.device(device).type == "cuda" and has_conv(model)
    return bool(setting)


def apply_activation_checkpointing(model: nn.Module, names: Union[list, str]) -> list[str]:
    """Recompute the forward of each named sub-module in backward (``torch.utils.checkpoint``, non-reentrant).

    ``names``: sub-module names; ``full``: every block of the model's sequence of blocks (``longest_blocks``);
    ``selective``: the same blocks, keeping the outputs of their matrix products (``SAVED_OPS``) and recomputing
    the rest. The sub-modules keep their class and parameter names (only their ``forward`` is wrapped), so the
    weights and checkpoints are those of the plain model. Returns the names wrapped.
    """
    if not names:
        return []
    if names in ("full", "selective"):
        return _wrap_blocks(model, names)
    modules = dict(model.named_modules())
    for name in names:
        sub = modules.get(name)
        if sub is None or sub is model:
            known = [n for n in modules if n]
            listing = "sub-modules: " + ", ".join(known[:12]) + (" …" if len(known) > 12 else "")
            raise AccelConfigError(f"model.activation_checkpointing: {name!r} is not a sub-module of "
                                   f"{type(model).__name__}{suggest(name, known, listing=listing)}")
        _wrap(sub, None)
    return list(names)


def _wrap_blocks(model: nn.Module, kind: str) -> list[str]:
    from .modules import longest_blocks

    found = longest_blocks(model)
    if found is None:
        raise AccelConfigError(f"model.activation_checkpointing: {kind} recomputes each block of the model's sequence "
                               f"of blocks, and {type(model).__name__} has none (an nn.Sequential, or an "
                               f"nn.ModuleList of two or more); name the sub-modules to recompute instead, e.g. "
                               f"model.activation_checkpointing=[encoder]")
    prefix, container = found
    context = _selective_context if kind == "selective" else None
    for sub in container.children():
        _wrap(sub, context)
    return [f"{prefix}.{k}" if prefix else k for k in container._modules]


def _wrap(sub: nn.Module, context: Any) -> None:
    if not getattr(sub, "_torchrig_checkpointed", False):
        # a method bound to the sub-module: a deepcopy of the model rebinds it to the copy
        sub.forward = types.MethodType(_checkpointed_forward, sub)
        sub._torchrig_checkpointed = True
        sub._torchrig_checkpoint_context = context


def checkpointing_line(model: nn.Module, setting: Union[list, str]) -> Optional[str]:
    """The start line of ``model.activation_checkpointing: full | selective``: which blocks are recomputed."""
    from .modules import longest_blocks

    found = longest_blocks(model) if setting in ("full", "selective") else None
    if found is None:
        return None
    prefix, container = found
    keys = [f"{prefix}.{k}" if prefix else k for k in container._modules]
    what = "keeping their matrix products' outputs" if setting == "selective" else "each recomputed whole"
    return (f"torchrig: activation checkpointing ({setting}) on {len(keys)} block{'s' if len(keys) != 1 else ''} "
            f"({keys[0]}{f' … {keys[-1]}' if len(keys) > 1 else ''}), {what}")


def _saved_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _save_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing's policy: a matrix product's output is kept, everything else recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_products)


SAVED_OPS = _saved_ops()  # the ops whose outputs selective checkpointing keeps


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    context = getattr(self, "_torchrig_checkpoint_context", None) or noop_context_fn
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def compile_models(wrapped: nn.Module, models: dict, base: nn.Module,
                   mode: str = "default") -> tuple[nn.Module, dict]:
    """``torch.compile`` the module the loop calls, in ``mode`` (``model.compile_mode``); for several networks (a GAN's
    ``ModuleDict``) each one.

    A ``ModuleDict`` has no forward of its own, so compiling it would compile nothing: each sub-model is
    compiled instead, and the ``ModuleDict`` stays the container. ``no_sync`` and ``unwrap`` look through
    the compiled wrapper (``_orig_mod``). ``default`` is passed as no mode at all (torch.compile's own default).
    """
    kwargs = {} if mode == "default" else {"mode": mode}
    if models and (isinstance(wrapped, nn.ModuleDict) or wrapped is base):
        return wrapped, {k: torch.compile(m, **kwargs) for k, m in models.items()}
    return torch.compile(wrapped, **kwargs), models


CUDA_GRAPH_MODES = ("reduce-overhead",)  # torch.compile's modes that record CUDA graphs


def compile_line(mode: str, device: Any, drop_last: bool) -> Optional[str]:
    """The start line of ``model.compile_mode``: CUDA graphs replay one recorded shape, so the short last batch of an
    epoch is dropped (``drop_last`` says whether the user had asked for it already); on another device they do not
    apply and the model is compiled without them. None when there is nothing to say."""
    if mode not in CUDA_GRAPH_MODES:
        return None
    if torch.device(device).type != "cuda":
        return (f"torchrig: model.compile_mode={mode}: CUDA graphs only apply on CUDA; on {torch.device(device).type} "
                f"the model is compiled without them")
    if drop_last:
        return None
    return (f"torchrig: model.compile_mode={mode} replays CUDA graphs of one batch shape, so the short last training "
            f"batch of each epoch is dropped (data.drop_last=true)")
