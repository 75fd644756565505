"""What a model returns and what its batches hold: the prediction, the loss and the forward inputs.

**Model outputs.** :func:`unpack` turns any output into ``(prediction, loss or None)``:

- a tensor is the prediction;
- a tuple or list: element ``output_key`` (default 0) is the prediction; without ``output_key``, a tuple
  whose first element is a scalar floating-point tensor followed by more is ``(loss, prediction, …)``
  (what Hugging Face models return with ``return_dict=False`` when given ``labels``);
- a dict or a Hugging Face ``ModelOutput``: ``output[output_key]`` (default ``"logits"``; a dict with
  one entry besides ``"loss"`` uses that one) is the prediction, and ``output["loss"]``, when present
  and not None, is the model's own loss.

**Which loss trains** (:func:`prediction_and_loss`): a loss the user names (``loss="mse"``) or passes
(``loss=nn.CrossEntropyLoss()``, any callable) is always used, called as ``loss(prediction,
target)``. With the default ``loss="auto"`` the model's own loss is used when its output carries one
(``BertForSequenceClassification`` or ``GPT2LMHeadModel`` given ``labels``), else cross-entropy of
the prediction; and the target of a dict batch is passed to ``forward`` as well when ``forward``
takes it (see below), so that such models compute their loss. The prediction feeds the metrics and
``predict``. A tuple output carries a loss only as its first element, as above.

**Batches.** A tuple ``(x, y)`` / ``(x1, …, xn, y)`` is inputs then target; a dict's target is
``batch[data.label_key]`` (default: the first of ``labels``, ``label``, ``target``, ``targets``,
``y`` present). With ``loss="auto"`` the target goes to ``forward`` under ``data.label_key`` when
``forward`` accepts that keyword, else under the first of those names that is a parameter of
``forward`` (``labels`` for Hugging Face models, whatever the batch calls it: :func:`label_keyword`).
The other keys of a dict reach ``forward`` (:func:`forward_arguments`): with ``data.input_keys``
set, exactly those keys, as keywords when ``forward`` has parameters of those names (or
``**kwargs``), else positionally in that order; otherwise every key ``forward``'s signature accepts
by name (all of them with ``**kwargs``; other keys are left out), and when it accepts none, a single
remaining key is passed positionally (``{"image", "label"}`` with ``forward(x)``). Anything else is
a :class:`BatchError` naming the batch keys, ``forward``'s signature and the config keys to set.

**Predict** batches carry no target. A tuple batch of n elements is n inputs when ``forward``
requires at least n positional arguments (``predict((x1, x2))`` with ``forward(a, b)``); otherwise
its last element is a target and is dropped (``(x, y)`` evaluation data with ``forward(x)`` or
``forward(x, mask=None)``). A dict batch loses its label key. :func:`predict_fields` keeps the
structure of the output (a tensor; a tuple; a dict for dicts and ``ModelOutput``) with its per-sample
tensor fields, and :func:`stack` / :func:`merge_ranks` concatenate them over batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import runtime
from ..data import unshard
from ..data.batches import BatchError, describe, forward_arguments
from ..errors import TorchrigError, setting
from ..optim.losses import AutoLoss, tensor_loss


class OutputError(TorchrigError, TypeError):
    """A model output torchrig cannot read a prediction or a loss from; the message says which key to set."""


@dataclass
class ModelIO:
    """The config keys that say how batches reach the model and which output is the prediction."""

    output_key: Any = None  # int (tuple outputs) or str (dict outputs); None: 0 / "logits"
    input_keys: Optional[tuple] = None  # dict batch keys passed to forward; None: by forward's signature
    label_key: Optional[str] = None  # the target's key in a dict batch; None: the first of LABEL_KEYS

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelIO":
        keys = cfg.data.input_keys
        return cls(cfg.output_key, tuple(keys) if keys is not None else None, cfg.data.label_key)


def uses_model_loss(loss_fn: Optional[Callable]) -> bool:
    """Whether no loss was chosen by the user (``loss="auto"``, or a Step without a loss)."""
    return loss_fn is None or isinstance(loss_fn, AutoLoss)


# ----------------------------------------------------------------------------- outputs


def unpack(output: Any, key: Any = None) -> tuple[Any, Optional[torch.Tensor]]:
    """``(prediction, model loss or None)`` of a model output (see the module docstring)."""
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, (tuple, list)):
        if key is None and len(output) > 1 and _is_scalar_loss(output[0]):
            return output[1], output[0]  # (loss, logits, …)
        index = 0 if key is None else key
        if not isinstance(index, int) or not -len(output) <= index < len(output):
            raise OutputError(f"output_key={key!r}: the model returned a {type(output).__name__} of "
                              f"{len(output)} elements; set output_key to an index in [0, {len(output) - 1}]")
        return output[index], None
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return _dict_prediction(output, key), loss
    if key is None:
        return output, None
    raise OutputError(f"output_key={key!r}: the model returned a {type(output).__name__}, not a tuple or dict; "
                      f"set output_key=null")


def _is_scalar_loss(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point()


def _dict_prediction(output: Mapping, key: Any) -> Any:
    if key is not None:
        if key not in output:
            raise OutputError(f"output_key={key!r}: the model's {type(output).__name__} has keys "
                              f"{list(output)}; set output_key to one of them")
        return output[key]
    if "logits" in output:
        return output["logits"]
    rest = [k for k in output if k != "loss"]
    if len(rest) == 1:
        return output[rest[0]]
    if not rest:
        return None  # only a loss: training works, metrics and predict need a prediction
    raise OutputError(f"the model returned a {type(output).__name__} with keys {list(output)} and no 'logits'; "
                      f"set output_key to the key of the prediction")


def prediction_and_loss(output: Any, target: Any, loss_fn: Optional[Callable], key: Any = None,
                        layout: Optional[Callable] = None) -> tuple[Any, torch.Tensor]:
    """The prediction, and the loss that trains: the user's loss if one was chosen, else the model's
    own (when its output carries one), else ``loss_fn`` (the cross-entropy of ``loss="auto"``). ``layout``:
    ``(prediction, target)`` as the loss takes them (a token model's class-last logits flattened)."""
    prediction, own = unpack(output, key)
    if own is not None and uses_model_loss(loss_fn):
        return prediction, own
    if loss_fn is None:
        raise OutputError("the model's output carries no loss and no loss is set; pass loss=NAME or a callable "
                          "to the Trainer, or return a 'loss' from the model")
    if not isinstance(prediction, torch.Tensor):
        raise OutputError(f"the loss needs a tensor prediction, got {type(prediction).__name__} from the model's "
                          f"output; set output_key to the prediction's index or key")
    try:
        return prediction, loss_fn(*(layout(prediction, target) if layout is not None else (prediction, target)))
    except (RuntimeError, IndexError, ValueError) as exc:
        raise explain_loss_error(exc, loss_fn, prediction, target) or exc


# ----------------------------------------------------------------------------- the class dimension
# PyTorch's losses and torchrig's metrics read classes in dimension 1: (batch, classes) or (batch, classes,
# positions…) against targets (batch, positions…). A token model (an LM, a tagger) returns (batch, positions,
# classes) instead. ``class_dim`` says which: 1, -1, or auto, decided once on the first batch.

def layouts(prediction: Any, ids: Any) -> tuple[bool, bool]:
    """Whether a sequence output ``prediction`` (3-D) fits, as ``(B, C, T)`` and as ``(B, T, C)``, an integer
    tensor ``ids`` ``(B, T)`` (class-index targets, or the token ids a token model was given). ``(False, False)``:
    no such pair (a 2-D output, float targets, an image's ``(N, C, H, W)``, read as PyTorch's unless ``class_dim``
    says otherwise)."""
    if not (isinstance(prediction, torch.Tensor) and isinstance(ids, torch.Tensor)) or prediction.ndim != 3 \
            or ids.ndim != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return False, False
    p, t = tuple(prediction.shape), tuple(ids.shape)
    return p[0] == t[0] and p[2] == t[1], p[:2] == t


def class_dim(given: Any, prediction: Any, ids: Any, hugging_face: bool, what: str = "targets") -> int:
    """1 or -1: where the classes of ``prediction`` are, by ``given`` (the config key ``class_dim``: 1, -1 or
    auto). Under auto a Hugging Face model's logits are class-last; otherwise an output that fits ``ids`` (``what``
    they are: targets, or predict's input ids) only with classes last is, one that fits both ways is a
    :class:`BatchError` naming the key (a (8, 6, 6) output and (8, 6) targets), anything else is PyTorch's."""
    if given in (1, -1):
        return given
    if hugging_face:
        return -1
    first, last = layouts(prediction, ids)
    if last and first:
        raise BatchError(f"the model's output {describe(prediction)} with {what} {describe(ids)} fits both "
                         f"(batch, classes, positions) and (batch, positions, classes): which dimension holds the "
                         f"classes cannot be told; set {setting('class_dim', 1)} (PyTorch's layout) or "
                         f"{setting('class_dim', -1)} (classes last)")
    return -1 if last else 1


def classes_last(prediction: Any, target: Any) -> tuple[Any, Any]:
    """``(prediction, target)`` of a class-last output as a class-index loss takes them: one row per position,
    ``(N·T, C)`` against ``(N·T,)`` (or against ``(N·T, C)`` class probabilities); anything else as it is."""
    if not (isinstance(prediction, torch.Tensor) and isinstance(target, torch.Tensor)) or prediction.ndim < 3:
        return prediction, target
    if target.ndim == prediction.ndim - 1:
        return prediction.flatten(0, -2), target.flatten()
    if target.shape == prediction.shape:
        return prediction.flatten(0, -2), target.flatten(0, -2)
    return prediction, target


# ----------------------------------------------------------------------------- errors a batch causes
# The model and the loss raise torch's own words when a batch does not fit them ("mat1 and mat2 shapes cannot
# be multiplied (64x5 and 4x8)", "Target 5 is out of bounds."). These turn the common cases into one line that
# shows the batch and what the model or the loss takes. They run only once something has failed.


def _first_layer(model: Any) -> str:
    """What the model's first Linear / Conv / Embedding layer takes, in words ('' when none is found)."""
    module = runtime.unwrap(model) if isinstance(model, nn.Module) else None
    for name, m in (module.named_modules() if module is not None else []):
        weight = getattr(m, "weight", None)
        dtype = str(weight.dtype).replace("torch.", "") if isinstance(weight, torch.Tensor) else "float"
        shown = f"its first layer '{name}' ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
        if isinstance(m, nn.Linear):
            return f"{shown} takes {dtype} inputs with {m.in_features} features in the last dimension"
        if isinstance(m, nn.modules.conv._ConvNd):
            return f"{shown} takes {dtype} inputs with {m.in_channels} channels in dimension 1"
        if isinstance(m, nn.Embedding):
            return f"{shown} takes integer ids below {m.num_embeddings}"
    return ""


_DTYPE_WORDS = ("dtype", "scalar type", "input type", "double and float", "float and double", "should be the same")
_SHAPE_WORDS = ("shape", "size", "channels", "dimension", "dimensional", "expected input")


def explain_forward_error(exc: BaseException, model: Any, inputs: Any) -> Optional["BatchError"]:
    """One line for a forward that failed because the inputs' dtype or shape does not fit the model."""
    text = str(exc).strip()
    low = text.lower()
    if (isinstance(exc, (torch.OutOfMemoryError, getattr(torch.distributed, "DistError", ())))
            or not isinstance(exc, RuntimeError) or "out of memory" in low):
        return None  # the micro-batcher's and the collectives' own errors
    if any(w in low for w in _DTYPE_WORDS):
        todo = "convert the inputs to the model's dtype (x.float()) where the data is made"
    elif any(w in low for w in _SHAPE_WORDS):
        todo = ("make the data's inputs fit the model (their shape, the number of features or channels) or change "
                "the model")
    else:
        return None
    layer = _first_layer(model)
    return BatchError(f"the model's forward failed on a batch of inputs {describe(inputs)}: "
                      f"{text.splitlines()[0][:300]}; {layer + ': ' if layer else ''}{todo}")


def explain_step_error(exc: BaseException, model: Any, inputs: Any, loss_fn: Any, output: Any,
                       target: Any) -> Optional["BatchError"]:
    """:func:`explain_forward_error` when the forward raised (no ``output`` yet), else :func:`explain_loss_error`."""
    if output is None:
        return explain_forward_error(exc, model, inputs)
    return explain_loss_error(exc, loss_fn, output, target)


_MODULE_LOSSES = {"CrossEntropyLoss": "cross_entropy", "NLLLoss": "nll", "MSELoss": "mse", "L1Loss": "l1",
                  "SmoothL1Loss": "smooth_l1", "HuberLoss": "huber", "BCEWithLogitsLoss": "bce_with_logits",
                  "BCELoss": "bce"}
CLASS_INDEX_LOSSES = ("cross_entropy", "nll")  # PyTorch's losses over class indices, classes in dimension 1
_ELEMENTWISE = ("mse", "l1", "smooth_l1", "huber", "bce_with_logits", "bce")


def reads_class_indices(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is PyTorch's cross-entropy or NLL loss (``loss: cross_entropy`` / ``nll`` / ``auto``,
    ``nn.CrossEntropyLoss()``, ``F.cross_entropy`` ...), which reads the classes in dimension 1; a function of
    the user's, whatever its name, is not."""
    fn = tensor_loss(loss_fn)  # a named loss (auto: its cross-entropy): the torch function it calls
    if isinstance(fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return True
    return getattr(fn, "func", fn) in (F.cross_entropy, F.nll_loss)  # functools.partial(F.cross_entropy, …)


def loss_name(loss_fn: Any) -> str:
    """The loss's name as the config key ``loss`` says it, for messages (``cross_entropy``, ``mse`` ...);
    PyTorch's loss modules and functions by the same names (``nn.MSELoss()``, ``F.mse_loss``: ``mse``)."""
    loss_fn = getattr(loss_fn, "fallback", loss_fn)  # AutoLoss: its cross-entropy
    if type(loss_fn).__name__ in _MODULE_LOSSES and isinstance(loss_fn, nn.Module):
        return _MODULE_LOSSES[type(loss_fn).__name__]
    name = getattr(loss_fn, "name", None) or getattr(getattr(loss_fn, "func", loss_fn), "__name__", None)
    return str(name or type(loss_fn).__name__).replace("_loss", "")


def loss_words(given: Any, configured: str) -> str:
    """The run's loss as the user named it, for a line: the config's ``loss`` (a name, or the ``MODULE:FN`` the
    command line built ``given`` from), else the object given in Python (``lm_loss``, ``CrossEntropyLoss()``)."""
    if given is None or ":" in configured:
        return configured
    if isinstance(given, nn.Module):
        return f"{type(given).__name__}()"
    return str(getattr(given, "__name__", type(given).__name__))


def _loss_words(loss_fn: Any) -> str:
    """``the loss mse (config key 'loss')`` for a named loss, ``the loss MSELoss()`` for the user's module."""
    if isinstance(loss_fn, nn.Module):
        return f"the loss {type(loss_fn).__name__}()"
    fn = getattr(loss_fn, "func", loss_fn)  # a partial of F.cross_entropy: the named loss's own function
    if isinstance(loss_fn, AutoLoss) or getattr(loss_fn, "name", None) or \
            getattr(fn, "__module__", "") == "torch.nn.functional":
        return f"the loss {loss_name(loss_fn)} (config key 'loss')"
    return f"the loss {getattr(loss_fn, '__name__', type(loss_fn).__name__)}"


def _elementwise_fit(prediction: torch.Tensor, target: torch.Tensor) -> str:
    """What would fit an element-wise loss given class-index-looking or mis-shaped targets."""
    if not target.is_floating_point() and target.ndim == prediction.ndim - 1 and prediction.shape[-1] > 1:
        return (f"these look like class indices for {prediction.shape[-1]} classes: use loss=cross_entropy "
                f"(nn.CrossEntropyLoss()), or give targets shaped {tuple(prediction.shape)}")
    if target.numel() == prediction.numel():
        dims = ", ".join(str(d) for d in prediction.shape)
        return f"give targets shaped {tuple(prediction.shape)} (y.view({dims}))"
    return f"give targets shaped like the output, {tuple(prediction.shape)}, or a model with that many outputs"


def check_loss_fit(loss_fn: Any, prediction: Any, target: Any) -> None:
    """At the first step: a loss that would train on nothing or on the wrong pairs without an error.

    Cross-entropy over one output is 0 whatever the model does; PyTorch's element-wise losses given an output
    and a target of different shapes broadcast them (``(N, 1)`` against ``(N,)`` gives ``N × N`` pairs) with
    only a warning. Shapes only: nothing is read from the device."""
    if not (isinstance(prediction, torch.Tensor) and isinstance(target, torch.Tensor)) or loss_fn is None:
        return
    name = loss_name(loss_fn)
    words = _loss_words(loss_fn)
    if name in CLASS_INDEX_LOSSES and prediction.ndim >= 2 and prediction.shape[1] == 1 \
            and not target.is_floating_point():
        raise BatchError(f"{words} over the model's output {describe(prediction)} with targets {describe(target)}: "
                         f"over a single output it is 0 whatever the model does; for two classes use "
                         f"loss=bce_with_logits with targets 0./1. (y.float()), or give the model one output per "
                         f"class")
    if (name in _ELEMENTWISE and prediction.shape != target.shape and getattr(loss_fn, "float_target", None) is None
            and isinstance(loss_fn, nn.Module)):
        try:
            broadcast = tuple(torch.broadcast_shapes(prediction.shape, target.shape))
        except RuntimeError:
            return  # PyTorch raises, and explain_loss_error says it
        raise BatchError(f"{words} compares the model's output {describe(prediction)} with targets "
                         f"{describe(target)} element by element; PyTorch would broadcast them to {broadcast}, "
                         f"a wrong loss; {_elementwise_fit(prediction, target)}")


def explain_loss_error(exc: BaseException, loss_fn: Any, prediction: Any, target: Any) -> Optional["BatchError"]:
    """One line for a loss given an output and targets it cannot take: the output's and the targets' shapes
    and dtypes, the loss, and what would fit (class indices out of range or float, a 2-D target, a 1-output
    model under cross-entropy; an element-wise loss given class labels or another shape)."""
    if not (isinstance(prediction, torch.Tensor) and isinstance(target, torch.Tensor)):
        return None
    name = loss_name(loss_fn)
    key = _loss_words(loss_fn)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    pair = f"the model's output is {describe(prediction)} and the targets are {describe(target)}"
    if name in _ELEMENTWISE:
        return BatchError(f"{key} compares the output with targets of the same shape, but {pair} ({text}); "
                          f"{_elementwise_fit(prediction, target)}")
    if name not in CLASS_INDEX_LOSSES:
        return None
    classes = prediction.shape[1] if prediction.ndim >= 2 else None
    if "out of bounds" in text and classes is not None:
        t = target.detach()
        bad = int(t.max()) if int(t.max()) >= classes else int(t.min())
        fit = (f"for two classes use loss=bce_with_logits with targets 0./1. (y.float()); for more, give the model "
               f"one output per class ({bad + 1} or more)" if classes == 1 else
               f"check the labels, or give the model one output per class ({bad + 1} or more)")
        return BatchError(f"{key}: {pair}; the targets hold class {bad}, outside the model's {classes} output"
                          f"{'s' if classes != 1 else ''} (classes 0 to {classes - 1}); {fit}")
    if target.is_floating_point() and target.shape != prediction.shape:
        return BatchError(f"{key} takes integer class indices as targets, but {pair}; convert them (y.long()), or "
                          f"choose a loss for float targets (loss=mse, loss=bce_with_logits)")
    if target.ndim == prediction.ndim and target.shape != prediction.shape:
        return BatchError(f"{key} takes one class index per sample (shape {tuple(prediction.shape[:1])}) or class "
                          f"probabilities shaped like the output {tuple(prediction.shape)}, but {pair}; give one "
                          f"label per sample")
    if prediction.ndim >= 3 and prediction.ndim == target.ndim + 1 and tuple(prediction.shape[:-1]) == \
            tuple(target.shape):  # a token model's (batch, positions, classes), which PyTorch reads as (N, C, d)
        return BatchError(f"{key}: {pair}: an output of (batch, positions, classes) with a class per position, but "
                          f"the classes are read in dimension 1 (class_dim=1); set {setting('class_dim', -1)} "
                          f"(classes last), or have the model return its own loss (loss=auto takes it)")
    if ("target" in text.lower() or "size" in text.lower()) and classes is not None:
        return BatchError(f"{key} cannot take these targets: {pair} ({text}); give one class index in "
                          f"[0, {classes - 1}] per sample")
    return None


def call_model(model: Callable, inputs: Any, input_keys: Optional[tuple] = None,
               labels: Optional[tuple] = None) -> Any:
    """``model(inputs)``: a dict through :func:`forward_arguments`, a tuple spread, anything else as one."""
    if isinstance(inputs, dict):
        args, kwargs = forward_arguments(model, inputs, input_keys, labels)
    elif input_keys is not None:
        raise BatchError(f"data.input_keys={list(input_keys)} names keys of dict batches, but the batches are "
                         f"{describe(inputs)}, not a dict; remove data.input_keys (or give batches as dicts)")
    else:
        args, kwargs = inputs if isinstance(inputs, tuple) else (inputs,), {}
    try:
        return model(*args, **kwargs)
    except RuntimeError as exc:
        raise explain_forward_error(exc, model, inputs) or exc
    except TypeError as exc:
        if not (isinstance(inputs, tuple) and "forward() takes" in str(exc)):
            raise
        raise BatchError(f"the batch's inputs are {len(inputs)} tensors {describe(inputs)}, each passed to forward "
                         f"as one argument, but {type(runtime.unwrap(model)).__name__}.forward() does not take "
                         f"{len(inputs)} ({str(exc).strip()}); a tuple or list of tensors is read as columns "
                         f"(inputs…, target): give (x, y), or a forward taking each input") from None


# ----------------------------------------------------------------------------- predict


PREDICT_OUTPUTS = ("prediction", "all")


class Activation:
    """What ``predict`` applies to the prediction: ``softmax`` over the classes (dimension ``dim``: 1, or -1 for a
    token model's ``(batch, positions, classes)``, see :func:`class_dim`), ``sigmoid`` or ``exp`` element-wise,
    ``none``. ``activation(t)`` alone takes the classes in dimension 1 (a 1-D ``t``: its only one)."""

    def __init__(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor]):
        self.name, self.fn = name, fn
        self.over_classes = name == "softmax"  # needs the class dimension

    def __call__(self, t: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
        if self.over_classes:
            return t.softmax(dim=(1 if t.ndim >= 2 else -1) if dim is None else dim)
        return self.fn(t)

    def __repr__(self) -> str:
        return f"Activation({self.name})"


def _activate(activation: Callable, t: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    return activation(t, dim) if isinstance(activation, Activation) else activation(t)


def predict_prediction(output: Any, key: Any, activation: Callable, dim: Optional[int] = None) -> torch.Tensor:
    """One batch's prediction field on the CPU, the activation applied (over class dimension ``dim``): what
    ``predict`` returns by default, whatever the output's structure (the field the loss and the metrics use, see
    :func:`unpack`)."""
    if isinstance(output, torch.Tensor):
        return _activate(activation, output.float(), dim).cpu()
    prediction, _ = unpack(output, key)
    if not isinstance(prediction, torch.Tensor):
        raise OutputError(f"predict: the model's {type(output).__name__} output holds no prediction tensor (only "
                          f"{describe(output)}); set output_key to the prediction's index or key, or call "
                          f"predict(data, outputs=\"all\") for the whole output")
    return _activate(activation, prediction.float(), dim).detach().cpu()


def predict_fields(output: Any, key: Any, activation: Callable, n: int, dim: Optional[int] = None) -> Any:
    """One batch's prediction on the CPU: the activation applied to the prediction (over class dimension
    ``dim``), and for tuple / dict outputs the same structure with every per-sample tensor (first dimension
    ``n``); other fields (a loss, a key/value cache) are left out (None in a tuple, so that indices stay)."""
    if isinstance(output, torch.Tensor):
        return _activate(activation, output.float(), dim).cpu()
    if isinstance(output, (tuple, list)):
        unpack(output, key)  # checks the index
        index = (0 if key is None else key) % len(output)
        return tuple(_field(v, n, activation if i == index else None, dim) for i, v in enumerate(output))
    if isinstance(output, Mapping):
        pred = _dict_prediction(output, key)
        fields = {k: _field(v, n, activation if v is pred else None, dim) for k, v in output.items() if k != "loss"}
        return {k: v for k, v in fields.items() if v is not None}
    return output


def _field(value: Any, n: int, activation: Optional[Callable], dim: Optional[int]) -> Optional[torch.Tensor]:
    if not (isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == n):
        return None
    if activation is not None:
        value = _activate(activation, value.float(), dim)
    return value.detach().cpu()


def stack(outputs: list) -> Any:
    """The batches' predictions as one: tensors concatenated; tuples / dicts field by field; other
    outputs (a custom ``predict_fn``'s) as a flat list."""
    if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
        return torch.cat(outputs)
    if outputs and all(isinstance(o, tuple) and all(v is None or isinstance(v, torch.Tensor) for v in o)
                       for o in outputs):
        return tuple(None if any(o[i] is None for o in outputs) else torch.cat([o[i] for o in outputs])
                     for i in range(len(outputs[0])))
    if outputs and all(isinstance(o, dict) for o in outputs) and all(
            isinstance(v, torch.Tensor) for o in outputs for v in o.values()):
        return {k: torch.cat([o[k] for o in outputs]) for k in outputs[0]}
    return [x for o in outputs for x in (o if isinstance(o, list) else [o])]


def _place(parts: list, positions: list) -> list:
    """Items of every part at their positions (all positions 0 … n-1 once, over all parts)."""
    order: list = [None] * sum(len(p) for p in parts)
    for part, where in zip(parts, positions):
        for item, i in zip(part, where.tolist()):
            order[i] = item
    return order


def merge_ranks(parts: list, world_size: int, positions: Optional[list] = None) -> Any:
    """Every rank's stacked predictions (rank r holds samples r, r+W, …) back in data order, per field.
    A rank without samples sends ``[]``. With ``positions`` (per rank, each sample's position in a
    stream, see ``data.iterable_eval``) every sample goes to its position instead."""
    shape = next((p for p in parts if not (isinstance(p, list) and not p)), None)
    if isinstance(shape, tuple):
        return tuple(None if f is None else merge_ranks([p[i] if isinstance(p, tuple) else [] for p in parts],
                                                        world_size, positions) for i, f in enumerate(shape))
    if isinstance(shape, dict):
        return {k: merge_ranks([p[k] if isinstance(p, dict) else [] for p in parts], world_size, positions)
                for k in shape}
    order = unshard(parts, world_size) if positions is None else _place(parts, positions)
    if isinstance(shape, torch.Tensor):
        return torch.stack(order) if order else shape[:0]
    return order
