"""Entry point of levanter-preference: registers the ``preference`` data format and the ``dpo``,
``simpo``, ``ipo`` and ``orpo`` training objectives. Imports none of them (nor JAX): every
``levanter`` command loads this module, and the registry imports a class only when a run names
it."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_data_formats(register):
    register("preference", "levanter_preference.format:PreferenceFormat")


@hookimpl
def register_objectives(register):
    register("dpo", "levanter_preference.objective:DpoObjective")
    register("simpo", "levanter_preference.variants:SimpoObjective")
    register("ipo", "levanter_preference.variants:IpoObjective")
    register("orpo", "levanter_preference.variants:OrpoObjective")
