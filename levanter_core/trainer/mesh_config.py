"""``trainer.mesh``: how the device mesh is shaped and how logical axes map onto it, in
Levanter's spelling (``levanter.utils.mesh.MeshConfig``).

The mesh has seven axes, outermost first: ``replica_dcn`` (replicas across TPU slices or groups
of processes, over the data-center network), then, within a slice, ``stage`` (the layers split
into consecutive stages: pipeline parallelism; ``layers`` is mapped onto it by default when its
size is not 1), ``replica`` (replicas),
``data`` (the batch, and the parameters under FSDP), ``expert`` (a mixture of experts' experts,
with ``shared_mapping: {experts: expert}``: expert parallelism; the batch is split over it too),
``context`` (each sequence's positions: context parallelism, with ``shared_mapping: {position:
context}``) and ``model`` (tensor parallelism).
``axes`` and ``dcn_axes`` give their sizes; the three mappings say which logical axes of the
arrays (``embed``, ``mlp``, ``heads``, ``batch``...) are split over which mesh axes:

* the compute mapping (activations, and parameters as gathered for compute) is
  ``mlp -> model, heads -> model`` (and ``layers -> stage`` when ``stage`` is split), then ``shared_mapping``, then the batch over
  ``(replica_dcn, replica, data)`` (and ``expert``, when it is split) unless mapped already, then ``compute_mapping``;
* the parameter mapping (parameters and optimizer state at rest) is
  ``mlp -> model, heads -> model`` (and ``layers -> stage``), then ``shared_mapping``, then ``param_mapping``.

The trainer's older fields (``model_axis_size``, ``tensor_parallel_axes``, ``fsdp_axis``...)
are translated into this section (:meth:`TrainerConfig.resolved_mesh
<levanter_core.trainer.config.TrainerConfig.resolved_mesh>`), so there is one code path; the
translation remembers which of those fields each entry came from, and :meth:`MeshConfig.field_of`
and :meth:`MeshConfig.size_field` name them in error messages.

No JAX here: the config is validated before any device is touched.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from levanter_core.config.base import ConfigModel
from levanter_core.errors import ConfigError

REPLICA_DCN_AXIS = "replica_dcn"
"""Mesh axis of the replicas across slices or process groups (``trainer.mesh.dcn_axes.replica_dcn``)."""
REPLICA_AXIS = "replica"
"""Mesh axis of the replicas within a slice or process group (``trainer.mesh.axes.replica``)."""
DATA_AXIS = "data"
"""Mesh axis that splits the batch and, with FSDP, the parameters (``trainer.mesh.axes.data``)."""
EXPERT_AXIS = "expert"
"""Mesh axis of expert parallelism (``trainer.mesh.axes.expert``): a mixture of experts' experts
split over devices, when ``experts`` is mapped onto it; the batch is split over it too."""
STAGE_AXIS = "stage"
"""Mesh axis of pipeline parallelism (``trainer.mesh.axes.stage``): the layers split into
consecutive stages over devices (``layers`` is mapped onto it unless a mapping says otherwise)."""
CONTEXT_AXIS = "context"
"""Mesh axis of context parallelism (``trainer.mesh.axes.context``): the positions of each
sequence split over devices, when ``position`` is mapped onto it."""
MODEL_AXIS = "model"
"""Mesh axis of tensor parallelism (``trainer.mesh.axes.model``)."""
MESH_AXES = (REPLICA_DCN_AXIS, STAGE_AXIS, REPLICA_AXIS, DATA_AXIS, EXPERT_AXIS, CONTEXT_AXIS, MODEL_AXIS)
"""The device mesh's axes, outermost first."""
DATA_PARALLEL_AXES = (REPLICA_DCN_AXIS, REPLICA_AXIS, DATA_AXIS)
"""The mesh axes the batch is split over (unless a mapping says otherwise), and ``expert`` too
where ``trainer.mesh.axes`` gives it a size other than 1."""
ICI_AXES = (STAGE_AXIS, REPLICA_AXIS, DATA_AXIS, EXPERT_AXIS, CONTEXT_AXIS, MODEL_AXIS)
"""The mesh axes within a slice (over the chips' interconnect), in mesh order."""
DCN_AXES = (REPLICA_DCN_AXIS,)
"""The mesh axes across slices (over the data-center network)."""

DEFAULT_ICI_AXES = {DATA_AXIS: -1, REPLICA_AXIS: 1, MODEL_AXIS: 1}
"""Levanter's ``axes``, under the ones a config gives."""
DEFAULT_DCN_AXES = {REPLICA_DCN_AXIS: -1}
"""Levanter's ``dcn_axes``, under the ones a config gives."""
DEFAULT_SHARED_MAPPING = {"mlp": MODEL_AXIS, "heads": MODEL_AXIS}
"""Levanter's mapping under ``shared_mapping``: tensor parallelism over the MLP and the heads."""

UNSUPPORTED_AXES = {
    "sequence": "a sequence axis splits each sequence's positions over devices (sequence parallelism), "
    "which levanter-core does not support yet",
    "pipeline": "a pipeline axis splits the layers into stages over devices (pipeline parallelism), which "
    "levanter-core's mesh calls stage: write stage instead",
}
"""Mesh axes of other kinds of parallelism that Levanter configs may name, what they do, and
what levanter-core has instead."""

PIPELINE_MAPPING = {"layers": STAGE_AXIS}
"""The mapping a split ``stage`` axis implies (under ``shared_mapping``): the stacked layers'
axis over the stages."""

MeshAxes = str | list[str] | None
"""Where a logical axis goes: a mesh axis, a list of them, or nothing (``[]`` or null: not split)."""

MappingName = Literal["shared", "compute", "param"]
"""One of the three mappings of :class:`MeshConfig` (``shared_mapping``, ``compute_mapping``,
``param_mapping``)."""


def _fail(loc: tuple, message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data(
        "mesh", [{"type": PydanticCustomError("mesh", message), "loc": loc, "input": value}]
    )


def _names(value: MeshAxes | tuple[str, ...]) -> list[str]:
    """The mesh axes a mapping value names."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _as_mesh_axes(value: MeshAxes | tuple[str, ...]) -> str | tuple[str, ...]:
    return value if isinstance(value, str) else tuple(_names(value))


def _checked_sizes(sizes: dict[str, int], own: tuple[str, ...], other: tuple[str, ...], where: str) -> None:
    """Each entry of ``sizes`` (``axes`` or ``dcn_axes`` as written) is a size this mesh can
    have: an axis of its own group (``own``), or another one of size 1 (dropped)."""
    for name, size in sizes.items():
        if size < 1 and size != -1:
            raise _fail(
                (name,),
                f"a mesh axis's size is a positive number of devices, or -1 for those left over; got {size}",
                size,
            )
        if name in other:
            group = (
                "within a slice (trainer.mesh.axes)" if where == "dcn_axes" else "across slices (trainer.mesh.dcn_axes)"
            )
            raise _fail(
                (name,),
                f"{name!r} is a mesh axis {group}; an axis is either within a slice or across slices, not both: "
                f"remove it from trainer.mesh.{where}",
                size,
            )
        if name not in own and size != 1:
            if name in UNSUPPORTED_AXES:
                why = UNSUPPORTED_AXES[name]
            else:
                why = (
                    f"{name!r} is not a mesh axis levanter-core has (within a slice: {', '.join(ICI_AXES)}; "
                    f"across slices: {', '.join(DCN_AXES)})"
                )
            raise _fail((name,), f"{why}; remove it or give it size 1", size)


class MeshConfig(ConfigModel):
    """The device mesh and how the model's logical axes map onto it (Levanter's ``trainer.mesh``)."""

    axes: dict[str, int] = Field(default_factory=lambda: dict(DEFAULT_ICI_AXES))
    """Mesh axes within a slice (a TPU slice, or all the devices of a GPU/CPU run) and their
    sizes: ``replica`` (whole copies of the FSDP shards), ``data`` (the batch, and the
    parameters under FSDP), ``model`` (tensor parallelism). -1: the devices left over (at most
    one axis), ``context`` (each sequence's positions, where ``position`` is mapped onto it:
    context parallelism; 1 when not given). Entries are merged over ``{data: -1, replica: 1,
    model: 1}``; if that leaves two -1 and ``data`` was not given, ``data`` is 1. ``expert`` (a
    mixture of experts' experts, where ``experts`` is mapped onto it: expert parallelism; the
    batch is split over it too; 1 when not given). ``stage`` (the layers in consecutive stages:
    pipeline parallelism, ``layers`` mapped onto it unless a mapping says otherwise; 1 when not
    given). Axes of parallelism levanter-core does not have (``sequence``; ``pipeline``, which it
    calls ``stage``) are accepted only with size 1."""
    dcn_axes: dict[str, int] = Field(default_factory=lambda: dict(DEFAULT_DCN_AXES))
    """Mesh axes across slices (over the data-center network) and their sizes: ``replica_dcn``,
    whole replicas, so that only gradients cross the slow network. -1: the number of TPU slices
    (1 on GPU and CPU). A size above 1 off TPU groups whole processes. Merged over
    ``{replica_dcn: -1}``."""
    batch_axis_name: str = "batch"
    """The logical axis of the batch. Unless a mapping names it, it is split over
    ``(replica_dcn, replica, data)`` (and ``expert``, when it is split) while computing."""
    shared_mapping: dict[str, MeshAxes] = Field(default_factory=dict)
    """Logical axis -> mesh axis (or a list of them) for the parameters at rest and while
    computing, over ``{mlp: model, heads: model}``. ``[]`` or null: not split (``mlp: []``
    turns the default off). Where ``heads`` is split and ``kv_heads`` is not mapped, ``kv_heads``
    (the head axis of grouped-query attention) goes where ``heads`` goes."""
    compute_mapping: dict[str, MeshAxes] = Field(default_factory=dict)
    """Logical axis -> mesh axes while computing only (activations, and the parameters as
    gathered for compute), over ``shared_mapping`` and the batch's mapping."""
    param_mapping: dict[str, MeshAxes] = Field(default_factory=lambda: dict[str, MeshAxes](embed=DATA_AXIS))
    """Logical axis -> mesh axes for the parameters and optimizer state at rest only, over
    ``shared_mapping``: ``{embed: data}`` stores every parameter split along ``embed`` over
    ``data`` (FSDP), gathered just in time for compute. ``{}``: no FSDP."""

    _origins: dict[tuple[str, str], str] = PrivateAttr(default_factory=dict)
    """(mapping or ``size``, logical or mesh axis) -> the dotted config field it came from,
    where that is not this section's own field (a translation of the trainer's older fields)."""
    _implied: frozenset[tuple[str, str]] = PrivateAttr(default_factory=frozenset)
    """Mapping entries nobody wrote (a translation's fillers): the axis-name checks skip them."""

    @field_validator("axes")
    @classmethod
    def _ici(cls, axes: dict[str, int]) -> dict[str, int]:
        _checked_sizes(axes, ICI_AXES, DCN_AXES, "axes")
        merged = {**DEFAULT_ICI_AXES, **axes}
        if sum(size == -1 for size in merged.values()) > 1 and DATA_AXIS not in axes:
            merged[DATA_AXIS] = 1  # as Levanter: the axis given -1 takes the devices left over
        absorbing = [name for name, size in merged.items() if size == -1]
        if len(absorbing) > 1:
            raise ValueError(
                f"{' and '.join(absorbing)} are both -1 (the devices left over); at most one axis within a "
                "slice can be -1: give the others a size"
            )
        return merged

    @field_validator("dcn_axes")
    @classmethod
    def _dcn(cls, dcn_axes: dict[str, int]) -> dict[str, int]:
        _checked_sizes(dcn_axes, DCN_AXES, ICI_AXES, "dcn_axes")
        return {**DEFAULT_DCN_AXES, **dcn_axes}

    @model_validator(mode="after")
    def _known_axes_only(self) -> MeshConfig:
        both = sorted(set(self.axes) & set(self.dcn_axes))
        if both:
            raise _fail(
                ("dcn_axes", both[0]),
                f"{both[0]!r} is also in trainer.mesh.axes; an axis is either within a slice or across slices",
                self.dcn_axes[both[0]],
            )
        known = set(self.axes) | set(self.dcn_axes)
        for field in ("shared_mapping", "compute_mapping", "param_mapping"):
            for logical, value in getattr(self, field).items():
                unknown = [name for name in _names(value) if name not in known]
                if unknown:
                    raise _fail(
                        (field, logical),
                        f"{logical!r} is mapped to {unknown[0]!r}, which is not a mesh axis; the mesh axes are "
                        f"{', '.join(MESH_AXES)}",
                        value,
                    )
        # Axes of size 1 beyond the seven split nothing: they go, and so do the mappings onto them.
        dropped = known - set(MESH_AXES)
        if dropped:
            object.__setattr__(self, "axes", {k: v for k, v in self.axes.items() if k not in dropped})
            object.__setattr__(self, "dcn_axes", {k: v for k, v in self.dcn_axes.items() if k not in dropped})
            for field in ("shared_mapping", "compute_mapping", "param_mapping"):
                kept = {}
                for logical, value in getattr(self, field).items():
                    names = [n for n in _names(value) if n not in dropped]
                    kept[logical] = value if names == _names(value) else names
                object.__setattr__(self, field, kept)
        return self

    # -- provenance ----------------------------------------------------------------------
    def traced(self, origins: dict[tuple[str, str], str], implied: set[tuple[str, str]]) -> MeshConfig:
        """This config, remembering for error messages that its entries ``origins`` came from
        other config fields (``("shared", "mlp") -> "trainer.tensor_parallel_axes"``,
        ``("size", "model") -> "trainer.model_axis_size"``), and that nobody wrote the mapping
        entries ``implied``."""
        copy = self.model_copy()
        copy._origins = dict(origins)
        copy._implied = frozenset(implied)
        return copy

    def field_of(self, axis: str, which: Literal["compute", "param"] = "param") -> str:
        """The dotted config field that decides where the ``which`` mapping puts the logical
        ``axis``: for error messages."""
        sources: list[MappingName] = ["compute" if which == "compute" else "param", "shared"]
        for source in sources:
            if axis in getattr(self, f"{source}_mapping"):
                return self._origins.get((source, axis), f"trainer.mesh.{source}_mapping.{axis}")
        if which == "compute" and axis == self.batch_axis_name:
            return self._origins.get(("batch", axis), "trainer.mesh.batch_axis_name")
        if axis in PIPELINE_MAPPING and self.pipelined():
            return f"{self.size_field(STAGE_AXIS)} (which maps {axis} -> {PIPELINE_MAPPING[axis]})"
        if axis in DEFAULT_SHARED_MAPPING:
            return f"trainer.mesh.shared_mapping.{axis} (by default {axis} -> {DEFAULT_SHARED_MAPPING[axis]})"
        if axis == "kv_heads":
            return f"{self.field_of('heads', which)} (heads, which splits kv_heads)"
        return f"trainer.mesh.{which}_mapping.{axis}"

    def size_field(self, mesh_axis: str) -> str:
        """The dotted config field (or the rule) that decides the size of ``mesh_axis``: for
        error messages."""
        origin = self._origins.get(("size", mesh_axis))
        if origin is not None:
            return origin
        group = "dcn_axes" if mesh_axis in self.dcn_axes else "axes"
        field = f"trainer.mesh.{group}.{mesh_axis}"
        return f"{field} (-1: the devices left over)" if getattr(self, group).get(mesh_axis) == -1 else field

    def written_entries(self) -> list[tuple[MappingName, str, str]]:
        """The entries of the three mappings that split something and that a config wrote
        (not Levanter's defaults under ``shared_mapping``, not a translation's fillers), as
        ``(mapping, logical axis, dotted field)``: the axes a model must have."""
        entries: list[tuple[MappingName, str, str]] = []
        for source in ("shared", "compute", "param"):
            for logical, value in getattr(self, f"{source}_mapping").items():
                if _names(value) and (source, logical) not in self._implied:
                    field = self._origins.get((source, logical), f"trainer.mesh.{source}_mapping.{logical}")
                    entries.append((source, logical, field))
        return entries

    # -- resolution ----------------------------------------------------------------------
    def pipelined(self) -> bool:
        """Whether ``axes`` gives ``stage`` a size other than 1 (pipeline parallelism)."""
        return self.axes.get(STAGE_AXIS, 1) != 1

    def _merged(self, which: Literal["compute", "param"]) -> dict[str, Any]:
        implied = PIPELINE_MAPPING if self.pipelined() else {}
        mapping: dict[str, Any] = {**DEFAULT_SHARED_MAPPING, **implied, **self.shared_mapping}
        if which == "compute":
            if self.batch_axis_name not in mapping:
                mapping[self.batch_axis_name] = self.compute_mapping.get(self.batch_axis_name, self.batch_axes())
            mapping.update(self.compute_mapping)
        else:
            mapping.update(self.param_mapping)
        if "kv_heads" not in mapping and _names(mapping.get("heads")):
            mapping["kv_heads"] = mapping["heads"]  # grouped-query attention's heads go with the heads
        return mapping

    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over unless a mapping names it: ``(replica_dcn,
        replica, data)``, and ``expert`` where ``axes`` gives it a size other than 1 (each
        expert device then holds its own tokens, and exchanges them with the others)."""
        return DATA_PARALLEL_AXES + ((EXPERT_AXIS,) if self.axes.get(EXPERT_AXIS, 1) != 1 else ())

    def _resolved(self, which: Literal["compute", "param"]) -> dict[str, Any]:
        return {axis: _as_mesh_axes(value) for axis, value in self._merged(which).items() if _names(value)}

    def compute_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes while computing: ``{mlp: model, heads: model}``, then
        ``shared_mapping``, then the batch over ``(replica_dcn, replica, data)`` (and ``expert`` when split; unless mapped),
        then ``compute_mapping``; entries mapped to nothing left out."""
        return self._resolved("compute")

    def parameter_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes at rest (parameters, optimizer state): ``{mlp: model, heads:
        model}``, then ``shared_mapping``, then ``param_mapping``; entries mapped to nothing left
        out."""
        return self._resolved("param")

    def replicas(self) -> int:
        """How many data-parallel replicas the config fixes before the devices are known
        (``replica_dcn x replica``, a -1 counting as 1): the data-parallel size is a multiple."""
        sizes = (self.dcn_axes[REPLICA_DCN_AXIS], self.axes[REPLICA_AXIS])
        return math.prod(size for size in sizes if size != -1)

    def resolved_sizes(self, num_devices: int, num_slices: int = 1) -> dict[str, int]:
        """The size of each of the seven mesh axes, outermost first, on ``num_devices`` devices in
        ``num_slices`` slices (TPU slices; 1 elsewhere); a :class:`ConfigError` naming the
        fields when they do not fit."""
        dcn = self.dcn_axes[REPLICA_DCN_AXIS]
        dcn = num_slices if dcn == -1 else dcn
        ici = {axis: self.axes.get(axis, 1) for axis in ICI_AXES}
        fixed = math.prod(size for size in ici.values() if size != -1)
        if num_devices % (dcn * fixed):
            sizes = [
                (axis, ici[axis])
                for axis in (MODEL_AXIS, CONTEXT_AXIS, EXPERT_AXIS, STAGE_AXIS, REPLICA_AXIS, DATA_AXIS)
            ]
            if self.dcn_axes[REPLICA_DCN_AXIS] != -1:
                sizes.append((REPLICA_DCN_AXIS, dcn))
            named = [f"{self.size_field(axis)} ({size})" for axis, size in sizes if size > 1]
            product = math.prod(size for _, size in sizes if size > 1)
            what = f"{named[0]} does" if len(named) == 1 else f"{' x '.join(named)} = {product} does"
            where, whole = f"the {num_devices} available device(s)", num_devices
            if dcn > 1 and self.dcn_axes[REPLICA_DCN_AXIS] == -1:
                whole = num_devices // dcn
                where = f"the {whole} device(s) of each of the {dcn} slices"
            rest = next((axis for axis, size in ici.items() if size == -1), DATA_AXIS)
            raise ConfigError(
                f"{what} not divide {where}: the rest of the devices form the {rest} axis; choose sizes whose "
                f"product divides {whole}"
            )
        per_slice = num_devices // dcn
        absorbing = [axis for axis, size in ici.items() if size == -1]
        if absorbing:
            ici[absorbing[0]] = per_slice // fixed
        elif fixed != per_slice:
            spelled = " x ".join(f"{self.size_field(axis)} ({size})" for axis, size in ici.items())
            raise ConfigError(
                f"{spelled} = {fixed} device(s) per slice, but each of the {dcn} slice(s) has {per_slice}: the sizes "
                f"within a slice must multiply to {per_slice}; give one of them -1 (the devices left over)"
            )
        return {REPLICA_DCN_AXIS: dcn, **ici}
