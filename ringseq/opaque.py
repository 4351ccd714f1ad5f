"""What ringseq hands a model's layers through keyword arguments, opaque to every engine.

A patched model passes its batch's facts to each decoder layer as the ``ringseq`` keyword argument
(``ringseq.batch.ShardedBatch``; in a decode step, ``ringseq.patches.cache.DecodeStep``). Engines
walk a forward's inputs and rebuild what they recognise: FSDP2's and FSDP1's input cast
(``torch.distributed.utils._apply_to_tensors``: a dataclass is rebuilt by ``dataclasses.replace``,
its floating tensors cast), DDP's device move (``_recursive_to``: tuples, lists, dicts), Accelerate's
``send_to_device`` (anything with a ``.to``), DeepSpeed's input walks (lists, tuples, dicts, anything
with ``.half``), ``torch.utils._pytree`` (registered types). An ``Opaque`` is none of those: not a
dataclass, a container or a registered pytree node, no ``.to`` or ``.half``, and a copy of it is
itself. So every walker hands it on as itself, and it is never cast, copied or registered again per
layer. Its ``key``, a 0-d int64 tensor made once with it, names it to the compiled ops
(``ringseq.attention.compiled.register_batch``); dynamo reads the key as a graph input and guards on
nothing else of the object but the flags the traced code reads.

Its fields are fixed at construction (``replace`` makes a new one, under a new key).
"""
from __future__ import annotations

from ringseq.attention.compiled import register_batch

REQUIRED = object()


class Opaque:
    """Immutable keyword fields, a key for the compiled ops, and nothing an engine walks into.
    Subclasses name their fields and defaults in ``FIELDS`` (name -> default, ``REQUIRED``: required)
    and may finish construction in ``_made``."""

    FIELDS: dict = {}

    def __init__(self, **values):
        unknown = sorted(set(values) - set(self.FIELDS))
        missing = sorted(n for n, d in self.FIELDS.items() if d is REQUIRED and n not in values)
        if unknown or missing:
            raise TypeError(f"{type(self).__name__}: unknown fields {unknown}, missing fields {missing}")
        for name, default in self.FIELDS.items():
            object.__setattr__(self, name, values.get(name, default))
        object.__setattr__(self, "key", register_batch(self))
        self._made()

    def _made(self) -> None:
        """Construction's last step (the fields and key are set)."""

    def fields(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}

    def replace(self, **changes) -> "Opaque":
        """A new object of this type with ``changes`` (and a key of its own)."""
        return type(self)(**{**self.fields(), **changes})

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable: use .replace({name}=...)")

    def __delattr__(self, name):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __copy__(self):  # immutable: a copy is the object itself (its key still names it)
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={_short(getattr(self, n))}" for n in self.FIELDS)
        return f"{type(self).__name__}({shown})"


def _short(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"<{value.dtype} {tuple(shape)}>"
    return type(value).__name__ if value.__class__.__module__.startswith("ringseq") else repr(value)
