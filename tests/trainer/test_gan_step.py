"""A GAN step: the generator's backward must leave no gradient in the discriminator that D's next
optimizer step would add to its own. ``step.frozen`` keeps it out; the parameters after a few steps
equal a reference computed by hand with ``torch.autograd.grad``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchrig import Trainer

LR = 0.1
QUIET = dict(progress="none", plot=False, tensorboard=False, shuffle=False, batch_size=4, epochs=1,
             optimizer={"G": "sgd", "D": "sgd"}, lr=LR, momentum=0.0)


def _gan():
    torch.manual_seed(0)
    return nn.ModuleDict({"G": nn.Linear(3, 3), "D": nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))})


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)


def bce(logits, value):
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, value))


def _step(freeze: bool):
    def gan_step(step, batch):
        real, cond = batch
        G, D = step.models["G"], step.models["D"]
        with step.autocast():
            fake = G(cond)
            d_loss = bce(D(real), 1.0) + bce(D(fake.detach()), 0.0)
        step.backward(d_loss)
        step.optimizer_step("D")
        if freeze:
            with step.frozen("D") as D_fixed, step.autocast():
                g_loss = bce(D_fixed(fake), 1.0) + (fake - real).abs().mean()
        else:  # the leak: G's backward also fills D's .grad
            with step.autocast():
                g_loss = bce(D(fake), 1.0) + (fake - real).abs().mean()
        step.backward(g_loss)
        step.optimizer_step("G")
        return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}
    return gan_step


def _sgd(module, loss):
    grads = torch.autograd.grad(loss, list(module.parameters()))
    with torch.no_grad():
        for p, g in zip(module.parameters(), grads):
            p -= LR * g


def _reference(model, real, cond):
    G, D = copy.deepcopy(model["G"]), copy.deepcopy(model["D"])
    for i in range(0, len(real), 4):
        r, c = real[i:i + 4], cond[i:i + 4]
        fake = G(c)
        _sgd(D, bce(D(r), 1.0) + bce(D(fake.detach()), 0.0))
        _sgd(G, bce(D(fake), 1.0) + (fake - r).abs().mean())
    return G, D


def _close(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("freeze", [True, False])
def test_generator_loss_leaves_no_gradient_in_the_discriminator(tmp_path, freeze):
    model = _gan()
    real, cond = _data()
    G_ref, D_ref = _reference(model, real, cond)
    with Trainer(model, step_fn=_step(freeze), run_dir=str(tmp_path / "r"), **QUIET) as trainer:
        trainer.fit((real, cond))
    assert trainer.global_step == 2
    # without step.frozen, D's second step carries G's gradient (and G's second step then sees that D)
    assert _close(model["D"], D_ref) is freeze
    assert _close(model["G"], G_ref) is freeze
    assert all(p.requires_grad for p in model.parameters())  # frozen only inside the block


def test_frozen_names_and_errors():
    from torchrig.trainer.step import Step

    model = _gan()
    step = Step(model, {}, None, None, torch.device("cpu"), models=dict(model.items()))
    with step.frozen("D", model["G"]) as (D, G):
        assert D is model["D"] and G is model["G"]
        assert not any(p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="step.frozen: no model named 'E'; step.models holds G, D"):
        with step.frozen("E"):
            pass


def test_pix2pix_step_matches_a_hand_computed_reference(tmp_path):
    from torchrig.recipes import get_recipe
    from torchrig.recipes.pix2pix import gan_loss
    from torchrig.recipes.run import build_config

    cfg = build_config(None, ["pix2pix.ngf=2", "pix2pix.ndf=2", "pix2pix.d_layers=1", "pix2pix.dropout=0",
                              "pix2pix.channels_a=1", "pix2pix.channels_b=1", "pix2pix.image_size=8",
                              "optim.name=sgd", f"optim.lr={LR}", "optim.momentum=0", "optim.weight_decay=0",
                              "data.batch_size=4", "data.shuffle=false", "epochs=1", "log.progress=none",
                              "log.plot=false", "log.tensorboard=false", f"run_dir={tmp_path / 'p'}"], "pix2pix")
    recipe = get_recipe("pix2pix")
    torch.manual_seed(0)
    model = recipe.build_model(cfg)
    g = torch.Generator().manual_seed(2)
    a, b = torch.rand(8, 1, 8, 8, generator=g) * 2 - 1, torch.rand(8, 1, 8, 8, generator=g) * 2 - 1
    G, D = copy.deepcopy(model["G"]), copy.deepcopy(model["D"])
    gan, lam = gan_loss(cfg.pix2pix.gan_mode), cfg.pix2pix.lambda_l1
    for i in range(0, 8, 4):
        x, y = a[i:i + 4], b[i:i + 4]
        fake = G(x)
        _sgd(D, 0.5 * (gan(D(torch.cat([x, fake.detach()], 1)), False) + gan(D(torch.cat([x, y], 1)), True)))
        _sgd(G, gan(D(torch.cat([x, fake], 1)), True) + lam * F.l1_loss(fake, y))
    with Trainer(model, config=cfg, **recipe.trainer_kwargs(cfg, {})) as trainer:
        trainer.fit((a, b))
    assert trainer.global_step == 2
    assert _close(model["D"], D) and _close(model["G"], G)
    assert all(p.requires_grad for p in model.parameters())
