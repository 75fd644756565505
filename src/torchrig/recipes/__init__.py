"""Ready tasks: a config + model + data + step for each workload, driven the same way."""

from __future__ import annotations


from ..errors import suggest
from .base import Recipe, RecipeError
from .custom import CustomRecipe
from .digits import DigitsRecipe
from .finetune import FinetuneRecipe
from .image import ImageClassificationRecipe
from .lm import LanguageModelRecipe
from .pix2pix import Pix2PixRecipe
from .text import TextClassificationRecipe

_RECIPES: dict[str, type[Recipe]] = {
    "digits": DigitsRecipe,
    "image-classification": ImageClassificationRecipe,
    "text-classification": TextClassificationRecipe,
    "language-model": LanguageModelRecipe,
    "finetune": FinetuneRecipe,
    "pix2pix": Pix2PixRecipe,
    "custom": CustomRecipe,
}


def register_recipe(cls: type[Recipe]) -> None:
    _RECIPES[cls.name] = cls


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def get_recipe(name: str) -> Recipe:
    if name not in _RECIPES:
        listing = f"Valid recipes: {', '.join(recipe_names())}"
        raise RecipeError(f"unknown recipe '{name}'{suggest(name, _RECIPES, listing=listing)}")
    return _RECIPES[name]()


__all__ = ["Recipe", "RecipeError", "get_recipe", "recipe_names", "register_recipe"]
