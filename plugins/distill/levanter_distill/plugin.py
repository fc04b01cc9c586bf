"""Entry point of levanter-distill: registers the ``distill`` training objective. Imports
nothing of it (nor JAX): every ``levanter`` command loads this module, and the registry imports
the class only when a run names it."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_objectives(register):
    register("distill", "levanter_distill.objective:DistillObjective")
