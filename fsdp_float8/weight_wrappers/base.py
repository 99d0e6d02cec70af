"""Weight wrapper mechanics, once: a high-precision weight that FSDP2 all-gathers in float8.

A `Float8WeightWrapper` holds the high-precision weight (`_tensor`) and looks like it to
everyone (dtype, shape). Ops unwrap to the inner tensor; the ops FSDP2 uses to build and
pad shards (`PRESERVE_WRAPPER`) keep the wrapper, so the sharded parameter's local tensor
still has the hooks. In-place ops mutate the inner tensor and return the wrapper.

FSDP2 hooks (torch 2.13 signatures):
- `fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`: cast the local
  shard to float8 with `float8_scale(...)` (the only thing subclasses decide), pad it to the
  padded shard size (uneven sharding), return it as a `uint8` view (gloo rejects float8; one
  code path for NCCL too) with the typed metadata record of its format
  (`fsdp_float8.formats`: tensorwise, rowwise, block).
- `fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`: view the gathered
  bytes as float8 and return a `Float8Tensor`; later calls refill `out` in place (its data
  already aliases the all-gather output) and only refresh its scale.

Mutation tracking: every op whose schema marks a wrapper argument as written bumps the
generation of the wrapper's shared `WeightState` (`fsdp_float8.weight_wrappers.state`,
which says why the inner tensor's `_version` cannot serve).
"""

from __future__ import annotations

import operator
import threading

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from fsdp_float8.core.amax_sync import shard_group
from fsdp_float8.core.float8_tensor import normal_outputs
from fsdp_float8.core.gemms import CONTRACTION_DIM, Gemm, Operand
from fsdp_float8.core.scaling import ScalingStrategy, cast_to_float8_data
from fsdp_float8.weight_wrappers.cast import LayerConfig, WeightCast
from fsdp_float8.weight_wrappers.refusals import refuse_cpu_offload, refuse_shards_across_rows
from fsdp_float8.weight_wrappers.state import _WRITTEN, WeightState, written_args

aten = torch.ops.aten
# ops whose output aliases the input's storage: the output shares the wrapper's state
ALIAS_OPS = {
    aten.slice.Tensor,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.split.Tensor,
    aten.detach.default,
    aten.alias.default,
}
# ops that make new storage: the output is a wrapper with a state of its own
COPY_OPS = {aten.clone.default, aten._to_copy.default, aten._pin_memory.default}
NEW_OPS = {aten.empty_like.default, aten.new_empty.default, aten.new_zeros.default}
PRESERVE_WRAPPER = ALIAS_OPS | COPY_OPS | NEW_OPS


def _written_wrappers(func, args, kwargs) -> list[Float8WeightWrapper]:
    written = []
    found = _WRITTEN.get(func)  # `written_args`, cached: no call per op
    for i, name, kwarg_only in written_args(func) if found is None else found:
        value = args[i] if not kwarg_only and i < len(args) else kwargs.get(name)
        for t in tree_leaves(value):  # loops, not comprehensions: every op comes here
            if isinstance(t, Float8WeightWrapper):
                written.append(t)
    return written


# depth > 0 inside Float8WeightWrapper.__deepcopy__ on this thread (see data_ptr); per thread,
# since the ranks of torch's threaded test process group share a process
_DEEPCOPYING = threading.local()

# called with the module before a stale weight's all-gather: the float8 step registers
# one (`fsdp_float8.fsdp.step`), which refreshes the module's whole model in one collective
BEFORE_ALL_GATHER: list = []


class Float8WeightWrapper(torch.Tensor):
    _tensor: torch.Tensor
    _cast: WeightCast  # resolved once from the config (see `cast`)
    _state: WeightState
    # the module attribute that holds the weight (`wrap_weight` sets it: an expert module
    # holds several): the pre-all-gather hook finds the sharded parameter by it
    param_name: str = "weight"
    # the dim a rowwise scale spans: the weight's last, the output GEMM's contraction dim
    ROW_SCALE_DIM = CONTRACTION_DIM[(Gemm.OUTPUT, Operand.WEIGHT)]

    @staticmethod
    def __new__(
        cls,
        tensor: torch.Tensor,
        config: LayerConfig,
        state: WeightState | None = None,
        *,
        cast: WeightCast | None = None,
    ):
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )
        self._tensor = tensor
        self._cast = cast if cast is not None else cls.cast_of(config)
        self._state = state if state is not None else WeightState()
        self._state.register(tensor)
        return self

    @classmethod
    def cast_of(cls, config: LayerConfig) -> WeightCast:
        """The all-gather cast of a weight of this class built from `config` (once per
        wrapper built from a config; FSDP2's copies and views share it): the float8
        weight cast of a `Float8LinearConfig` here, a format of its own in a subclass."""
        return WeightCast.of(config)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._tensor!r})"

    def data_ptr(self) -> int:
        # the inner tensor's address, not a wrapper subclass's 0: tools that key parameters
        # by data_ptr() (accelerate re-maps optimizer parameters after FSDP2 this way)
        # must see one distinct, non-zero key per weight. Tensor.__deepcopy__ asks it too,
        # to tell a wrapper (0: copy by clone) from a tensor with storage.
        return 0 if getattr(_DEEPCOPYING, "depth", 0) else self._tensor.data_ptr()

    def __deepcopy__(self, memo):
        _DEEPCOPYING.depth = getattr(_DEEPCOPYING, "depth", 0) + 1
        try:
            return torch.Tensor.__deepcopy__(self, memo)
        finally:
            _DEEPCOPYING.depth -= 1

    def __tensor_flatten__(self):
        return ["_tensor"], self._config

    @classmethod
    def __tensor_unflatten__(cls, inner, config, outer_size, outer_stride):
        return cls(inner["_tensor"], config)

    def __reduce_ex__(self, protocol):
        # the high-precision tensor and the config; the mutation state starts afresh
        is_param = isinstance(self, torch.nn.Parameter)
        args = (type(self), self._tensor, self._config, is_param, self.requires_grad)
        return (_rebuild_weight_wrapper, args)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # every in-place op of the optimizer step comes here: no Python call per tensor
        # where a C one does (`_inner`), no call for what does not apply
        kwargs = kwargs or {}
        wrappers = []
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, Float8WeightWrapper):
                wrappers.append(a)
        first = wrappers[0]
        written = _written_wrappers(func, args, kwargs)
        inherited = _scale_kept_by_copy(func, args, written) if func is _COPY else None
        for w in written:
            w._state.bump()
        if inherited is not None:
            written[0]._state.stamp_scale(inherited)
        unwrapped = tree_map_only(Float8WeightWrapper, _inner, (args, kwargs))
        out = func(*unwrapped[0], **unwrapped[1])
        if func in PRESERVE_WRAPPER:
            with normal_outputs(args, kwargs):  # a view of a normal tensor is normal
                return tree_map_only(torch.Tensor, lambda t: first._rewrap(t, func), out)
        if func.is_view:  # a plain view (t, select, permute...): writes through it reach
            first._state.watch_viewed(first)  # the weight below autograd
        if out is None or isinstance(out, torch.Tensor):  # none or one output: no tree walk
            for w in wrappers:
                if w._tensor is out:
                    return w
            return out
        inner_to_wrapper = {id(w._tensor): w for w in wrappers}
        return tree_map_only(torch.Tensor, lambda t: inner_to_wrapper.get(id(t), t), out)

    def _rewrap(self, tensor: torch.Tensor, func=None):
        if func in ALIAS_OPS:
            state = self._state
        elif func in COPY_OPS and (tensor.dtype, tensor.device) == (self.dtype, self.device):
            state = self._state.copy_for(tensor)
        else:  # new storage, or values rounded to another dtype / moved to another device
            state = WeightState(blank=func is aten.new_zeros.default)
        new = type(self)(tensor, self._config, state, cast=self._cast)
        new.param_name = self.param_name
        self._copy_state_to(new)
        return new

    def _copy_state_to(self, new: Float8WeightWrapper) -> None:
        """Subclasses carry extra per-wrapper state through FSDP2's ops (none by default:
        value-dependent state belongs in the shared `WeightState`)."""

    # -- scales computed from the current values ---------------------------------------
    def stamp_scale(self, scale: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Remember `scale` as computed from the weight's current values; `scales`, when
        known: (scale, 1 / scale) as one 2-element tensor whose [0] is `scale`."""
        self._state.stamp_scale(scale, scales)

    def fresh_stamped_scale(self) -> torch.Tensor | None:
        """The stamped scale while the weight is unchanged since, else None (no sync)."""
        return self._state.fresh_scale()

    @property
    def mutation_generation(self) -> int:
        """How many in-place writes the weight's storage has seen through the wrapper."""
        return self._state.generation

    # -- what subclasses decide -------------------------------------------------------
    def float8_scale(self, mesh) -> torch.Tensor:
        raise NotImplementedError

    # -- FSDP2 hooks ------------------------------------------------------------------
    @property
    def weight_cast(self) -> WeightCast:
        """The weight's all-gather cast, resolved once (what the hooks read)."""
        return self._cast

    @property
    def _config(self) -> LayerConfig:
        """The config the cast was resolved from (its serialized form)."""
        return self._cast.config

    @property
    def float8_dtype(self) -> torch.dtype:
        return self._cast.float8_dtype

    @property
    def strategy(self) -> ScalingStrategy:
        """The weight's float8 scaling strategy (its all-gather cast): scale path and rules.
        A format that quantizes by its own rules (the 4-bit one) has none."""
        strategy = self._cast.strategy
        if strategy is None:
            raise TypeError(
                f"{type(self).__name__} has no float8 scaling strategy: its format "
                f"({self._cast.family.name}) quantizes its shard by its own rules"
            )
        return strategy

    @property
    def per_row(self) -> bool:
        """Per-output-row scales: local to each dim-0 shard, gathered with the data."""
        return self._cast.per_row

    @property
    def needs_global_amax(self) -> bool:
        """The shard's scale comes from the whole weight's amax (its format family's)."""
        return self._cast.needs_global_amax

    def needs_refresh(self) -> bool:
        """Whether the float8 step has a scale to compute for this weight (host state)."""
        return False

    @property
    def needs_row_shards(self) -> bool:
        """Whether each shard must hold whole rows (per-row, block or tile scales are cut
        along dim 0): true for every format but a tensorwise scale, which covers any cut."""
        return self._cast.per_row

    # the one hook pair: a subclass says how its shard is packed (`pack_shard`); the metadata
    # record it returns says how the gathered outputs become the unsharded weight
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        # the pack of the last unshard while values and stamp stand (backward's re-gather,
        # the next micro-batch): made under the same key, so it passed the checks below
        packed = self._state.packed_for((mesh, tuple(outer_size), self.shape))
        if packed is not None:
            return packed
        refuse_cpu_offload(self, module)
        if self.needs_row_shards and tuple(self.shape[1:]) != tuple(outer_size[1:]):
            refuse_shards_across_rows(self, outer_size, module)
        # scales, stamps and packs outlive this unshard (training reuses them): never
        # inference tensors, also when the first forward runs under torch.inference_mode()
        with torch.inference_mode(False):
            if self.needs_refresh():  # the float8 step refreshes the whole model at once
                for hook in BEFORE_ALL_GATHER:
                    hook(module)
            return self.pack_shard(mesh, outer_size, module)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if isinstance(out, DTensor):  # a tensor-parallel weight: FSDP2 gathers its local part
            out = out._local_tensor
        outputs = tuple(all_gather_outputs)
        if out is None:
            with torch.inference_mode(False):  # the unsharded weight serves training too
                return metadata.build(outputs, param_dtype)
        metadata.refill(out, outputs)  # FSDP2 refilled the gathered buffers in place
        return None

    def pack_shard(self, mesh, outer_size, module):
        """(all-gather inputs, metadata) of this shard: tensorwise or rowwise float8 here;
        other formats (block scales, 4-bit) pack their own. A pack made from values and a
        stamp that stand until the next write is kept (`remember_pack`) for the next
        unshard, which `fsdp_pre_all_gather` answers with it."""
        # a tensorwise scale covers every shard of the weight (FSDP's and tensor parallel's);
        # per-row scales only the shards that split a row (a row-parallel weight's TP dim)
        sharded = getattr(module, self.param_name, None)
        cast = self._cast
        emulate, shards, dtype = cast.emulate, mesh.size(), cast.float8_dtype
        strategy = cast.strategy
        assert strategy is not None  # a float8 cast (other formats pack their own shard)
        # a dynamic scale's amax covers the shard (its own, or the whole weight's)
        saturate = not strategy.own_amax
        place = cast.place
        if cast.per_row:
            place.check_rows(outer_size[0], shards)  # every rank sees this: no rank hangs
            group = shard_group(sharded, (self.ROW_SCALE_DIM,), None)
            # the scale comes from the shard's values alone (no collective, so ranks cannot
            # disagree on whether to run one): the pack is reusable while they stand
            reusable = group is None and strategy.own_amax
            scale = self.float8_scale(group)
            data = cast_to_float8_data(self._tensor, scale, dtype, saturate=saturate)
            # a 3-D expert weight (E, out, in) is sharded over experts; its rows are out rows
            mid = tuple(outer_size[1:-1])
            packed = place.pack(data, scale, emulate, mid, shards=shards)
        else:
            scale = self.float8_scale(shard_group(sharded, None, mesh))
            # the float8 step's stamp (fresh: a new tensor per refresh, written by nothing)
            # with its inverse: the pack is reusable while the values and the stamp stand
            scales = self._state.stamped_scales(scale)
            reusable = scales is not None
            data = cast_to_float8_data(self._tensor, scale, dtype, saturate=saturate)
            packed = place.pack(data, scale, outer_size, shards, emulate, scales)
        if reusable:  # backward's re-gather and the next micro-batch's reuse it
            self._state.remember_pack((mesh, tuple(outer_size), self.shape), packed)
        return packed

    def keep_stamped_pack(self, packed, scale: torch.Tensor, mesh, outer_size):
        """`packed` kept for the next unshard when `scale` is the float8 step's stamp (made
        from the values that stand until the next write), as `pack_shard` keeps its own."""
        # the stamp itself: `scale` came from `fresh_scale()` in this pack, or was made anew
        if scale is self._state._scale:
            self._state.remember_pack((mesh, tuple(outer_size), self.shape), packed)
        return packed


_COPY = aten.copy_.default
_inner = operator.attrgetter("_tensor")  # a wrapper's inner tensor (C: no Python call)


def _scale_kept_by_copy(func, args, written) -> torch.Tensor | None:
    """copy_ of a wrapper with a fresh scale into a blank (all-zero) wrapper: that scale."""
    if func is not aten.copy_.default or not written or not written[0]._state.blank:
        return None
    src = args[1]
    return src._state.fresh_scale() if isinstance(src, Float8WeightWrapper) else None


def _rebuild_weight_wrapper(cls, tensor, config, is_param=False, requires_grad=False):
    wrapper = cls(tensor, config)
    return torch.nn.Parameter(wrapper, requires_grad) if is_param else wrapper


def state_dict_weight(t: torch.Tensor, *, detach: bool) -> torch.Tensor:
    """`plain_weight(t)` (detached when asked) for a state dict, whose in-place writes
    (`dcp.load(model.state_dict())`, a rollback, `nn.init.*`) the wrapper sees. Under FSDP2
    the local tensor of the new DTensor is an autograd-level alias of the inner tensor, so
    writes into it (`.to_local().mul_()`) move the inner tensor's version counter. Writes
    into the DTensor itself reach that local tensor below autograd, so only the DTensor's
    own counter moves: the wrapper's state checks that counter too, also after the DTensor
    dies (`WeightState.register_alias`)."""
    if isinstance(t, DTensor) and isinstance(t._local_tensor, Float8WeightWrapper):
        wrapper = t._local_tensor
        inner = wrapper._tensor
        out = _dtensor_like(t, inner.detach() if detach else inner)
        wrapper._state.register_alias(out)
        return out
    own = plain_weight(t)
    return own.detach() if detach else own


def _dtensor_like(t: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def plain_weight(t: torch.Tensor) -> torch.Tensor:
    """The high-precision weight without the wrapper (a DTensor keeps its sharding), so
    checkpoints hold plain tensors and load anywhere, with or without this package."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and isinstance(t._local_tensor, Float8WeightWrapper):
        return _dtensor_like(t, t._local_tensor._tensor)
    return t._tensor if isinstance(t, Float8WeightWrapper) else t
