"""How a model's parameters become ddiloco's tensor list (names, sizes, embedding flags).

Internal helpers of the package: no maths here, only the bookkeeping that both
ddiloco.Learner and ddiloco.Syncer must do identically so that they derive the
same plan.
"""
from __future__ import annotations

import difflib
import inspect
import re
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch

NamedParameters = Union[torch.nn.Module, Iterable[Tuple[str, torch.Tensor]]]
EmbeddingRule = Union[None, Callable[[str, torch.Tensor], bool], Iterable[str]]

# A name component that says "embedding": tok_emb, pos_emb, embed_tokens,
# word_embeddings, embedding, wte, wpe (GPT-2 names). Not "member" or "emblem".
_EMBEDDING_COMPONENT = re.compile(r"^(?:.*_)?(?:emb|embed|embeds|embedding|embeddings)(?:_.*)?$|^(?:wte|wpe)$",
                                  re.IGNORECASE)


def default_embedding_rule(name: str, parameter: torch.Tensor) -> bool:
    """The default rule: True when a dot-separated component of the name other
    than the last one is an embedding name (``tok_emb``, ``pos_emb``,
    ``embed_tokens``, ``word_embeddings``, ``embedding``, ``wte``, ``wpe``).

    When a ``torch.nn.Module`` is given, parameters of its ``nn.Embedding`` and
    ``nn.EmbeddingBag`` submodules are embeddings as well. Output heads are not
    recognised by name: pass ``embedding=`` to mark them (a tied head is the
    embedding parameter itself and is listed once).
    """
    parts = name.split(".")[:-1]
    return any(_EMBEDDING_COMPONENT.match(p) for p in parts)


def named_parameters(model: NamedParameters, who: str) -> Tuple[List[str], List[torch.Tensor], set]:
    """(names, tensors, names of parameters of nn.Embedding modules), in model order."""
    embedding_modules = set()
    if isinstance(model, torch.nn.Module):
        for mod_name, mod in model.named_modules():
            if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                for p_name, _ in mod.named_parameters(recurse=False):
                    embedding_modules.add(f"{mod_name}.{p_name}" if mod_name else p_name)
        pairs = list(model.named_parameters())
    elif isinstance(model, torch.Tensor):
        raise TypeError(f"{who}: got a single tensor; pass a torch.nn.Module or (name, tensor) pairs, "
                        "e.g. [('w', w)] or model.named_parameters()")
    else:
        try:
            pairs = list(model)
        except TypeError:
            raise TypeError(f"{who}: got a {type(model).__name__}; pass a torch.nn.Module or an iterable of "
                            "(name, tensor) pairs such as model.named_parameters()") from None
    names, tensors = [], []
    for i, item in enumerate(pairs):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"{who}: item {i} is {item!r:.60}, not a (name, tensor) pair; pass "
                            "model.named_parameters() or [(name, tensor), ...]")
        names.append(item[0])
        tensors.append(item[1])
    if not names:
        raise ValueError(f"{who}: the model has no parameters; pass the model whose parameters ddiloco synchronises")
    return names, tensors, embedding_modules


def embedding_flags(names: Sequence[str], tensors: Sequence[torch.Tensor], modules: set,
                    rule: EmbeddingRule, who: str) -> List[bool]:
    """One flag per parameter: averaged plainly (True) or by RDA (False)."""
    if rule is None:
        return [n in modules or default_embedding_rule(n, t) for n, t in zip(names, tensors)]
    if callable(rule):
        return [bool(rule(n, t)) for n, t in zip(names, tensors)]
    if isinstance(rule, str):
        rule = [rule]
    wanted = set(rule)
    unknown = sorted(wanted - set(names))
    if unknown:
        raise ValueError(f"{who}: embedding= names {unknown} that are not parameters; the parameters are "
                         f"{list(names)[:8]}{' ...' if len(names) > 8 else ''}")
    return [n in wanted for n in names]


def default_fragments(fragments: Optional[int], count: int) -> int:
    """P: as given, or min(4, number of tensors)."""
    return min(4, count) if fragments is None else fragments


def reject_unknown(who: str, function: Callable, unknown: dict) -> None:
    """TypeError naming the first unknown keyword, the closest known one and all of them."""
    if not unknown:
        return
    known = [p.name for p in inspect.signature(function).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    name = sorted(unknown)[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TypeError(f"{who}: unknown keyword argument {name!r}{hint} (the keywords are: {', '.join(known)})")


def fill(who: str, options, values: dict) -> None:
    """Sets options.<attribute> for each keyword -> (attribute, value); a value of the wrong type or
    range (a negative count, a string for a number) is a TypeError naming the keyword."""
    for keyword, (attribute, value) in values.items():
        default = getattr(options, attribute)
        try:
            if isinstance(default, bool) and not isinstance(value, bool):
                raise TypeError
            setattr(options, attribute, value)
        except TypeError:
            kind = {bool: "True or False", int: "an int >= 0", float: "a number", str: "a string"}[type(default)]
            raise TypeError(f"{who}: {keyword} = {value!r} must be {kind}") from None
