"""Entry point of levanter-preference: registers the ``preference`` data format and the ``dpo``
training objective. Imports neither (nor JAX): every ``levanter`` command loads this module, and
the registry imports a class only when a run names it."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_data_formats(register):
    register("preference", "levanter_preference.format:PreferenceFormat")


@hookimpl
def register_objectives(register):
    register("dpo", "levanter_preference.objective:DpoObjective")
