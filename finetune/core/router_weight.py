"""The weight a mixture of experts gives its router balancing loss, read where its own forward reads it.

transformers' mixtures of experts add `weight × aux_loss` to `loss` in their forward (`loss += self.router_aux_loss_coef
* aux_loss.to(loss.device)`), the weight kept under the family's own name: `router_aux_loss_coef` for most, JetMoE's
`aux_loss_coef`, DBRX's `ffn_config.moe_loss_weight` (copied to `self.router_aux_loss_coef` in its __init__), a VLM's
`config.text_config.router_aux_loss_coef`. So no list of names: the forward's source is parsed for the product of
`aux_loss` with an attribute of `self`, and that attribute is read on the model; its config key comes from the class's
__init__ (`self.X = config.K`), so that it can be read from a config before any weight loads. Where the source cannot
be read (a class without one), the weight is `router_aux_loss_coef` of the model or its config, as before.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from transformers.trainer_utils import unwrap_peft_model

DEFAULT_KEY = "router_aux_loss_coef"  # read where the forward's source says nothing (transformers' usual name)


def _source_tree(function) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))  # getsource unwraps decorators
    except (OSError, TypeError, SyntaxError):
        return None


def _self_path(node: ast.AST, root: str = "self") -> tuple[str, ...] | None:
    """`self.a.b` → ("a", "b"); None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return tuple(reversed(names)) if isinstance(node, ast.Name) and node.id == root and names else None


def _mentions_aux_loss(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "aux_loss" for n in ast.walk(node))


def _own_method(cls: type, name: str):
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    return None if owner is None else vars(owner)[name]


@functools.cache
def weight_path(cls: type) -> tuple[str, ...] | None:
    """The attribute path of `self` that `cls.forward` multiplies `aux_loss` by (("router_aux_loss_coef",),
    ("config", "text_config", "router_aux_loss_coef")); None where its source shows no such product."""
    tree = _source_tree(_own_method(cls, "forward"))
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for weight, other in ((node.left, node.right), (node.right, node.left)):
                if (path := _self_path(weight)) is not None and _mentions_aux_loss(other):
                    return path
    return None


@functools.cache
def config_key(cls: type) -> tuple[str, ...] | None:
    """The config key the weight of `cls.forward`'s balancing loss comes from: its path under `self.config`, or
    what `cls.__init__` assigns the attribute from (`self.aux_loss_coef = config.aux_loss_coef`); None if unknown."""
    path = weight_path(cls)
    if path is None:
        return None
    if path[0] == "config":
        return path[1:] or None
    for owner in cls.__mro__:
        tree = _source_tree(vars(owner)["__init__"]) if "__init__" in vars(owner) else None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Assign) and any(_self_path(t) == path[:1] for t in node.targets):
                source = _self_path(node.value, root="config")
                return None if source is None else source + path[1:]
    return None


def _read(obj, path: tuple[str, ...]):
    for name in path:
        obj = getattr(obj, name, None)
    return obj


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def balance_coefficient(model: torch.nn.Module) -> float | None:
    """The weight a mixture of experts' own forward gives its router balancing loss when it adds it to `loss`, read
    where the forward reads it; None where the model sets none."""
    model = unwrap_peft_model(model)
    if (path := weight_path(type(model))) is not None:
        return _number(_read(model, path))
    coefficient = getattr(model, DEFAULT_KEY, None)
    if coefficient is None:
        coefficient = getattr(getattr(model, "config", None), DEFAULT_KEY, None)
    return _number(coefficient)


def coefficient_key(model: torch.nn.Module) -> str:
    """The config key (dotted) that the weight of the model's balancing loss is read from."""
    key = config_key(type(unwrap_peft_model(model)))
    return ".".join(key) if key else DEFAULT_KEY


def model_class_of(config) -> type | None:
    """The class transformers builds for `config` (a causal LM, else an image-text-to-text model); None if none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING):
        try:
            return mapping[type(config)]
        except (KeyError, ValueError):
            continue
    return None


def config_coefficient(config, text_config) -> float | None:
    """The weight of the balancing loss a model built from `config` adds, read before its weights load: the config
    key its class's forward reads, else `router_aux_loss_coef` of `text_config` (its language model part)."""
    cls = model_class_of(config)
    if cls is not None and (key := config_key(cls)) is not None:
        return _number(_read(config, key))
    return _number(getattr(text_config, DEFAULT_KEY, None))
