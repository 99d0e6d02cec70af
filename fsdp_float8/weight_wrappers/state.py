"""How a weight wrapper knows its values changed: `WeightState`.

In-place ops on a wrapper reach its inner tensor inside `__torch_dispatch__`, below the
autograd layer that bumps version counters, so the inner tensor's `_version` never moves.
Instead every op whose schema marks a wrapper argument as written (`written_args`) bumps a
generation counter in the wrapper's `WeightState` (`fsdp_float8.weight_wrappers.base`
does it at dispatch). Wrappers that alias one inner storage (views, slices, `detach`,
`.data`: what FSDP2 and optimizers make of the sharded parameter) share one state; copies
get their own. A scale stamped into the state (`stamp_scale`) is fresh while the generation
is unchanged and no inner tensor of the state was written directly (a checkpoint loader
writing into a state_dict's plain tensors bumps their `_version`, which is checked too; a
state dict's DTensors are checked by their own counters, `register_alias`).
"""

from __future__ import annotations

import weakref

import torch


class WeightState:
    """Shared by the wrappers that alias one inner storage: how many writes it has seen
    (`generation`) and a scale computed from its values at one generation.

    `blank`: the storage holds zeros and nothing was written yet (FSDP2's `new_zeros`
    padded shard). Copying a wrapper with a fresh scale into a blank storage keeps that
    scale fresh: zeros do not change an amax, and FSDP2 re-pads a shard this way on some
    ranks only (uneven sharding), so every rank must reach the same freshness.
    """

    __slots__ = (
        "generation", "blank", "_scale", "_scales", "_scale_generation", "_inners", "_packed"
    )  # fmt: skip

    def __init__(self, *, blank: bool = False) -> None:
        self.generation = 0
        self.blank = blank
        self._scale: torch.Tensor | None = None
        # the stamp's (scale, 1 / scale) as one 2-element tensor whose [0] is `_scale`, when
        # the stamp brought the inverse: the one record of both (`stamp_scale`)
        self._scales: torch.Tensor | None = None
        self._scale_generation = -1
        # id(inner) -> (weakref to it, its _version when registered or stamped)
        self._inners: dict[int, tuple[weakref.ref, int]] = {}
        # (key, generation, inner versions, packed all-gather inputs): `remember_pack`
        self._packed: tuple | None = None

    def register(self, inner: torch.Tensor) -> None:
        # the entry leaves with the tensor (an alias per forward must not pile up)
        key, inners = id(inner), self._inners
        inners[key] = (weakref.ref(inner, lambda _: inners.pop(key, None)), inner._version)

    def register_alias(self, alias: torch.Tensor) -> None:
        """Check `alias` (a tensor over the same values whose own in-place writes reach the
        inner tensor below autograd: the DTensor a state dict holds) like an inner tensor,
        and when it dies, count a write it took since the last stamp as a write here. Its
        `detach()` shares its version counter and outlives it until then."""
        shadow, key, inners = alias.detach(), id(alias), self._inners

        def retire(_) -> None:
            entry = inners.pop(key, None)
            if entry is not None and shadow._version != entry[1]:
                self.bump()

        inners[key] = (weakref.ref(alias, retire), alias._version)

    def watch_viewed(self, base: torch.Tensor) -> None:
        """`base` (a wrapper over these values) handed out a plain view of them (`t`,
        `select`, `permute`...). Such a view shares `base`'s version counter, not the inner
        tensor's, so a write through it is seen only there: count a write now (one may
        follow at once), check `base`'s counter while it lives, and count one more when it
        dies (its views die first; one of them may have written after the last stamp)."""
        self.bump()
        key, inners = id(base), self._inners
        if key in inners:
            return

        def retire(_) -> None:
            if inners.pop(key, None) is not None:
                self.bump()

        inners[key] = (weakref.ref(base, retire), base._version)

    def bump(self) -> None:
        self.generation += 1
        self.blank = False
        self._packed = None  # stale from now on: free it

    def remember_pack(self, key: tuple, packed: object) -> None:
        """Keep a shard's packed all-gather inputs, valid while the values do not change
        (the same checks as a stamped scale's), the stamp stands (the same stamped tensor,
        not written since) and for the same `key`."""
        scale = self._scale
        stamp = None if scale is None else (scale, scale._version)
        self._packed = (key, self.generation, self._versions(), stamp, packed)

    def packed_for(self, key: tuple) -> object | None:
        """What `remember_pack` kept for `key` if no write happened since and the stamp
        stands, else None. Keys hold objects (meshes) compared by identity and plain values
        (ints, shapes) compared by value. One call on the hot path: the all-gather hook asks
        it first, for every weight, at every unshard."""
        if self._packed is None:
            return None
        k, generation, versions, stamp, packed = self._packed
        if generation != self.generation or len(k) != len(key):
            return None
        for a, b in zip(k, key, strict=True):
            if a is not b and not (isinstance(a, _PLAIN) and isinstance(b, _PLAIN) and a == b):
                return None
        scale = self._scale
        if stamp is None:
            if scale is not None:
                return None
        elif scale is not stamp[0] or scale._version != stamp[1]:
            return None
        seen = 0
        for key_, (ref, _) in self._inners.items():
            inner = ref()
            if inner is not None:
                if versions.get(key_) != inner._version:
                    return None
                seen += 1
        return packed if seen == len(versions) else None

    def _versions(self) -> dict[int, int]:
        versions = {}
        for k, (ref, _) in self._inners.items():  # a loop: no comprehension call
            t = ref()
            if t is not None:
                versions[k] = t._version
        return versions

    def stamp_scale(self, scale: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Stamp `scale` as computed from the current values; `scales`: (scale, 1 / scale)
        as one 2-element tensor whose [0] is `scale`, when the caller has the inverse."""
        self._scale, self._scales, self._scale_generation = scale, scales, self.generation
        self._packed = None  # made with the previous stamp: free it
        for key, (ref, _) in list(self._inners.items()):  # each inner's version, now
            inner = ref()
            if inner is None:
                del self._inners[key]
            else:
                self._inners[key] = (ref, inner._version)

    def stamped_scales(self, scale: torch.Tensor) -> torch.Tensor | None:
        """The stamp's (scale, 1 / scale) when `scale` is the stamped scale and came with
        its inverse, else None."""
        return self._scales if scale is self._scale else None

    def fresh_scale(self) -> torch.Tensor | None:
        """The stamped scale if no write happened since, else None (host-side, no sync)."""
        if self._scale is None or self._scale_generation != self.generation:
            return None
        for key, (ref, version) in list(self._inners.items()):
            inner = ref()
            if inner is None:
                del self._inners[key]
            elif inner._version != version:
                return None
        return self._scale

    def copy_for(self, inner: torch.Tensor) -> WeightState:
        """The state of a copy with the same values (clone): a fresh scale stays fresh."""
        new = WeightState()
        new.register(inner)
        scale = self.fresh_scale()
        if scale is not None:
            new.stamp_scale(scale, self._scales)
        return new


_PLAIN = (int, float, str, tuple)  # key values compared by value (the rest by identity)


_WRITTEN: dict[object, tuple[tuple[int, str, bool], ...]] = {}


def written_args(func) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, kwarg_only) of each argument the op's schema says it writes."""
    found = _WRITTEN.get(func)
    if found is None:
        found = tuple(
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITTEN[func] = found
    return found
