"""One walker over nested containers, used everywhere distfn looks inside a user's value.

Results sent back from rank 0, tensors gathered for metrics, modules and optimizers found in a training state:
all of them are "a leaf, or a container of such". Having one walker means every operation agrees on what a
container is:

* mappings: ``dict`` and its subclasses (``OrderedDict``, ``defaultdict`` keeps its factory) and any other
  ``Mapping`` (rebuilt as a plain ``dict``);
* sequences: ``list`` and ``tuple`` and their subclasses, namedtuples included (rebuilt with their fields);
* everything else is a leaf (tensors, numbers, strings, sets, arbitrary objects).

Accelerate's ``recursively_apply`` + ``honor_type`` and Fabric's ``apply_to_collection`` play the same role.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

Leaf = Callable[[Any], bool]


def _never(_: Any) -> bool:
    return False


def is_namedtuple(value: Any) -> bool:
    """Whether ``value`` is a namedtuple instance (a tuple whose type has ``_fields``)."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def is_container(value: Any) -> bool:
    """Whether the walker descends into ``value`` (a mapping, list or tuple)."""
    return isinstance(value, (Mapping, list, tuple))


def children(value: Any) -> list[tuple[Any, Any]]:
    """The ``(key, child)`` pairs of a container (keys of a mapping, indices of a sequence); ``[]`` for a leaf."""
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    return []


def rebuild(value: Any, items: Iterable[Any]) -> Any:
    """A container of the same type as ``value`` holding ``items`` (values in the order of `children`)."""
    new_items = list(items)
    if isinstance(value, Mapping):
        pairs = list(zip(value.keys(), new_items, strict=True))
        if isinstance(value, dict) and type(value) is not dict:
            # copy() keeps what the subclass carries (defaultdict's factory, attributes); then refill it.
            try:
                clone = copy.copy(value)
                clone.clear()
                clone.update(pairs)
                return clone
            except Exception:  # noqa: BLE001 - an exotic subclass: fall back to a plain dict
                return dict(pairs)
        return dict(pairs)
    if is_namedtuple(value):
        return type(value)(*new_items)
    if isinstance(value, (list, tuple)):
        if type(value) in (list, tuple):
            return type(value)(new_items)
        try:
            return type(value)(new_items)
        except Exception:  # noqa: BLE001 - a subclass with another constructor
            return list(new_items) if isinstance(value, list) else tuple(new_items)
    raise TypeError(f"rebuild() needs a container, got {type(value).__name__}")


def _descends(value: Any, is_leaf: Leaf) -> bool:
    return is_container(value) and not is_leaf(value)


def _cycle(value: Any) -> ValueError:
    return ValueError(f"a {type(value).__name__} inside the value contains itself (a cycle): distfn walks nested "
                      "dicts, lists and tuples, which must form a tree; break the cycle (or wrap that part in an "
                      "object of your own, which is passed as one value)")


def tree_map(fn: Callable[[Any], Any], value: Any, *, is_leaf: Leaf = _never) -> Any:
    """``value`` with ``fn`` applied to every leaf, containers rebuilt with their own types.

    ``is_leaf(x)`` can stop the descent at a container (for example to treat a whole ``nn.Module`` state or a
    specific mapping type as one value). The walk keeps its own stack instead of recursing, so a value nested
    deeper than Python's recursion limit (which pickle can still send: a `cfg` of 400 nested lists) is fine; a
    container that contains itself is a ``ValueError``.
    """
    if not _descends(value, is_leaf):
        return fn(value)
    # One frame per open container: (the container, its remaining children, the results of those done).
    stack: list[tuple[Any, Iterator[tuple[Any, Any]], list[Any]]] = [(value, iter(children(value)), [])]
    open_ids = {id(value)}
    while True:
        node, pending, done = stack[-1]
        for _, child in pending:
            if not _descends(child, is_leaf):
                done.append(fn(child))
            elif id(child) in open_ids:
                raise _cycle(child)
            else:  # descend: the child's frame is finished first, then this one resumes where it was
                stack.append((child, iter(children(child)), []))
                open_ids.add(id(child))
                break
        else:
            stack.pop()
            open_ids.discard(id(node))
            built = rebuild(node, done)
            if not stack:
                return built
            stack[-1][2].append(built)


def tree_leaves(value: Any, *, is_leaf: Leaf = _never) -> list[Any]:
    """Every leaf of ``value`` in a fixed, depth-first order (mapping insertion order, then sequence order).

    Iterative like `tree_map`: any depth; a container that contains itself is a ``ValueError``."""
    if not _descends(value, is_leaf):
        return [value]
    leaves: list[Any] = []
    stack: list[tuple[Any, Iterator[tuple[Any, Any]]]] = [(value, iter(children(value)))]
    open_ids = {id(value)}
    while stack:
        node, pending = stack[-1]
        for _, child in pending:
            if not _descends(child, is_leaf):
                leaves.append(child)
            elif id(child) in open_ids:
                raise _cycle(child)
            else:
                stack.append((child, iter(children(child))))
                open_ids.add(id(child))
                break
        else:
            stack.pop()
            open_ids.discard(id(node))
    return leaves


def tree_unflatten(template: Any, leaves: Iterable[Any], *, is_leaf: Leaf = _never) -> Any:
    """``template`` with its leaves replaced, in order, by ``leaves`` (the inverse of `tree_leaves`)."""
    it = iter(leaves)
    return tree_map(lambda _: next(it), template, is_leaf=is_leaf)
